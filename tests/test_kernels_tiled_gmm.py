"""The plain-XLA tiled grouped matmul (zaya_jax/kernels/tiled_grouped_matmul.py) vs ragged_dot.

Values and gradients (dlhs, drhs) across ragged groups: empty groups, groups smaller than a tile,
one token, all rows in one group, rows past sum(group_sizes) (skip-class tokens: output 0, no
gradient). And the point of it: compiled, no group's weights meet rows it was not given.
Error metric: max|a - b| / max|b| (fp32 within 1e-5, bf16 within 2e-2).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_gmm import operands

from zaya_jax.kernels.tiled_grouped_matmul import (
    num_tiles,
    pick_tile,
    tile_layout,
    tiled_grouped_matmul,
    tiled_matmul,
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


def test_tile_layout():
    """Every routed row lands once in a tile of its own group, tiles start at group boundaries,
    padding and rows past sum(group_sizes) read the zero row, and the static bound holds."""
    rng = np.random.default_rng(0)
    t, g = 90, 5
    layout_fn = jax.jit(tile_layout, static_argnums=(1, 2))
    for tm in (8, 16, 32):
        for _ in range(10):
            sizes = rng.multinomial(rng.integers(0, t + 1), np.ones(g) / g) * (rng.random(g) < 0.7)
            src, dst, tile_group = map(np.asarray, layout_fn(jnp.asarray(sizes, jnp.int32), t, tm))
            n = num_tiles(t, g, tm)
            assert src.shape == (n * tm,) and tile_group.shape == (n,) and dst.shape == (t,)
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            used = int(bounds[-1])
            assert np.all(dst[used:] == n * tm)
            np.testing.assert_array_equal(src[dst[:used]], np.arange(used))  # dst inverts src
            assert np.sum(src < t) == used and np.all(src[src < t] < used)
            row_group = np.repeat(tile_group, tm)
            for p in np.flatnonzero(src < t):
                assert bounds[row_group[p]] <= src[p] < bounds[row_group[p] + 1]
            n_used = int(np.sum(-(-sizes // tm)))
            assert np.all(tile_group[:n_used] < g) and np.all(tile_group[n_used:] == g)
            assert np.all(np.diff(tile_group) >= 0)


def test_pick_tile():
    assert pick_tile(64, 8) == 8 and pick_tile(2048, 8) == 64 and pick_tile(1 << 20, 16) == 128


def _dot_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Output shapes of the dot instructions in an optimized HLO module."""
    shapes = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", hlo)
    return [tuple(int(s) for s in shape.split(",") if s) for shape in shapes]


def test_no_group_runs_on_rows_it_was_not_given():
    """Compiled forward and gradient at T=256, K=32, N=48, 8 groups: every dot is one tile's
    ([tm, N] or [tm, K] out) or one tile's weight-gradient term ([K, N]), 2 tm K N FLOPs each, in
    a tile loop of at most num_tiles = T/tm + G trips. XLA's cost_analysis counts a loop body
    once, so the total is at most its count + (trips - 1) x the dots' FLOPs. That bound must be
    well below ragged_dot's count on XLA:CPU, which multiplies every group by every row."""
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
        bound = tiled.cost_analysis()["flops"] + (trips - 1) * len(shapes) * 2 * tm * k * n
        dense = ragged.cost_analysis()["flops"]
        one_pass = 2 * t * k * n * (1 if wrap is fwd else 3)
        assert dense > 6 * one_pass  # XLA:CPU still expands ragged_dot (else this test is moot)
        assert bound < 2 * one_pass < dense / 3, (wrap.__name__, bound, one_pass, dense)


def test_tiled_matmul_rejects_bad_shapes():
    x = jnp.zeros((24, 8))
    with pytest.raises(ValueError, match="mismatched"):
        tiled_matmul(x, jnp.zeros((2, 16, 4)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="mismatched"):
        tiled_matmul(x, jnp.zeros((2, 8, 4)), jnp.zeros((5,), jnp.int32))  # 24 rows, 5 tiles
    with pytest.raises(ValueError, match="group_sizes"):
        tiled_grouped_matmul(x, jnp.zeros((2, 8, 4)), jnp.zeros((3,), jnp.int32))
