"""Tiled grouped matmul in plain JAX/XLA (the megablox algorithm): sparse on every backend.

XLA:CPU expands `jax.lax.ragged_dot` into masked dense matmuls (every group's weights meet every
row: G times the work). Here each group's rows (consecutive, in group order) are cut into row
tiles of tm rows and every tile is multiplied by its own group's weights only
(`tiled_grouped_matmul`, and the experts' SwiGLU in one loop: `tiled_swiglu`).

The design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zaya_jax.kernels.grouped_matmul import GMM_OUT, _compute_dtype, group_offsets


def pick_tile(t: int, g: int) -> int:
    """Row tile tm: the largest power of two <= T / G (the mean group size), in [8, 256].

    On XLA:CPU each trip of a tile loop costs far more than its dot at these sizes, so a tile
    as big as a typical group (one or two trips per group) beat smaller tiles with less padding,
    and twice that (double the padding) lost: the tiled MoE's forward + backward measured on a
    2-core CPU at T=2048 with (G, d=f) = (8, 128) and (16, 512), and T=1024, G=16, d=256, f=512.
    The padding stays < G * tm <= T rows."""
    tm = 8
    while tm < 256 and 2 * tm * max(g, 1) <= t:
        tm *= 2
    return tm


def num_tiles(t: int, g: int, tm: int) -> int:
    """Static bound on sum_g ceil(size_g / tm) over any split of T rows into G groups."""
    return t // tm + g


def tile_window(lo: jax.Array, end: jax.Array, t: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """The tile whose first new row is lo (of a group ending at row end): (start, keep [tm, 1]).

    The window [start, start + tm) is [lo, lo + tm) moved back to fit in T rows; keep marks the
    rows it owns, lo <= row < end (needs tm <= T)."""
    start = jnp.minimum(lo, t - tm)
    row = start + jnp.arange(tm, dtype=jnp.int32)
    return start, ((row >= lo) & (row < end))[:, None]


def _dot(a, b, contract):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _rows(x_tc: jax.Array, start: jax.Array, keep: jax.Array, tm: int) -> jax.Array:
    """x[start : start + tm] with the rows the tile does not own zeroed: another group's tokens
    never reach this group's weights (nor its gradient)."""
    return jnp.where(keep, jax.lax.dynamic_slice_in_dim(x_tc, start, tm), 0).astype(x_tc.dtype)


def _write(buf_tc: jax.Array, start: jax.Array, keep: jax.Array, tile_rc: jax.Array) -> jax.Array:
    """buf[start : start + tm] = tile where keep, else unchanged."""
    old = jax.lax.dynamic_slice_in_dim(buf_tc, start, tile_rc.shape[0])
    new = jnp.where(keep, tile_rc.astype(buf_tc.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(buf_tc, new, start, 0)


def _over_tiles(start_g, size_g, t: int, tm: int, tile_fn, carry):
    """fori_loop over one group's tiles: carry = tile_fn(start, keep, carry)."""
    end = start_g + size_g

    def body(i, c):
        return tile_fn(*tile_window(start_g + i * tm, end, t, tm), c)

    return jax.lax.fori_loop(0, (size_g + tm - 1) // tm, body, carry)


def _scan_groups(group, dy, x, weights, per_group):
    """The backwards' loop over groups: `group(dy, dx, per_group) -> (dx, (dw_g, ...))` for each
    group g in turn, dx [T, ...] like x accumulated in the carry and each dw_g written at index g of
    a [G, ...] gradient like its weight in `weights`. Returns (dx, (dw, ...)).

    Why not lax.scan's stacked outputs: their zero-filled [G, ...] buffers are constants, so XLA
    built them (and a copy per layer) during the forward pass, and the unrolled layers held
    expert-weight-sized zeros through the step's peak (its fwd/bwd boundary). Here they
    are broadcast from a zero computed from dy: not a constant, so none of them is built before the
    backward reaches the layer, nor shared (and copied) across layers. (An optimization_barrier
    does not do it: XLA:CPU expands barriers before scheduling and the constant comes back.) Every
    group writes its slice, so the zeros' value never reaches the result; only their timing matters."""
    v = jax.tree.leaves(dy)[0].reshape(-1)[0].astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(v), v, 0.0) * 0.0  # 0, and not a constant (XLA keeps x * 0 of floats)
    dws0 = tuple(jnp.broadcast_to(zero.astype(w.dtype), w.shape) for w in weights)
    dx0 = jnp.zeros(x.shape, x.dtype)

    def body(carry, xs):
        (dx, dws), (g, per) = carry, xs
        dx, dw_g = group(dy, dx, per)
        put = lambda buf, d: jax.lax.dynamic_update_index_in_dim(buf, d.astype(buf.dtype), g, 0)
        dws = tuple(map(put, dws, dw_g))
        return (dx, dws), None

    return jax.lax.scan(body, (dx0, dws0), (jnp.arange(per_group[0].shape[0]), per_group))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled(x_tk, w_gkm, starts_g, sizes_g, tm, out_dtype):
    t = x_tk.shape[0]
    cdt = _compute_dtype(x_tk.dtype, w_gkm.dtype)
    x_tk = x_tk.astype(cdt)

    def group(out_tm, per_group):
        w_km, start_g, size_g = per_group

        def tile(start, keep, out):
            return _write(out, start, keep, _dot(_rows(x_tk, start, keep, tm), w_km, ((1,), (0,))))

        return _over_tiles(start_g, size_g, t, tm, tile, out_tm), None

    out = jnp.zeros((t, w_gkm.shape[2]), out_dtype)
    return jax.lax.scan(group, out, (w_gkm.astype(cdt), starts_g, sizes_g))[0]


def _tiled_fwd(x_tk, w_gkm, starts_g, sizes_g, tm, out_dtype):
    return _tiled(x_tk, w_gkm, starts_g, sizes_g, tm, out_dtype), (x_tk, w_gkm, starts_g, sizes_g)


def _tiled_bwd(tm, out_dtype, res, dout_tm):
    x_tk, w_gkm, starts_g, sizes_g = res
    t = x_tk.shape[0]
    cdt_x = _compute_dtype(dout_tm.dtype, w_gkm.dtype)  # dx = dout w^T
    cdt_w = _compute_dtype(x_tk.dtype, dout_tm.dtype)  # dw = x^T dout
    x_w = x_tk.astype(cdt_w)

    def group(douts, dx_tk, per_group):
        (dout_x, dout_w), (w_km, start_g, size_g) = douts, per_group

        def tile(start, keep, carry):
            dx, dw_km = carry
            dx = _write(dx, start, keep, _dot(_rows(dout_x, start, keep, tm), w_km, ((1,), (1,))))
            x_rk, dout_rm = _rows(x_w, start, keep, tm), _rows(dout_w, start, keep, tm)
            return dx, dw_km + _dot(x_rk, dout_rm, ((0,), (0,)))

        dw0 = jnp.zeros(w_km.shape, jnp.float32)
        dx_tk, dw_km = _over_tiles(start_g, size_g, t, tm, tile, (dx_tk, dw0))
        return dx_tk, (dw_km,)

    douts = (dout_tm.astype(cdt_x), dout_tm.astype(cdt_w))
    per_group = (w_gkm.astype(cdt_x), starts_g, sizes_g)
    dx, (dw,) = _scan_groups(group, douts, x_tk, (w_gkm,), per_group)
    return dx, dw, None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tile: int | None = None,
    preferred_element_type=None,
) -> jax.Array:
    """`jax.lax.ragged_dot` by row tiles: lhs [T, K], rhs [G, K, N], group_sizes [G] -> [T, N].

    Rows of group g (consecutive, in group order) are multiplied by rhs[g]; rows past
    sum(group_sizes) are 0. Differentiable in lhs and rhs. tile: rows per tile (default
    `pick_tile(T, G)`, at most T).
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"tiled_grouped_matmul: want lhs [T,K], rhs [G,K,N]; got {lhs.shape}, {rhs.shape}")
    t, g = lhs.shape[0], rhs.shape[0]
    if group_sizes.shape != (g,):
        raise ValueError(f"tiled_grouped_matmul: group_sizes {group_sizes.shape} for {g} groups")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if t == 0:
        return jnp.zeros((0, rhs.shape[2]), out_dtype)
    starts, sizes = group_offsets(group_sizes, t)
    return _tiled(lhs, rhs, starts, sizes, min(tile or pick_tile(t, g), t), out_dtype)


# ------------------------------------------------------------------------------- fused SwiGLU
def _swiglu_tile(x_rd, gu_df, dn_fd, act, cdt):
    """One tile of act(x G) * (x U) then D: (h [tm, 2f] fp32, y [tm, d] fp32)."""
    h = _dot(x_rd, gu_df, ((1,), (0,)))
    gate, up = jnp.split(h, 2, axis=-1)
    return h, _dot((act(gate) * up).astype(cdt), dn_fd, ((1,), (0,)))


def _swiglu_loop(x_td, gu_gdf, dn_gfd, starts_g, sizes_g, tm, act, keep_h):
    """The fused loop: y [T, d] fp32 (and h [T, 2f] fp32 when keep_h, the backward's residual)."""
    t = x_td.shape[0]
    cdt = _compute_dtype(x_td.dtype, gu_gdf.dtype)
    x_td = x_td.astype(cdt)

    def group(carry, per_group):
        gu_df, dn_fd, start_g, size_g = per_group

        def tile(start, keep, c):
            h, y = _swiglu_tile(_rows(x_td, start, keep, tm), gu_df, dn_fd, act, cdt)
            return (_write(c[0], start, keep, y), *((_write(c[1], start, keep, h),) if keep_h else ()))

        return _over_tiles(start_g, size_g, t, tm, tile, carry), None

    init = (jnp.zeros((t, dn_gfd.shape[2]), jnp.float32),)
    if keep_h:
        init += (jnp.zeros((t, gu_gdf.shape[2]), jnp.float32),)
    per_group = (gu_gdf.astype(cdt), dn_gfd.astype(cdt), starts_g, sizes_g)
    return jax.lax.scan(group, init, per_group)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _swiglu(x_td, gu_gdf, dn_gfd, starts_g, sizes_g, tm, act):
    return _swiglu_loop(x_td, gu_gdf, dn_gfd, starts_g, sizes_g, tm, act, False)[0]


def _swiglu_fwd(x_td, gu_gdf, dn_gfd, starts_g, sizes_g, tm, act):
    y, h = _swiglu_loop(x_td, gu_gdf, dn_gfd, starts_g, sizes_g, tm, act, True)
    # Both projections' outputs, named as the Pallas kernel's (grouped_matmul.GMM_OUT).
    y, h = checkpoint_name(y, GMM_OUT), checkpoint_name(h, GMM_OUT)
    return y, (x_td, gu_gdf, dn_gfd, starts_g, sizes_g, h)


def _swiglu_bwd(tm, act, res, dy_td):
    x_td, gu_gdf, dn_gfd, starts_g, sizes_g, h_tf = res
    t = x_td.shape[0]
    cdt = _compute_dtype(x_td.dtype, gu_gdf.dtype)
    x_c = x_td.astype(cdt)

    def group(dy_c, dx_td, per_group):
        gu_df, dn_fd, start_g, size_g = per_group

        def tile(start, keep, carry):
            dx, dgu_df, ddn_fd = carry
            gate, up = jnp.split(_rows(h_tf, start, keep, tm), 2, axis=-1)
            a, act_vjp = jax.vjp(lambda g, u: act(g) * u, gate, up)
            dy_rd = _rows(dy_c, start, keep, tm)
            ddn_fd = ddn_fd + _dot(a.astype(cdt), dy_rd, ((0,), (0,)))
            dh = jnp.concatenate(act_vjp(_dot(dy_rd, dn_fd, ((1,), (1,)))), axis=-1).astype(cdt)
            dgu_df = dgu_df + _dot(_rows(x_c, start, keep, tm), dh, ((0,), (0,)))
            return _write(dx, start, keep, _dot(dh, gu_df, ((1,), (1,)))), dgu_df, ddn_fd

        zeros = (jnp.zeros(gu_df.shape, jnp.float32), jnp.zeros(dn_fd.shape, jnp.float32))
        dx_td, dgu_df, ddn_fd = _over_tiles(start_g, size_g, t, tm, tile, (dx_td, *zeros))
        return dx_td, (dgu_df, ddn_fd)

    per_group = (gu_gdf.astype(cdt), dn_gfd.astype(cdt), starts_g, sizes_g)
    dx, (dgu, ddn) = _scan_groups(group, dy_td.astype(cdt), x_td, (gu_gdf, dn_gfd), per_group)
    return dx, dgu, ddn, None, None


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def tiled_swiglu(
    x_td: jax.Array,
    gate_up_gdf: jax.Array,
    down_gfd: jax.Array,
    group_sizes: jax.Array,
    act,
    *,
    tile: int | None = None,
) -> jax.Array:
    """Grouped SwiGLU (act(x G_g) * (x U_g)) D_g on group-sorted rows, gate and up projections fused
    in gate_up [G, d, 2f] (gate columns first), down [G, f, d] -> fp32 [T, d] (rows past
    sum(group_sizes) are 0): both projections in ONE tile loop, the [tm, 2f] intermediate never
    leaving the tile; the backward is one loop too (h [T, 2f] kept from the forward)."""
    t, g = x_td.shape[0], gate_up_gdf.shape[0]
    if group_sizes.shape != (g,) or gate_up_gdf.shape[2] != 2 * down_gfd.shape[1]:
        raise ValueError(
            f"tiled_swiglu: shapes {x_td.shape}, {gate_up_gdf.shape}, {down_gfd.shape}, {group_sizes.shape}"
        )
    if t == 0:
        return jnp.zeros((0, down_gfd.shape[2]), jnp.float32)
    starts, sizes = group_offsets(group_sizes, t)
    return _swiglu(x_td, gate_up_gdf, down_gfd, starts, sizes, min(tile or pick_tile(t, g), t), act)
