"""The attention core of CCA: the XLA path (zaya_jax/kernels/xla_attention.py, re-exported here),
the Pallas flash-attention kernel or the plain-XLA blockwise attention, the last two run per device
on a mesh.

Inputs are the post-QK-norm, post-RoPE queries and keys:
  q [B, S, N, H], k and v [B, T, K, H], N = K * G  ->  out [B, S, N, H].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.kernels import blockwise_attention, flash_attention, kernel_options
from zaya_jax.kernels.xla_attention import MASK_VALUE, attention_allowed, xla_attention
from zaya_jax.parallel.context import (
    CONTIGUOUS,
    ROW_AXES,
    all_gather_context,
    context_size,
    rank_chunks,
    sequence_spec,
)
from zaya_jax.parallel.mesh import mesh_platform

__all__ = ["MASK_VALUE", "attention_allowed", "blockwise_self_attention", "pallas_attention", "xla_attention"]


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
    layout: str = CONTIGUOUS,
) -> jax.Array:
    """The Pallas flash-attention kernel with the semantics of `xla_attention` + `attention_allowed`
    (positions = token order). On a mesh it runs per device (a pallas_call is not partitioned by
    XLA): rows over ROW_AXES, and with a context axis each chunk a rank stores (one, or two in the
    zigzag `layout`) against the keys, values, mask and segments all-gathered over it and put in
    position order, its queries at key positions from the chunk's first on (a traced offset,
    `rank_chunks`). Triton for the mesh's GPUs, interpreted on CPU (`mesh_platform`)."""
    options = kernel_options(mesh_platform(mesh))
    r = context_size(mesh)

    def run(q, k, v, seg, mask):
        gather = functools.partial(all_gather_context, ranks=r, layout=layout)  # in position order
        kv = dict(kv_segment_ids=gather(seg), key_mask=gather(mask))
        k, v = gather(k), gather(v)
        chunks = [(0, None, None)] if r == 1 else rank_chunks(layout, r, q.shape[1])
        n = q.shape[1] // len(chunks)
        rows = lambda x, start: None if x is None else x[:, start : start + n]
        out = [
            flash_attention(
                rows(q, start),
                k,
                v,
                scale=scale,
                causal=True,
                q_segment_ids=rows(seg, start),
                sliding_window=sliding_window,
                q_offset=offset,
                flops_offset=mean_offset,
                **kv,
                **options,
            )
            for start, offset, mean_offset in chunks
        ]
        return jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]

    if mesh is None:
        return run(q_bsnh, k_bskh, v_bskh, segment_ids, key_mask)
    spec = sequence_spec(mesh)
    opt = lambda x: None if x is None else spec
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(spec, spec, spec, opt(segment_ids), opt(key_mask)),
        out_specs=spec,
        check_vma=False,
    )(q_bsnh, k_bskh, v_bskh, segment_ids, key_mask)


def blockwise_self_attention(
    q_bsnh: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    *,
    positions_bs: jax.Array,
    key_mask_bs: jax.Array | None,
    segment_ids_bs: jax.Array | None,
    sliding_window: jax.Array | int | None,
    scale: float,
    mesh: Mesh | None = None,
) -> jax.Array:
    """`blockwise_attention` of a sequence over its own keys (training, evaluation), with the
    semantics of `xla_attention` + `attention_allowed(positions, positions, ...)`. On a mesh it runs
    per device: rows over ROW_AXES, and with a context axis each rank's query chunk against the
    keys, values, positions, mask and segments all-gathered over it (reduce-scattered in the
    backward), so every rank skips the key blocks after its own chunk."""
    r = context_size(mesh)

    def run(q, k, v, pos, mask, seg, window):
        gather = functools.partial(all_gather_context, ranks=r)  # storage order, as `pos` says
        return blockwise_attention(
            q,
            gather(k),
            gather(v),
            q_pos_bs=pos,
            kv_pos_bt=gather(pos),
            key_mask_bt=gather(mask),
            q_segment_bs=seg,
            kv_segment_bt=gather(seg),
            sliding_window=window,
            scale=scale,
        )

    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
    args = (q_bsnh, k_bskh, v_bskh, positions_bs, key_mask_bs, segment_ids_bs, window)
    rows = 1 if mesh is None else math.prod(mesh.shape[a] for a in ROW_AXES if a in mesh.shape)
    if mesh is None or (r == 1 and q_bsnh.shape[0] % rows):
        # a batch the rows do not divide (a model init): XLA partitions the loops itself
        return run(*args)
    spec = sequence_spec(mesh)
    opt = lambda x: None if x is None else spec
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(spec, spec, spec, spec, opt(key_mask_bs), opt(segment_ids_bs), P()),
        out_specs=spec,
        check_vma=False,
    )(*args)
