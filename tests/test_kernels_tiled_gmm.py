"""The plain-XLA tiled grouped matmul (zaya_jax/kernels/tiled_grouped_matmul.py) vs ragged_dot.

Values and gradients (dlhs, drhs) across ragged groups: empty groups, groups smaller than a tile,
one token, all rows in one group, rows past sum(group_sizes) (skip-class tokens: output 0, no
gradient). The fused tiled SwiGLU likewise against the two ragged_dots and the activation between
them. And the point of it: compiled, no group's weights meet rows it was not given.
Error metric: max|a - b| / max|b| (fp32 within 1e-5, bf16 within 2e-2).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.gmm_operands import operands

from zaya_jax.kernels.tiled_grouped_matmul import (
    num_tiles,
    pick_tile,
    tile_window,
    tiled_grouped_matmul,
    tiled_swiglu,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def value_and_grads(f, lhs, rhs, dout, gs, out_dtype):
    out, vjp = jax.vjp(lambda a, b: f(a, b, gs, preferred_element_type=out_dtype), lhs, rhs)
    return (out, *vjp(dout.astype(out.dtype)))


@jax.jit
def _both(lhs, rhs, dout, gs):  # jit retraces per shape/dtype; tile is fixed at 8 for these shapes
    tiled = lambda a, b, g, **k: tiled_grouped_matmul(a, b, g, tile=8, **k)
    out_dtype = lhs.dtype
    return (
        value_and_grads(tiled, lhs, rhs, dout, gs, out_dtype),
        value_and_grads(jax.lax.ragged_dot, lhs, rhs, dout, gs, out_dtype),
    )


CASES = {
    # T=45 (not a multiple of the tile), groups: small, empty, spanning tiles, then 6 unrouted rows
    "ragged": (45, [3, 0, 21, 15, 0]),
    "one_token": (1, [0, 0, 1]),
    "all_in_one_group": (20, [0, 20, 0, 0]),
    "no_routed_rows": (12, [0, 0]),
    "every_row_routed": (32, [8, 9, 7, 8]),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_ragged_dot(case, dtype):
    t, sizes = CASES[case]
    lhs, rhs, dout = operands(t, 24, 40, len(sizes), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    got, want = _both(lhs, rhs, dout, gs)
    errs = {name: rel_err(a, b) for name, a, b in zip(("out", "dlhs", "drhs"), got, want)}
    if sum(sizes):
        assert max(errs.values()) < TOL[dtype], errs
    out, dlhs, drhs = got
    assert out.dtype == lhs.dtype and dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
    used = sum(sizes)
    assert not np.any(np.asarray(out, np.float32)[used:]), "rows past sum(group_sizes) must be 0"
    assert not np.any(np.asarray(dlhs, np.float32)[used:]), "and get no gradient"
    empty = np.asarray(sizes) == 0
    assert not np.any(np.asarray(drhs, np.float32)[empty]), "empty groups get zero drhs"


def test_fp32_output_from_bf16_operands():
    """bf16 operands, fp32 output (the MoE's preferred_element_type) and fp32 cotangents."""
    lhs, rhs, dout = operands(40, 16, 24, 3, jnp.bfloat16, seed=1)
    gs = jnp.array([10, 17, 9], jnp.int32)
    tiled = lambda a, b, g, **k: tiled_grouped_matmul(a, b, g, tile=16, **k)
    got = value_and_grads(tiled, lhs, rhs, dout, gs, jnp.float32)
    want = value_and_grads(jax.lax.ragged_dot, lhs, rhs, dout, gs, jnp.float32)
    assert got[0].dtype == jnp.float32
    for a, b in zip(got, want):
        assert rel_err(a, b) < TOL[jnp.bfloat16]


def test_tile_windows_cover_each_routed_row_once():
    """The tiles of every group (ceil(size / tm) windows of tm rows inside the T rows) own each of
    its rows exactly once and nothing else; rows past sum(group_sizes) belong to no tile; the
    tile count stays within the static bound num_tiles."""
    rng = np.random.default_rng(0)
    t, g = 90, 5
    for tm in (1, 8, 16, 32, 90):
        for _ in range(10):
            sizes = rng.multinomial(rng.integers(0, t + 1), np.ones(g) / g) * (rng.random(g) < 0.7)
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            owner = np.full(t, -1)
            tiles = 0
            for grp in range(g):
                for i in range(-(-int(sizes[grp]) // tm)):
                    start, keep = tile_window(
                        jnp.int32(bounds[grp] + i * tm), jnp.int32(bounds[grp + 1]), t, tm
                    )
                    start, keep = int(start), np.asarray(keep)[:, 0]
                    assert 0 <= start <= t - tm and keep.shape == (tm,)
                    rows = start + np.flatnonzero(keep)
                    assert np.all(owner[rows] == -1), "a row owned twice"
                    owner[rows] = grp
                    tiles += 1
            np.testing.assert_array_equal(
                owner, np.repeat(np.r_[np.arange(g), -1], np.r_[sizes, t - bounds[-1]])
            )
            assert tiles <= num_tiles(t, g, tm)


def test_pick_tile():
    """About the mean group size T / G (a power of two in [8, 256])."""
    assert pick_tile(64, 8) == 8 and pick_tile(1024, 16) == 64 and pick_tile(2048, 16) == 128
    assert pick_tile(2048, 8) == 256 and pick_tile(1 << 20, 16) == 256 and pick_tile(1, 4) == 8


def _dot_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Output shapes of the dot instructions in an optimized HLO module."""
    shapes = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", hlo)
    return [tuple(int(s) for s in shape.split(",") if s) for shape in shapes]


def _loop_flop_bound(compiled, trips: int, trip_flops: int) -> float:
    """XLA's cost_analysis counts a loop body once: the total is at most its count + (trips - 1)
    x the FLOPs of one trip's dots."""
    return compiled.cost_analysis()["flops"] + (trips - 1) * trip_flops


def test_no_group_runs_on_rows_it_was_not_given():
    """Compiled forward and gradient at T=256, K=32, N=48, 8 groups: every dot is one tile's
    ([tm, N] or [tm, K] out) or one tile's weight-gradient term ([K, N]), 2 tm K N FLOPs each, in
    tile loops (one per group, inside the loop over groups) of at most num_tiles = T/tm + G trips
    in all, i.e. T + G tm rows. That bound must be well below ragged_dot's count on XLA:CPU,
    which multiplies every group by every row."""
    t, k, n, g = 256, 32, 48, 8
    lhs, rhs, _ = operands(t, k, n, g, jnp.float32, seed=2)
    gs = jnp.array([40, 0, 70, 30, 30, 20, 36, 10], jnp.int32)
    tm = pick_tile(t, g)
    trips = num_tiles(t, g, tm)

    def fwd(f):
        return lambda a, b: f(a, b, gs)

    def grad(f):
        return jax.grad(lambda a, b: jnp.sum(f(a, b, gs) ** 2), (0, 1))

    for wrap in (fwd, grad):
        tiled = jax.jit(wrap(tiled_grouped_matmul)).lower(lhs, rhs).compile()
        ragged = jax.jit(wrap(jax.lax.ragged_dot)).lower(lhs, rhs).compile()
        shapes = _dot_shapes(tiled.as_text())
        assert shapes and set(shapes) <= {(tm, n), (tm, k), (k, n)}, shapes
        bound = _loop_flop_bound(tiled, trips, len(shapes) * 2 * tm * k * n)
        dense = ragged.cost_analysis()["flops"]
        one_pass = 2 * t * k * n * (1 if wrap is fwd else 3)
        assert dense > 6 * one_pass  # XLA:CPU still expands ragged_dot (else this test is moot)
        padded = (t + g * tm) / t * one_pass  # every row once, plus < tm padding rows per group
        assert bound < 1.1 * padded < dense / 3, (wrap.__name__, bound, padded, dense)


def _swiglu_ref(x, gate_up, down, gs, act):
    h = jax.lax.ragged_dot(x, gate_up, gs, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.lax.ragged_dot((act(gate) * up).astype(x.dtype), down, gs, preferred_element_type=jnp.float32)


@jax.jit
def _swiglu_both(x, gate_up, down, dy, gs):
    def vg(f):
        out, vjp = jax.vjp(lambda *a: f(*a, gs, jax.nn.silu), x, gate_up, down)
        return (out, *vjp(dy))

    return vg(lambda *a: tiled_swiglu(*a, tile=8)), vg(_swiglu_ref)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_swiglu_matches_ragged_dot(case, dtype):
    """tiled_swiglu (both projections in one tile loop, custom backward) vs the two ragged_dots
    and the activation between them: values, dx, dgate_up, ddown; fp32 output; unrouted rows 0."""
    t, sizes = CASES[case]
    r = np.random.default_rng(3)
    g, d, f = len(sizes), 16, 12
    x = jnp.asarray(r.normal(size=(t, d)), dtype)
    gate_up = jnp.asarray(r.normal(size=(g, d, 2 * f)) * 0.3, dtype)
    down = jnp.asarray(r.normal(size=(g, f, d)) * 0.3, dtype)
    dy = jnp.asarray(r.normal(size=(t, d)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got, want = _swiglu_both(x, gate_up, down, dy, gs)
    if sum(sizes):
        errs = [rel_err(a, b) for a, b in zip(got, want)]
        assert max(errs) < TOL[dtype], errs
    assert got[0].dtype == jnp.float32 and [a.dtype for a in got[1:]] == [dtype] * 3
    used = sum(sizes)
    assert not np.any(np.asarray(got[0])[used:]) and not np.any(np.asarray(got[1], np.float32)[used:])


def test_fused_swiglu_no_group_runs_on_rows_it_was_not_given():
    """As above for the fused SwiGLU at T=256, d=32, f=24, 8 groups: per tile the forward runs
    two dots (6 tm d f FLOPs), the backward four (12 tm d f, h kept from the forward)."""
    t, d, f, g = 256, 32, 24, 8
    r = np.random.default_rng(4)
    x = jnp.asarray(r.normal(size=(t, d)), jnp.float32)
    gate_up = jnp.asarray(r.normal(size=(g, d, 2 * f)), jnp.float32)
    down = jnp.asarray(r.normal(size=(g, f, d)), jnp.float32)
    gs = jnp.array([40, 0, 70, 30, 30, 20, 36, 10], jnp.int32)
    tm = pick_tile(t, g)
    trips = num_tiles(t, g, tm)
    for grad in (False, True):
        fn = lambda *a: tiled_swiglu(*a, gs, jax.nn.silu)
        if grad:
            fn = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), (0, 1, 2))
        compiled = jax.jit(fn).lower(x, gate_up, down).compile()
        shapes = set(_dot_shapes(compiled.as_text()))
        assert shapes <= {(tm, 2 * f), (tm, d), (tm, f), (d, 2 * f), (f, d)}, shapes
        trip_flops = (6 + 12 * grad) * tm * d * f
        one_pass = (6 + 12 * grad) * t * d * f
        padded = (t + g * tm) / t * one_pass
        assert _loop_flop_bound(compiled, trips, trip_flops) < 1.1 * padded < g * one_pass / 3


def test_no_group_reads_the_rows_of_another():
    """A tile is a window on the sorted rows that may overlap the next group's: those rows must
    reach neither this group's weights nor their gradients. Group 1's rows are +inf: every
    output, input gradient and weight gradient of the other groups stays finite (inf * 0 would be
    NaN), in the tiled matmul and in the fused SwiGLU."""
    t, d, f = 40, 8, 6
    sizes = jnp.array([5, 7, 20, 8], jnp.int32)  # tile 16: group 0's window runs into group 1
    r = np.random.default_rng(5)
    x = np.asarray(r.normal(size=(t, d)), np.float32)
    x[5:12] = np.inf
    x = jnp.asarray(x)
    w = jnp.asarray(r.normal(size=(4, d, 2 * f)), jnp.float32)
    down = jnp.asarray(r.normal(size=(4, f, d)), jnp.float32)
    mine = np.r_[0:5, 12:40]  # every row but group 1's
    others = np.array([0, 2, 3])

    def check(fn, *ws):
        out, vjp = jax.vjp(fn, x, *ws)
        grads = vjp(jnp.ones_like(out).at[5:12].set(0))  # no cotangent on group 1's rows
        assert np.isfinite(np.asarray(out)[mine]).all() and np.isfinite(np.asarray(grads[0])[mine]).all()
        for g in grads[1:]:
            assert np.isfinite(np.asarray(g)[others]).all()

    check(lambda a, b: tiled_grouped_matmul(a, b, sizes, tile=16), w)
    check(lambda a, b, c: tiled_swiglu(a, b, c, sizes, jax.nn.silu, tile=16), w, down)


def test_rejects_bad_shapes():
    x = jnp.zeros((24, 8))
    with pytest.raises(ValueError, match="want lhs"):
        tiled_grouped_matmul(x, jnp.zeros((2, 16, 4)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="want lhs"):
        tiled_grouped_matmul(x[None], jnp.zeros((2, 8, 4)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        tiled_grouped_matmul(x, jnp.zeros((2, 8, 4)), jnp.zeros((3,), jnp.int32))


def _constant_built(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Instructions of the optimized HLO producing an f32 `shape` from constants alone (a zero fill
    XLA may build anywhere: nothing it reads is computed)."""
    dims = ",".join(map(str, shape))
    rows = re.findall(rf"\n\s*(%\S+) = f32\[{dims}\]\{{[\d,]*\}} (?:fusion|broadcast)\(([^)]*)\)", hlo)
    return [name for name, args in rows if all(a.strip().startswith("%constant") for a in args.split(","))]


@pytest.mark.parametrize("kernel", ["swiglu", "grouped_matmul"])
def test_backward_builds_its_weight_gradients_from_dy(kernel):
    """Three unrolled layers on slices of one [L, G, ...] weight stack, as the trainer runs them on
    CPU: the backward's [G, ...] gradient buffers are not constant zero fills. XLA built such fills
    (and a copy per layer) during the forward pass and kept them to the backward: 288 MiB of
    configs/mid.py's peak (tiled_grouped_matmul.py `_scan_groups`)."""
    t, d, f, g, layers = 64, 16, 12, 4, 3
    r = np.random.default_rng(5)
    x = jnp.asarray(r.normal(size=(t, d)), jnp.float32)
    gu = jnp.asarray(r.normal(size=(layers, g, d, 2 * f)) * 0.3, jnp.float32)
    dn = jnp.asarray(r.normal(size=(layers, g, 2 * f, d)) * 0.3, jnp.float32)
    gs = jnp.array([20, 0, 30, 14], jnp.int32)

    def layer(h, gu_l, dn_l):
        if kernel == "swiglu":
            return h + tiled_swiglu(h, gu_l, dn_l[:, :f], gs, jax.nn.silu)
        return h + tiled_grouped_matmul(jnp.tanh(tiled_grouped_matmul(h, gu_l, gs)), dn_l, gs)

    def loss(gu, dn):
        h = x
        for i in range(layers):
            h = layer(h, gu[i], dn[i])
        return jnp.sum(h**2)

    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(gu, dn).compile().as_text()
    for shape in [(g, d, 2 * f), (g, f, d) if kernel == "swiglu" else (g, 2 * f, d)]:
        assert _constant_built(hlo, shape) == [], shape
