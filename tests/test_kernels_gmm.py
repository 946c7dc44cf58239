"""Pallas grouped matmul / tgmm / swiglu_grouped_pallas (interpret mode on CPU) vs ragged_dot.

Values and gradients (dlhs, drhs) across ragged groups: empty groups, groups smaller than
block_m, rows past sum(group_sizes) (must be 0), T/K/N not multiples of the blocks, one token.
Error metric: max|a - b| / max|b| (fp32 within 1e-5, bf16 within 2e-2).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.gmm_operands import operands
from support.kernel_lowering import lowered_triton_kernels
from support.xla_env import FAST_COMPILE

from zaya_jax.kernels import grouped_matmul, reference_grouped_matmul, swiglu_grouped_pallas, tgmm
from zaya_jax.kernels.grouped_matmul import make_tiles, num_tiles
from zaya_jax.model.moe import ACTIVATIONS, swiglu_grouped

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
ERRORS: dict = {}  # (test, dtype) -> {output: rel_err}; printed by test_zz_report with -s


def rel_err(a, b, floor: float = 1e-30) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]


def run_compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def check_gmm(lhs, rhs, dout, group_sizes, *, dtype, out_dtype=jnp.float32, **blocks):
    """Kernel vs ragged_dot: value, dlhs, drhs in one compiled program."""

    def vg(f):
        def fn(lhs, rhs, dout, gs):
            out, vjp = jax.vjp(lambda a, b: f(a, b, gs, preferred_element_type=out_dtype), lhs, rhs)
            return (out, *vjp(dout.astype(out.dtype)))

        return fn

    kern = vg(lambda *a, **k: grouped_matmul(*a, interpret=True, **blocks, **k))
    ref = vg(reference_grouped_matmul)
    got, want = run_compiled(lambda *a: (kern(*a), ref(*a)), lhs, rhs, dout, group_sizes)
    errs = {name: rel_err(a, b) for name, a, b in zip(("out", "dlhs", "drhs"), got, want)}
    ERRORS[(current_test(), str(jnp.dtype(dtype)))] = errs
    assert max(errs.values()) < TOL[dtype], errs
    out, dlhs, drhs = got
    assert out.dtype == jnp.dtype(out_dtype) and dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
    used = int(np.sum(np.asarray(group_sizes)))
    assert not np.any(np.asarray(out)[used:]), "rows past sum(group_sizes) must be 0"
    assert not np.any(np.asarray(dlhs, np.float32)[used:]), "and get no gradient"
    empty = np.asarray(group_sizes) == 0
    assert not np.any(np.asarray(drhs, np.float32)[empty]), "empty groups get zero drhs"
    return errs


# ------------------------------------------------------------------------------------------ gmm
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_groups(dtype):
    """T=45 (not a multiple of 16), K=24, N=40; groups: small, empty, spanning tiles, smaller than
    block_m, then 6 unrouted rows; an empty last group. Output in the operand dtype (bf16 output
    and bf16 cotangents for the bf16 case)."""
    lhs, rhs, dout = operands(45, 24, 40, 5, dtype)
    gs = jnp.array([3, 0, 21, 15, 0], jnp.int32)
    check_gmm(lhs, rhs, dout, gs, dtype=dtype, out_dtype=dtype, block_m=16, block_n=16, block_k=16)


def test_one_token_and_default_blocks():
    """A single token routed to the last of 3 experts; blocks from pick_blocks (clipped to 16)."""
    lhs, rhs, dout = operands(1, 32, 48, 3, jnp.float32, seed=1)
    check_gmm(lhs, rhs, dout, jnp.array([0, 0, 1], jnp.int32), dtype=jnp.float32)


def test_no_routed_rows_and_native_dtype_output():
    """sum(group_sizes) = 0: the output is all zeros, all gradients 0; output in lhs dtype."""
    lhs, rhs, _ = operands(20, 16, 16, 2, jnp.float32, seed=2)
    gs = jnp.zeros((2,), jnp.int32)
    f = lambda a, b, g: grouped_matmul(a, b, g, block_m=16, interpret=True)
    out, (dl, dr) = run_compiled(
        lambda a, b, g: (f(a, b, g), jax.grad(lambda a, b: jnp.sum(f(a, b, g)), (0, 1))(a, b)), lhs, rhs, gs
    )
    assert out.dtype == lhs.dtype and not np.any(np.asarray(out))
    assert not np.any(np.asarray(dl)) and not np.any(np.asarray(dr))


def test_tgmm_matches_per_group_products():
    """tgmm directly: out[g] = lhs_g^T dout_g, with fp32 x fp32 and an empty group."""
    lhs, _, dout = operands(37, 20, 24, 1, jnp.float32, seed=3)
    gs = jnp.array([10, 0, 17, 4], jnp.int32)
    got = run_compiled(
        lambda a, d, g: tgmm(a, d, g, block_m=16, block_k=16, block_n=16, interpret=True), lhs, dout, gs
    )
    starts = np.concatenate([[0], np.cumsum(np.asarray(gs))[:-1]])
    a, d = np.asarray(lhs), np.asarray(dout)
    want = np.stack([a[s : s + n].T @ d[s : s + n] for s, n in zip(starts, np.asarray(gs))])
    assert got.shape == (4, 20, 24)
    assert rel_err(got, want) < 1e-5


def test_tile_list():
    """Tiles start at group boundaries, never mix groups, cover every row exactly once (the
    tail included) and fit the static bound."""
    rng = np.random.default_rng(0)
    t, g = 90, 5
    for bm in (16, 32):
        tiles = jax.jit(lambda sizes: make_tiles(sizes, t, bm))
        for _ in range(10):
            sizes = rng.integers(0, 25, size=g) * (rng.random(g) < 0.7)
            tg, ts, te = map(np.asarray, tiles(jnp.asarray(sizes, jnp.int32)))
            assert len(tg) == num_tiles(t, g, bm)
            covered = np.zeros(t, int)
            bounds = np.concatenate([[0], np.cumsum(sizes), [t]])
            for grp, s, e in zip(tg, ts, te):
                rows = np.arange(s, min(s + bm, e))
                covered[rows] += 1
                if len(rows):
                    assert bounds[grp] <= rows[0] and rows[-1] < bounds[grp + 1]
            assert np.all(covered == 1)


# ------------------------------------------------------------------------------ swiglu_grouped
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_grouped_pallas_matches_model(dtype):
    """Same signature/semantics as zaya_jax.model.moe.swiglu_grouped: value + grads wrt x and both
    weight stacks, with an empty expert and unrouted (skip-class) rows at the end."""
    t, d, i, e = 30, 32, 16, 4
    ks = jax.random.split(jax.random.PRNGKey(4), 4)
    x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(dtype)
    gate_up = (0.2 * jax.random.normal(ks[1], (e, d, 2 * i), jnp.float32)).astype(dtype)
    down = (0.2 * jax.random.normal(ks[2], (e, i, d), jnp.float32)).astype(dtype)
    dy = jax.random.normal(ks[3], (t, d), jnp.float32)
    gs = jnp.array([7, 0, 12, 6], jnp.int32)  # 25 routed, 5 skipped
    act = ACTIVATIONS["silu"]

    def vg(f):
        def fn(x, gu, dn, dy, gs):
            y, vjp = jax.vjp(lambda x, gu, dn: f(x, gu, dn, gs, act), x, gu, dn)
            return (y, *vjp(dy))

        return fn

    kern = vg(lambda *a: swiglu_grouped_pallas(*a, interpret=True, block_m=16, block_n=16, block_k=16))
    got, want = run_compiled(lambda *a: (vg(swiglu_grouped)(*a), kern(*a))[::-1], x, gate_up, down, dy, gs)
    errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dgate_up", "ddown"), got, want)}
    ERRORS[(current_test(), str(jnp.dtype(dtype)))] = errs
    assert got[0].dtype == jnp.float32
    assert not np.any(np.asarray(got[0])[25:])
    assert max(errs.values()) < TOL[dtype], errs


# ------------------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_to_triton(monkeypatch, platform):
    """gmm, transposed gmm (dlhs) and tgmm (drhs) lower to Triton IR at ZAYA1 expert sizes
    (d = I = 2048, 16 experts) with a ragged token count."""
    sds = jax.ShapeDtypeStruct

    def fn(x, w, gs):
        out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, preferred_element_type=jnp.float32), x, w)
        return out, vjp(out)

    names = lowered_triton_kernels(
        monkeypatch,
        fn,
        sds((4000, 2048), jnp.bfloat16),
        sds((16, 2048, 4096), jnp.bfloat16),
        sds((16,), jnp.int32),
        platform=platform,
    )
    assert sorted(names) == ["zaya_gmm", "zaya_gmm", "zaya_tgmm"], names


def test_rejects_bad_arguments():
    lhs, rhs, _ = operands(8, 16, 16, 2, jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        grouped_matmul(lhs, rhs, jnp.array([4, 4]), block_m=24, interpret=True)
    with pytest.raises(ValueError, match="mismatched"):
        grouped_matmul(lhs, rhs, jnp.array([4, 4, 0]), interpret=True)


def test_zz_report():
    """Prints the max errors measured above (pytest -s); runs last in this file."""
    for (name, dtype), errs in sorted(ERRORS.items()):
        print(f"{name:55s} {dtype:9s} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
