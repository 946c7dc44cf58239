"""Context parallelism: every sequence split over the "context" mesh axis (docs/model.md §4: the 32k phase).

Rank r of the R context ranks holds positions [r*S/R, (r+1)*S/R) of every sequence of its rows
(batch [B, S] laid out P(ROW_AXES, "context")). Everything per token (projections, norms, RoPE,
router, experts, loss) then runs locally; only two things in a block read other positions:

  * CCA's causal convolution and value shift need the last few rows before the rank's first
    position: `left_halo` sends each rank's last rows to the next rank (one collective-permute);
    rank 0 receives zeros, which is exactly the global left zero-padding. The halo carries conv
    INPUTS (the raw q0/k0 projections): the first conv's output inside the padding is its bias,
    not zero, so the conv must be recomputed over the halo rather than receive outputs;
  * attention reads every key: `gather_sequence` all-gathers keys and values (after conv, norm and
    RoPE) over the axis, and queries keep their own positions (the causal mask is on GLOBAL
    positions, so rank r's queries see the keys of ranks <= r).

Reductions over tokens (loss, expert counts for balancing, dropped tokens) are sums over global
arrays, so they already include every context rank. Where tokens are regrouped (the MoE's flat
[B*S] tokens, the loss's chunks) `flatten_tokens` / `fold_sequences` order them so that no data
moves: "context" is the LAST mesh axis, so the flat tokens are exactly P(MESH_AXES), the layout of
the expert all-to-all (zaya_jax/parallel/expert.py), and the loss scans each rank's own chunks.

Layout: contiguous chunks (rank r owns the r-th chunk). The XLA attention computes each rank's
[S/R, S] scores in full (masked ones too), so ranks do equal work; the blockwise attention
(attention_impl='blockwise', or 'auto' from BLOCKWISE_AUTO_MIN_SEQ keys) skips the key blocks after
a rank's chunk, which leaves rank R-1 about (2R-1)/R times the average, which a load-balanced
("zig-zag") layout would fix; it is not built. The Pallas kernel (attention_impl='pallas', 'auto'
on GPUs) skips them too: it places rank r's queries at key positions from r*S/R on, an offset
traced inside shard_map (flash_attention's q_offset).
The backward of the halo is a permute the other way and that of the all-gather a reduce-scatter
(jax derives both), so gradients need nothing extra.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.mesh import MESH_AXES, resolve_mesh_sizes

CONTEXT = "context"
ROW_AXES = tuple(a for a in MESH_AXES if a != CONTEXT)  # the axes that split batch rows


def context_size(mesh: Mesh | None) -> int:
    """R, the number of context ranks (1 without a mesh)."""
    return 1 if mesh is None or CONTEXT not in mesh.shape else int(mesh.shape[CONTEXT])


def row_devices(mesh: Mesh | None) -> int:
    """The devices that split batch rows: the mesh size over its context ranks (context ranks hold
    chunks of the same rows), 1 without a mesh. What a batch size must divide into."""
    return 1 if mesh is None else mesh.size // context_size(mesh)


def config_context(mesh_cfg, devices: int) -> int:
    """R of a config's mesh section on `devices` devices (mesh.context = -1 resolved by the mesh
    parser)."""
    sizes = {a: mesh_cfg[a] for a in MESH_AXES if a in mesh_cfg}
    return resolve_mesh_sizes(sizes, devices)[CONTEXT]


def check_local_length(seq_len: int, ranks: int, rows: int) -> None:
    """ValueError unless S splits evenly into R chunks of at least `rows` (the halo) positions."""
    if seq_len % ranks or seq_len // ranks < rows:
        raise ValueError(
            f"mesh.context={ranks}: sequence length {seq_len} must be a multiple of it with at least "
            f"{rows} positions per rank (the CCA convolution's left context)"
        )


def left_halo(x_bsc: jax.Array, rows: int, mesh: Mesh) -> jax.Array:
    """x [B, S, C] split over "context" -> [B, R, rows, C]: for each rank r the last `rows` rows
    of rank r-1's chunk (zeros for r = 0), laid out with R over "context" (local to rank r)."""
    r = context_size(mesh)
    check_local_length(x_bsc.shape[1], r, rows)

    def per_device(x):
        # ppermute leaves a rank that no pair sends to (rank 0) with zeros.
        halo = jax.lax.ppermute(x[:, x.shape[1] - rows :], CONTEXT, [(i, i + 1) for i in range(r - 1)])
        return halo[:, None]

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=P(ROW_AXES, CONTEXT, None),
        out_specs=P(ROW_AXES, CONTEXT, None, None),
        check_vma=False,
    )(x_bsc)


def with_left_context(
    x_bsc: jax.Array, left_btc: jax.Array | None, rows: int, mesh: Mesh | None
) -> jax.Array:
    """x [B, S, C] -> [B, R, rows + S/R, C]: each rank's chunk preceded by its `rows` rows of left
    context; rank 0's is `left_btc` [B, rows, C] (a decoding state; None = zeros). With R = 1 this
    is just concat(left, x) with a unit R axis, so one code path serves both."""
    b, s, c = x_bsc.shape
    r = context_size(mesh)
    if r == 1:
        left = jnp.zeros((b, rows, c), x_bsc.dtype) if left_btc is None else left_btc.astype(x_bsc.dtype)
        return jnp.concatenate([left, x_bsc], axis=1)[:, None]
    halo = left_halo(x_bsc, rows, mesh)
    if left_btc is not None:
        halo = halo.at[:, 0].set(left_btc.astype(x_bsc.dtype))
    return jnp.concatenate([halo, x_bsc.reshape(b, r, s // r, c)], axis=2)


def gather_sequence(x_bs: jax.Array, mesh: Mesh) -> jax.Array:
    """[B, S, ...] split over "context" -> the same array whole on every context rank (all-gather),
    rows still split over ROW_AXES."""
    rest = (None,) * (x_bs.ndim - 2)
    return jax.shard_map(
        lambda x: jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True),
        mesh=mesh,
        in_specs=P(ROW_AXES, CONTEXT, *rest),
        out_specs=P(ROW_AXES, None, *rest),
        check_vma=False,
    )(x_bs)


def fold_sequences(x_bs: jax.Array, mesh: Mesh | None) -> jax.Array:
    """[B, S, ...] split over ROW_AXES x "context" -> [B*R, S/R, ...], each row one rank's chunk of
    one sequence, with no data moved: rows are ordered (row shard, context rank, local row), so the
    new row axis is split over (ROW_AXES, "context") in mesh order. A plain reshape [B, S] ->
    [B*R, S/R] would interleave ranks within a row shard and make XLA reshuffle (all-to-all)."""
    r = context_size(mesh)
    if r == 1:
        return x_bs
    b, s, *rest = x_bs.shape
    j = math.prod(mesh.shape[a] for a in ROW_AXES)
    x = x_bs.reshape(j, b // j, r, s // r, *rest).swapaxes(1, 2)  # [J, R, B/J, S/R, ...]
    return x.reshape(b * r, s // r, *rest)


def unfold_sequences(x_bs: jax.Array, batch: int, mesh: Mesh | None) -> jax.Array:
    """The inverse of `fold_sequences`: [B*R, S/R, ...] -> [B, S, ...]."""
    r = context_size(mesh)
    if r == 1:
        return x_bs
    _, s_local, *rest = x_bs.shape
    j = math.prod(mesh.shape[a] for a in ROW_AXES)
    x = x_bs.reshape(j, r, batch // j, s_local, *rest).swapaxes(1, 2)  # [J, B/J, R, S/R, ...]
    return x.reshape(batch, r * s_local, *rest)


def flatten_tokens(x_bs: jax.Array, mesh: Mesh | None) -> jax.Array:
    """[B, S, ...] -> tokens [B*S, ...] split over MESH_AXES (context last) without moving data
    (the layout of the expert all-to-all); `unflatten_tokens` inverts it."""
    x = fold_sequences(x_bs, mesh)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def unflatten_tokens(x_md: jax.Array, batch: int, mesh: Mesh | None) -> jax.Array:
    """tokens [B*S, ...] (as `flatten_tokens` ordered them) -> [B, S, ...]."""
    rows = batch * context_size(mesh)
    return unfold_sequences(x_md.reshape(rows, x_md.shape[0] // rows, *x_md.shape[1:]), batch, mesh)
