"""Tests for zaya_jax.optim.muon: parity with optax.contrib.muon, NS quality,
per-matrix batching, bf16 Newton–Schulz and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon

from zaya_jax.optim.muon import muon, orthogonalize, scale_by_muon, shape_scale


def _normal(seed, shape, dtype=jnp.float32):
    # numpy RNG: jax.random compiles once per shape, which dominates test time.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _params():
    # Wide, tall and batched [L, E, in, out] leaves.
    return {
        "wide": _normal(0, (16, 48)),
        "tall": _normal(1, (40, 12)),
        "experts": _normal(2, (2, 3, 8, 12)),
    }


# optax only treats the last two axes as the matrix when told so.
_OPTAX_DIMS = {
    "wide": MuonDimensionNumbers(0, 1),
    "tall": MuonDimensionNumbers(0, 1),
    "experts": MuonDimensionNumbers(reduction_axis=2, output_axis=3),
}


_ortho = jax.jit(orthogonalize, static_argnames=("ns_dtype",))


def _max_abs_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("nesterov,consistent_rms", [(True, 0.2), (False, None)])
def test_matches_optax_contrib_muon(nesterov, consistent_rms):
    params = _params()
    lr = optax.linear_schedule(0.02, 0.005, 4)
    common = dict(
        beta=0.9,
        ns_steps=5,
        ns_coeffs=(3.4445, -4.7750, 2.0315),
        eps=1e-8,
        weight_decay=0.1,
        nesterov=nesterov,
        consistent_rms=consistent_rms,
    )
    ref = optax_muon(lr, muon_weight_dimension_numbers=_OPTAX_DIMS, **common)
    ours = muon(lr, **common)
    s_ref, s_ours = ref.init(params), ours.init(params)
    ref_update, ours_update = jax.jit(ref.update), jax.jit(ours.update)
    p_ref = p_ours = params
    worst = 0.0
    for step in range(4):
        grads = jax.tree.map(lambda p, i=step: _normal(100 + i, p.shape), params)
        u_ref, s_ref = ref_update(grads, s_ref, p_ref)
        u_ours, s_ours = ours_update(grads, s_ours, p_ours)
        worst = max(worst, _max_abs_diff(u_ref, u_ours))
        p_ref = optax.apply_updates(p_ref, u_ref)
        p_ours = optax.apply_updates(p_ours, u_ours)
    assert worst < 1e-5, worst
    assert _max_abs_diff(p_ref, p_ours) < 1e-5


def test_reference_muon_without_bias_correction():
    # Reference Muon (KellerJordan/Muon): m <- lerp(m, g, 1 - beta);
    # u = NS(lerp(g, m, beta)) * sqrt(max(1, out / in)); p <- p - lr * u.
    beta, lr = 0.9, 0.05
    w = _normal(0, (12, 20))
    opt = muon(lr, beta=beta, bias_correction=False, consistent_rms=None)
    state, update = opt.init({"w": w}), jax.jit(opt.update)
    m = np.zeros((12, 20), np.float32)
    for step in range(3):
        g = _normal(10 + step, (12, 20))
        m = beta * m + (1 - beta) * np.asarray(g)
        expected = -lr * np.sqrt(20 / 12) * np.asarray(_ortho((1 - beta) * g + beta * m))
        upd, state = update({"w": g}, state, {"w": w})
        np.testing.assert_allclose(upd["w"], expected, atol=1e-6)


def test_update_rms_matches_consistent_rms():
    # consistent_rms=0.2 promises update RMS ~0.2*lr for any shape.
    params = {"a": _normal(0, (64, 256)), "b": _normal(1, (256, 32))}
    opt = muon(1.0, consistent_rms=0.2)
    grads = jax.tree.map(lambda p: _normal(7, p.shape), params)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    for u in jax.tree.leaves(updates):
        rms = float(jnp.sqrt(jnp.mean(u**2)))
        assert 0.15 < rms < 0.25, rms


def test_shape_scale_rules():
    assert shape_scale((3, 64, 256), 0.2) == pytest.approx(0.2 * 16.0)
    assert shape_scale((64, 256), None) == pytest.approx(2.0)
    assert shape_scale((256, 64), None) == pytest.approx(1.0)


@pytest.mark.parametrize("shape", [(8, 8), (32, 8), (8, 32), (128, 64), (48, 96)])
def test_newton_schulz_singular_values(shape):
    # Random Gaussian matrices of these shapes are well conditioned, so 5 quintic
    # steps push every singular value into the iteration's band (~[0.68, 1.20]);
    # it never converges to exactly 1 by design of the coefficients.
    for seed in range(3):
        x = _normal(seed, shape)
        out = _ortho(x)
        assert out.shape == shape
        sv = np.linalg.svd(np.asarray(out), compute_uv=False)
        assert sv.min() > 0.65 and sv.max() < 1.21, (sv.min(), sv.max())
        # Same singular vectors as the input: Uᵀ out V is diagonal (out = U f(S) Vᵀ).
        u, _, vt = np.linalg.svd(np.asarray(x), full_matrices=False)
        core = u.T @ np.asarray(out) @ vt.T
        assert np.abs(core - np.diag(np.diag(core))).max() < 1e-4


def test_newton_schulz_square_with_spread_spectrum():
    # Square matrix with singular values spread over [0.1, 1]: still inside the band.
    n = 64
    u, _ = np.linalg.qr(np.asarray(_normal(0, (n, n))))
    v, _ = np.linalg.qr(np.asarray(_normal(1, (n, n))))
    s = np.geomspace(0.1, 1.0, n)
    x = jnp.asarray((u * s) @ v.T, jnp.float32)
    sv = np.linalg.svd(np.asarray(_ortho(x)), compute_uv=False)
    assert sv.min() > 0.65 and sv.max() < 1.21


def test_newton_schulz_is_scale_invariant():
    x = _normal(0, (16, 24))
    np.testing.assert_allclose(_ortho(x), _ortho(1e3 * x), atol=1e-5)


def test_batched_equals_per_matrix():
    x = _normal(3, (2, 3, 12, 20))
    batched = _ortho(x)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(batched[i, j], _ortho(x[i, j]), atol=1e-6)
    # The full transformation as well: momentum is elementwise, NS per slice.
    tall = jnp.swapaxes(x, -1, -2)  # [2, 3, 20, 12] exercises the transpose path
    tx = scale_by_muon()
    tx_update = jax.jit(tx.update)
    upd, _ = tx_update({"w": tall}, tx.init({"w": tall}))
    for i in range(2):
        for j in range(3):
            single, _ = tx_update({"w": tall[i, j]}, tx.init({"w": tall[i, j]}))
            np.testing.assert_allclose(upd["w"][i, j], single["w"], atol=1e-6)


def test_tall_orientation_is_the_transposed_wide_iteration():
    # Tall slices contract their long axis in place (A = X^T X, X <- aX + X p(A)) instead of being
    # transposed: the same iteration as on X^T, so NS(X) = NS(X^T)^T up to rounding.
    x = _normal(5, (2, 40, 12))
    np.testing.assert_allclose(_ortho(x), jnp.swapaxes(_ortho(jnp.swapaxes(x, -1, -2)), -1, -2), atol=1e-6)


def test_bf16_ns_dtype_close_to_fp32():
    x = _normal(4, (2, 32, 64))
    ref = _ortho(x)
    low = _ortho(x, ns_dtype=jnp.bfloat16)
    assert low.dtype == jnp.float32  # cast back to the input dtype
    rel = float(jnp.linalg.norm(low - ref) / jnp.linalg.norm(ref))
    assert rel < 0.1, rel
    sv = np.linalg.svd(np.asarray(low), compute_uv=False)
    assert sv.min() > 0.55 and sv.max() < 1.3

    params = {"w": x}
    opt = muon(0.1, ns_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16)
    state = opt.init(params)
    assert state[0].mu["w"].dtype == jnp.bfloat16
    upd, _ = jax.jit(opt.update)(params, state, params)
    assert upd["w"].dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(upd["w"])))


def test_rejects_vectors():
    with pytest.raises(ValueError, match="ndim >= 2"):
        muon(0.1).init({"w": jnp.ones((4, 4)), "b": jnp.ones((4,))})
    with pytest.raises(ValueError, match="ndim >= 2"):
        orthogonalize(jnp.ones((4,)))
    with pytest.raises(ValueError):
        scale_by_muon(ns_coeffs=(1.0, 2.0))
