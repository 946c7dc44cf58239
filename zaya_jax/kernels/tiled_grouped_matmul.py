"""Tiled grouped matmul in plain JAX/XLA (the megablox algorithm): sparse on every backend.

XLA:CPU expands `jax.lax.ragged_dot` into masked dense matmuls (every group's weights meet every
row: G times the work). Here rows are laid out group by group, each group padded up to a multiple
of a row tile of tm rows, so every tile belongs to exactly one group; one batched matmul then
multiplies each tile by its own group's weights:

    tile_layout(group_sizes [G], t, tm) -> TileLayout
        src [P]   padded row p <- sorted row src[p] (t = a zero row: group padding, unused tiles)
        dst [T]   sorted row r -> padded row dst[r] (P for rows past sum(group_sizes))
        tile_group [n]  the group of each tile (G for unused tiles); P = n * tm
    tiled_matmul(x_pk [P, K], w_gkn [G, K, N], tile_group [n]) -> [P, N]
        out[tile] = x[tile] @ w[tile_group[tile]]; custom_vjp, the backward is tiled too:
          dx[tile] = dout[tile] @ w[g]^T        dw[g] = sum over g's tiles of x[tile]^T dout[tile]
    tiled_grouped_matmul(lhs [T, K], rhs [G, K, N], group_sizes [G]) -> [T, N]
        `jax.lax.ragged_dot`'s contract (rows past sum(group_sizes) are 0) on the three above.

Work: P <= T + G * (tm - 1) rows are computed (static bound n = T // tm + G tiles), so FLOPs
scale with T, not G * T. Axis letters: t (T) sorted rows, p (P) padded rows, n tiles, r rows in a
tile (tm), k contraction, m output columns, g groups.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.kernels.grouped_matmul import _compute_dtype, group_offsets


class TileLayout(NamedTuple):
    src: jax.Array  # [P] int32: sorted row feeding each padded row, T for a zero row
    dst: jax.Array  # [T] int32: padded row of each sorted row, P for unrouted rows
    tile_group: jax.Array  # [n] int32: group of each tile, G for unused tiles


def pick_tile(t: int, g: int) -> int:
    """Row tile tm: a power of two in [8, 128], about T / (4 G), so the padding (< G * tm rows)
    stays under ~25% of T while tiles stay big enough for an efficient matmul."""
    tm = 8
    while tm < 128 and 2 * tm * 4 * max(g, 1) <= t:
        tm *= 2
    return tm


def num_tiles(t: int, g: int, tm: int) -> int:
    """Static bound on sum_g ceil(size_g / tm) over any split of T rows into G groups."""
    return t // tm + g


def tile_layout(group_sizes: jax.Array, t: int, tm: int) -> TileLayout:
    """Pads each group of the T sorted rows to a multiple of tm rows (see the module docstring)."""
    g = group_sizes.shape[0]
    n = num_tiles(t, g, tm)
    starts, sizes = group_offsets(group_sizes, t)  # [G] each, clipped to T rows
    tiles = (sizes + tm - 1) // tm  # [G]
    tile_end = jnp.cumsum(tiles)  # [G]
    pad_starts = (tile_end - tiles) * tm  # [G] first padded row of each group
    tile_group = jnp.searchsorted(tile_end, jnp.arange(n, dtype=jnp.int32), side="right").astype(jnp.int32)
    row_group = jnp.repeat(tile_group, tm, total_repeat_length=n * tm)  # [P]
    gc = jnp.minimum(row_group, g - 1)
    offset = jnp.arange(n * tm, dtype=jnp.int32) - pad_starts[gc]  # row within its group
    valid = (row_group < g) & (offset < sizes[gc])
    src = jnp.where(valid, starts[gc] + offset, t).astype(jnp.int32)
    rows = jnp.arange(t, dtype=jnp.int32)
    sorted_group = jnp.searchsorted(starts + sizes, rows, side="right")  # [T]; G past the routed rows
    sg = jnp.minimum(sorted_group, g - 1)
    dst = jnp.where(sorted_group < g, pad_starts[sg] + rows - starts[sg], n * tm).astype(jnp.int32)
    return TileLayout(src, dst, tile_group)


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [R, c] -> x[idx] [len(idx), c], idx == R (or beyond) giving a zero row."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def _tiles(x_pc: jax.Array, n: int) -> jax.Array:
    return x_pc.reshape(n, x_pc.shape[0] // n, x_pc.shape[1])


def _dot(a, b, contract):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


# A loop over the used tiles, slicing each tile's weights in place, rather than one batched einsum
# over gathered per-tile weights [n, K, N]: that gather copies K x N weights per tile and measured
# 3-5x slower on XLA:CPU. The loop also skips the unused trailing tiles.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _tiled(x_pk, w_gkn, tile_group, groups, out_dtype):
    n = tile_group.shape[0]
    cdt = _compute_dtype(x_pk.dtype, w_gkn.dtype)
    x_nrk, w_gkn = _tiles(x_pk.astype(cdt), n), w_gkn.astype(cdt)

    def body(i, out_nrm):
        w_km = jax.lax.dynamic_index_in_dim(w_gkn, tile_group[i], keepdims=False)
        return out_nrm.at[i].set(_dot(x_nrk[i], w_km, ((1,), (0,))).astype(out_dtype))

    out = jnp.zeros((n, x_nrk.shape[1], w_gkn.shape[2]), out_dtype)
    out = jax.lax.fori_loop(0, _used_tiles(tile_group, groups), body, out)
    return out.reshape(x_pk.shape[0], -1)


def _used_tiles(tile_group: jax.Array, groups: int) -> jax.Array:
    """Used tiles come first; the rest (group G) compute nothing and stay zero."""
    return jnp.sum(tile_group < groups).astype(jnp.int32)


def _tiled_fwd(x_pk, w_gkn, tile_group, groups, out_dtype):
    return _tiled(x_pk, w_gkn, tile_group, groups, out_dtype), (x_pk, w_gkn, tile_group)


def _tiled_bwd(groups, out_dtype, res, dout_pm):
    x_pk, w_gkn, tile_group = res
    n, used = tile_group.shape[0], _used_tiles(tile_group, groups)
    cdt_x = _compute_dtype(dout_pm.dtype, w_gkn.dtype)  # dx = dout w^T
    cdt_w = _compute_dtype(x_pk.dtype, dout_pm.dtype)  # dw = x^T dout
    dout_x, w_x = _tiles(dout_pm.astype(cdt_x), n), w_gkn.astype(cdt_x)
    x_w, dout_w = _tiles(x_pk.astype(cdt_w), n), _tiles(dout_pm.astype(cdt_w), n)

    def body(i, carry):
        dx_nrk, dw_gkm = carry
        g = tile_group[i]
        w_km = jax.lax.dynamic_index_in_dim(w_x, g, keepdims=False)
        dx_nrk = dx_nrk.at[i].set(_dot(dout_x[i], w_km, ((1,), (1,))).astype(dx_nrk.dtype))
        dw_gkm = dw_gkm.at[g].add(_dot(x_w[i], dout_w[i], ((0,), (0,))))
        return dx_nrk, dw_gkm

    dx = jnp.zeros((n, x_pk.shape[0] // n, x_pk.shape[1]), x_pk.dtype)
    dw = jnp.zeros(w_gkn.shape, jnp.float32)
    dx, dw = jax.lax.fori_loop(0, used, body, (dx, dw))
    return dx.reshape(x_pk.shape), dw.astype(w_gkn.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_matmul(
    x_pk: jax.Array, w_gkn: jax.Array, tile_group: jax.Array, *, preferred_element_type=None
) -> jax.Array:
    """x [P, K] in tiles of P / n rows, w [G, K, N], tile_group [n] -> [P, N]: each tile times its
    group's weights. Tiles of group G (unused) must come last, as `tile_layout` makes them: the
    loop stops at the first of them, and they give zeros. Differentiable in x and w (tiled
    backward)."""
    if x_pk.ndim != 2 or w_gkn.ndim != 3 or tile_group.ndim != 1:
        raise ValueError(
            f"tiled_matmul: want x [P,K], w [G,K,N], tile_group [n]; got "
            f"{x_pk.shape}, {w_gkn.shape}, {tile_group.shape}"
        )
    if x_pk.shape[1] != w_gkn.shape[1] or x_pk.shape[0] % max(tile_group.shape[0], 1):
        raise ValueError(f"tiled_matmul: mismatched shapes {x_pk.shape}, {w_gkn.shape}, {tile_group.shape}")
    out_dtype = jnp.dtype(preferred_element_type or x_pk.dtype)
    return _tiled(x_pk, w_gkn, tile_group.astype(jnp.int32), w_gkn.shape[0], out_dtype)


def tiled_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """`jax.lax.ragged_dot` on the tiled layout: lhs [T, K], rhs [G, K, N], group_sizes [G] -> [T, N].

    Rows of group g (consecutive, in group order) are multiplied by rhs[g]; rows past
    sum(group_sizes) are 0. tile: rows per tile (default `pick_tile(T, G)`).
    """
    t, g = lhs.shape[0], rhs.shape[0]
    if group_sizes.shape != (g,):
        raise ValueError(f"tiled_grouped_matmul: group_sizes {group_sizes.shape} for {g} groups")
    layout = tile_layout(group_sizes, t, tile or pick_tile(t, g))
    out = tiled_matmul(
        gather_rows(lhs, layout.src), rhs, layout.tile_group, preferred_element_type=preferred_element_type
    )
    return gather_rows(out, layout.dst)
