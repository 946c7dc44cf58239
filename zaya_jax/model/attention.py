"""The attention core of CCA: the XLA path (zaya_jax/kernels/xla_attention.py, re-exported here)
or the Pallas flash-attention kernel, run per device on a mesh.

Inputs are the post-QK-norm, post-RoPE queries and keys:
  q [B, S, N, H], k and v [B, T, K, H], N = K * G  ->  out [B, S, N, H].
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.kernels import flash_attention, kernel_options
from zaya_jax.kernels.xla_attention import MASK_VALUE, attention_allowed, xla_attention
from zaya_jax.parallel.mesh import MESH_AXES, mesh_platform

__all__ = ["MASK_VALUE", "attention_allowed", "pallas_attention", "xla_attention"]


def pallas_attention(
    q_bsnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    *,
    scale: float,
    segment_ids: jax.Array | None,
    key_mask: jax.Array | None,
    sliding_window: jax.Array | int | None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """The Pallas flash-attention kernel with the semantics of `xla_attention` + `attention_allowed`
    (positions = token order). On a mesh it runs per device on the batch shard: a pallas_call is
    not partitioned by XLA. Triton for the mesh's GPUs, interpreted on CPU (`mesh_platform`)."""
    options = kernel_options(mesh_platform(mesh))

    def run(q, k, v, seg, mask):
        return flash_attention(
            q,
            k,
            v,
            scale=scale,
            causal=True,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            key_mask=mask,
            sliding_window=sliding_window,
            **options,
        )

    if mesh is None:
        return run(q_bsnh, k_bskh, v_bskh, segment_ids, key_mask)
    rows = P(MESH_AXES)
    spec = lambda x: None if x is None else rows
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(rows, rows, rows, spec(segment_ids), spec(key_mask)),
        out_specs=rows,
        check_vma=False,
    )(q_bsnh, k_bskh, v_bskh, segment_ids, key_mask)
