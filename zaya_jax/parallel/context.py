"""Context parallelism: every sequence split over the "context" mesh axis (docs/model.md §4: the 32k phase).

Rank r holds a contiguous chunk of every sequence (or, with the zigzag layout, chunks c_r and
c_{2R-1-r} of 2R); everything per token runs locally. CCA's convolution and value shift take a
left halo from the neighbouring rank (`left_halo`), attention all-gathers keys and values
(`gather_sequence`), and `flatten_tokens` / `fold_sequences` regroup tokens without moving data.
The design: docs/design/long-context.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.mesh import MESH_AXES, resolve_mesh_sizes

CONTEXT = "context"
ROW_AXES = tuple(a for a in MESH_AXES if a != CONTEXT)  # the axes that split batch rows
CONTIGUOUS, ZIGZAG = "contiguous", "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)  # mesh.context_layout


def context_size(mesh: Mesh | None) -> int:
    """R, the number of context ranks (1 without a mesh)."""
    return 1 if mesh is None or CONTEXT not in mesh.shape else int(mesh.shape[CONTEXT])


def context_manual(mesh: Mesh | None) -> bool:
    """Whether the context axis of `mesh` is manual: the model runs inside the per-rank microbatch
    loop (zaya_jax/parallel/zero1.py), its arrays hold this rank's chunks [B, S/R, ...], and the
    context collectives below run there without a shard_map of their own."""
    if mesh is None or context_size(mesh) == 1:
        return False
    return mesh.axis_types[mesh.axis_names.index(CONTEXT)] == AxisType.Manual


def sequence_spec(mesh: Mesh) -> P:
    """The spec of a [B, S, ...] array in a shard_map over `mesh`: rows over ROW_AXES, positions
    over "context" unless that axis is already manual (`context_manual`)."""
    return P(ROW_AXES) if context_manual(mesh) else P(ROW_AXES, CONTEXT)


def row_devices(mesh: Mesh | None) -> int:
    """The devices that split batch rows: the mesh size over its context ranks (context ranks hold
    chunks of the same rows), 1 without a mesh. What a batch size must divide into."""
    return 1 if mesh is None else mesh.size // context_size(mesh)


def config_context(mesh_cfg, devices: int) -> int:
    """R of a config's mesh section on `devices` devices (mesh.context = -1 resolved by the mesh
    parser)."""
    sizes = {a: mesh_cfg[a] for a in MESH_AXES if a in mesh_cfg}
    return resolve_mesh_sizes(sizes, devices)[CONTEXT]


def check_local_length(seq_len: int, ranks: int, rows: int, layout: str = CONTIGUOUS) -> None:
    """ValueError unless S splits evenly into the layout's chunks (R, or 2R for zigzag) of at least
    `rows` (the halo) positions each."""
    chunks = ranks * chunks_per_rank(layout, ranks)
    if seq_len % chunks or seq_len // chunks < rows:
        split = "it" if chunks == ranks else f"{chunks} (the {layout} layout's chunks)"
        per = "rank" if chunks == ranks else "chunk"
        raise ValueError(
            f"mesh.context={ranks}: sequence length {seq_len} must be a multiple of {split} with at "
            f"least {rows} positions per {per} (the CCA convolution's left context)"
        )


def chunks_per_rank(layout: str, ranks: int) -> int:
    """K, the sequence chunks a context rank holds: 2 for zigzag with R > 1, else 1 (with one rank
    both layouts are the identity)."""
    if layout not in LAYOUTS:
        raise ValueError(f"mesh.context_layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == ZIGZAG and ranks > 1 else 1


def chunk_order(layout: str, ranks: int) -> tuple[int, ...]:
    """The sequence's chunks (K*R of them) in storage order: rank r holds entries [r*K, (r+1)*K).
    Contiguous: 0, 1, ..., R-1; zigzag: c_r then c_{2R-1-r} per rank (0, 2R-1, 1, 2R-2, ...)."""
    if chunks_per_rank(layout, ranks) == 1:
        return tuple(range(ranks))
    return tuple(c for r in range(ranks) for c in (r, 2 * ranks - 1 - r))


def layout_permutation(seq_len: int, layout: str, ranks: int) -> np.ndarray:
    """int32 [S]: the position stored at each index along S (`to_layout` gathers by it); the
    identity for the contiguous layout."""
    positions = np.arange(seq_len, dtype=np.int32)
    if layout_is_identity(layout, ranks):
        return positions
    order = chunk_order(layout, ranks)
    return positions.reshape(len(order), -1)[list(order)].reshape(-1)


def to_layout(x_bs: jax.Array, layout: str, ranks: int) -> jax.Array:
    """[B, S, ...] in position order -> storage order of `layout` (a gather along S)."""
    if layout_is_identity(layout, ranks):
        return x_bs
    return jnp.take(x_bs, layout_permutation(x_bs.shape[1], layout, ranks), axis=1)


def from_layout(x_bs: jax.Array, layout: str, ranks: int) -> jax.Array:
    """The inverse of `to_layout`: storage order -> position order."""
    if layout_is_identity(layout, ranks):
        return x_bs
    return jnp.take(x_bs, np.argsort(layout_permutation(x_bs.shape[1], layout, ranks)), axis=1)


def layout_is_identity(layout: str, ranks: int) -> bool:
    """Whether storage order is position order (contiguous, or a single rank)."""
    return chunks_per_rank(layout, ranks) == 1


def left_halo(x_bsc: jax.Array, rows: int, mesh: Mesh, layout: str = CONTIGUOUS) -> jax.Array:
    """x [B, S, C] split over "context", in `layout`'s storage order -> [B, K*R, rows, C]: for each
    stored chunk (`chunk_order`) the last `rows` rows of the chunk before it in the sequence (zeros
    for c_0), laid out with K*R over "context" (local to the chunk's rank).

    Contiguous: rank r-1's last rows, one collective-permute forward. Zigzag: rank r's first chunk
    c_r follows c_{r-1}, rank r-1's first; its second c_{2R-1-r} follows c_{2R-2-r}, rank r+1's
    second (a permute backward), except on rank R-1, whose second chunk c_R follows its own first."""
    r = context_size(mesh)
    k = chunks_per_rank(layout, r)
    manual = context_manual(mesh)
    check_local_length(x_bsc.shape[1] * (r if manual else 1), r, rows, layout)

    def per_device(x):
        chunks = x.reshape(x.shape[0], k, x.shape[1] // k, *x.shape[2:])
        tails = chunks[:, :, chunks.shape[2] - rows :]  # [b, K, rows, C]
        # ppermute leaves a rank that no pair sends to (rank 0 forward) with zeros.
        halos = [jax.lax.ppermute(tails[:, 0], CONTEXT, [(i, i + 1) for i in range(r - 1)])]
        if k == 2:
            back = jax.lax.ppermute(tails[:, 1], CONTEXT, [(i + 1, i) for i in range(r - 1)])
            halos.append(jnp.where(jax.lax.axis_index(CONTEXT) == r - 1, tails[:, 0], back))
        return jnp.stack(halos, axis=1)

    if manual:  # x is this rank's [B, S/R, C] already
        return per_device(x_bsc)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=P(ROW_AXES, CONTEXT, None),
        out_specs=P(ROW_AXES, CONTEXT, None, None),
        check_vma=False,
    )(x_bsc)


def with_left_context(
    x_bsc: jax.Array, left_btc: jax.Array | None, rows: int, mesh: Mesh | None, layout: str = CONTIGUOUS
) -> jax.Array:
    """x [B, S, C] (storage order of `layout`) -> [B, K*R, rows + S/(K*R), C]: each stored chunk
    preceded by its `rows` rows of left context (`left_halo`); the first chunk's (c_0, stored first)
    is `left_btc` [B, rows, C] (a decoding state; None = zeros). With R = 1 this is just
    concat(left, x) with a unit chunk axis, so one code path serves both. With the context axis
    manual (`context_manual`) x is this rank's [B, S/R, C] and the result its [B, K, ...] chunks."""
    b, s, c = x_bsc.shape
    r = context_size(mesh)
    if r == 1:
        left = jnp.zeros((b, rows, c), x_bsc.dtype) if left_btc is None else left_btc.astype(x_bsc.dtype)
        return jnp.concatenate([left, x_bsc], axis=1)[:, None]
    manual = context_manual(mesh)
    n = chunks_per_rank(layout, r) * (1 if manual else r)
    halo = left_halo(x_bsc, rows, mesh, layout)
    if left_btc is not None:
        first = left_btc.astype(x_bsc.dtype)
        if manual:  # c_0 is rank 0's first chunk
            first = jnp.where(jax.lax.axis_index(CONTEXT) == 0, first, halo[:, 0])
        halo = halo.at[:, 0].set(first)
    return jnp.concatenate([halo, x_bsc.reshape(b, n, s // n, c)], axis=2)


def last_chunk(layout: str, mesh: Mesh | None) -> int:
    """Where the sequence's last chunk sits among `with_left_context`'s K*R chunks (its end is the
    decoding state a forward leaves; with the context axis manual, among a rank's K)."""
    order = chunk_order(layout, context_size(mesh))
    last = order.index(len(order) - 1)
    return last % chunks_per_rank(layout, context_size(mesh)) if context_manual(mesh) else last


def rank_chunks(layout: str, ranks: int, local_len: int) -> list[tuple[int, jax.Array, int]]:
    """Inside shard_map over "context": (first local row, first position, its mean over the ranks)
    of each chunk this rank stores, its local [S/R] rows being K chunks of S/(K*R); the position is
    traced (the rank's axis index), the mean static (what a FLOP count per device can use).
    Contiguous: [(0, r*S/R, ...)]; zigzag: [(0, r*L, ...), (L, (2R-1-r)*L, ...)] with L = S/(2R)."""
    k = chunks_per_rank(layout, ranks)
    n = local_len // k
    order = np.asarray(chunk_order(layout, ranks)).reshape(ranks, k)
    first = jnp.asarray(order.reshape(-1), jnp.int32) * n
    rank = jax.lax.axis_index(CONTEXT)
    return [(j * n, first[rank * k + j], int(order[:, j].mean() * n)) for j in range(k)]


def all_gather_context(x_bs: jax.Array | None, ranks: int, layout: str | None = None) -> jax.Array | None:
    """Inside shard_map over "context": this rank's [b, S/R, ...] -> the whole [b, S, ...] on every
    rank (all-gather; a reduce-scatter in the backward), in storage order, or in position order
    given the `layout`. None, and R = 1, pass through."""
    if x_bs is None or ranks == 1:
        return x_bs
    whole = jax.lax.all_gather(x_bs, CONTEXT, axis=1, tiled=True)
    return whole if layout is None else from_layout(whole, layout, ranks)


def gather_sequence(x_bs: jax.Array, mesh: Mesh) -> jax.Array:
    """[B, S, ...] split over "context" -> the same array whole on every context rank (all-gather),
    rows still split over ROW_AXES."""
    if context_manual(mesh):
        return all_gather_context(x_bs, context_size(mesh))
    rest = (None,) * (x_bs.ndim - 2)
    return jax.shard_map(
        lambda x: all_gather_context(x, context_size(mesh)),
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
    if r == 1 or context_manual(mesh):  # manual: each rank's rows are its own chunks already
        return x_bs
    b, s, *rest = x_bs.shape
    j = math.prod(mesh.shape[a] for a in ROW_AXES)
    x = x_bs.reshape(j, b // j, r, s // r, *rest).swapaxes(1, 2)  # [J, R, B/J, S/R, ...]
    return x.reshape(b * r, s // r, *rest)


def unfold_sequences(x_bs: jax.Array, batch: int, mesh: Mesh | None) -> jax.Array:
    """The inverse of `fold_sequences`: [B*R, S/R, ...] -> [B, S, ...]."""
    r = context_size(mesh)
    if r == 1 or context_manual(mesh):
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
    rows = batch * (1 if context_manual(mesh) else context_size(mesh))
    return unfold_sequences(x_md.reshape(rows, x_md.shape[0] // rows, *x_md.shape[1:]), batch, mesh)
