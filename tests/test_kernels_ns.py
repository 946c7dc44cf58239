"""Pallas Newton-Schulz (interpret mode on CPU) vs the XLA `orthogonalize` of the same module.

Error metric: max|a - b| / max|b|. fp32 iteration within 1e-5 of the reference; bf16 inputs with
the default fp32 iteration within 2e-2. A bf16 *iteration* (ns_dtype=bfloat16) is rounding noise
on both sides: the XLA reference itself is ~5-9% (max) away from the fp32 iteration on CPU, so
the kernel is checked against the fp32 result instead (it must be at least as close as the
reference, and within 2e-2 in relative Frobenius norm).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.kernel_lowering import lowered_triton_kernels
from support.xla_env import FAST_COMPILE

from zaya_jax.kernels import newton_schulz, reference_newton_schulz
from zaya_jax.kernels.newton_schulz import orthogonalize

ERRORS: dict = {}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def fro_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]


def run_compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def ns_kernel(**kw):
    return lambda x: newton_schulz(x, block=16, block_k=16, interpret=True, **kw)


def test_fp32_batched_wide_and_tall():
    """Expert stacks [L, E, m, n]: a wide batch and a tall one (iterated transposed), sizes not
    multiples of the 16-blocks; one compiled program for both."""
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    wide = jax.random.normal(ks[0], (2, 2, 24, 40), jnp.float32)
    tall = jax.random.normal(ks[1], (3, 50, 20), jnp.float32)
    f = ns_kernel()
    got = run_compiled(lambda a, b: (f(a), f(b)), wide, tall)
    for name, g, x in zip(("wide", "tall"), got, (wide, tall)):
        want = orthogonalize(x)
        assert g.shape == x.shape and g.dtype == x.dtype
        err = rel_err(g, want)
        ERRORS[(f"{current_test()}[{name}]", "float32")] = {"out": err}
        assert err < 1e-5, (name, err)


def test_bf16_input_fp32_iteration_and_custom_coeffs():
    """Muon's default: bf16 gradients, fp32 iteration; non-default coefficients and step count."""
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 48), jnp.float32).astype(jnp.bfloat16)
    kw = dict(ns_coeffs=(2.0, -1.5, 0.5), ns_steps=3)
    got = run_compiled(ns_kernel(**kw), x)
    want = orthogonalize(x, **kw)
    assert got.dtype == jnp.bfloat16
    err = rel_err(got, want)
    ERRORS[(current_test(), "bfloat16")] = {"out": err}
    assert err < 2e-2, err


def test_bf16_iteration_is_at_least_as_accurate_as_reference():
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 40, 40), jnp.float32)
    got = run_compiled(ns_kernel(ns_dtype=jnp.bfloat16), x)
    exact = orthogonalize(x)  # fp32 iteration
    ref = orthogonalize(x, ns_dtype=jnp.bfloat16)
    errs = {
        "vs_fp32_max": rel_err(got, exact),
        "vs_fp32_fro": fro_err(got, exact),
        "ref_vs_fp32_max": rel_err(ref, exact),
        "vs_bf16_ref_max": rel_err(got, ref),
    }
    ERRORS[(current_test(), "bfloat16")] = errs
    assert errs["vs_fp32_fro"] < 2e-2, errs
    assert errs["vs_fp32_max"] <= errs["ref_vs_fp32_max"], errs


def test_reference_wrapper_and_single_matrix():
    """A single 2-D matrix (no batch axis) and reference_newton_schulz == orthogonalize."""
    x = jax.random.normal(jax.random.PRNGKey(3), (17, 33), jnp.float32)
    got = run_compiled(ns_kernel(ns_steps=2), x)
    want = reference_newton_schulz(x, ns_steps=2, block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(want), np.asarray(orthogonalize(x, ns_steps=2)))
    assert rel_err(got, want) < 1e-5


def test_per_slice_matches_the_batched_chain():
    """per_slice=True (the optimizer's choice on CPU, kernels.NS_PER_SLICE): each slice iterated in
    turn, its result written over its own input slice: the batched chain's result, in a loop, with
    temporaries of one slice instead of more than the whole stack (configs/mid.py's update held
    6 x 192 MiB of them for its [6, 16, 512, 1024] experts)."""
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    for shape in [(3, 5, 24, 40), (2, 4, 64, 48), (40, 24)]:
        x = jax.random.normal(jax.random.PRNGKey(4), shape, jnp.float32)
        whole = jax.jit(orthogonalize).lower(x).compile()
        looped = jax.jit(functools.partial(orthogonalize, per_slice=True)).lower(x).compile()
        assert ("while" in looped.as_text()) == (len(shape) > 2) and "while" not in whole.as_text()
        np.testing.assert_allclose(np.asarray(looped(x)), np.asarray(whole(x)), rtol=0, atol=1e-6)
        if len(shape) > 2:
            assert temp(looped) < x.nbytes / 2 < x.nbytes < temp(whole), (temp(looped), temp(whole))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ndim"):
        newton_schulz(jnp.ones((4,)), interpret=True)
    with pytest.raises(ValueError, match="triple"):
        newton_schulz(jnp.ones((4, 4)), ns_coeffs=(1.0, 2.0), interpret=True)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("ns_dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton(monkeypatch, platform, ns_dtype):
    """The three per-step kernels lower to Triton IR for a ZAYA1 expert stack [16, 2048, 4096]."""
    names = lowered_triton_kernels(
        monkeypatch,
        lambda x: newton_schulz(x, ns_dtype=ns_dtype),
        jax.ShapeDtypeStruct((16, 4096, 2048), jnp.float32),
        platform=platform,
    )
    assert names == ["zaya_ns_matmul"] * 3, names


def test_zz_report():
    """Prints the errors measured above (pytest -s); runs last in this file."""
    for (name, dtype), errs in sorted(ERRORS.items()):
        print(f"{name:55s} {dtype:9s} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
