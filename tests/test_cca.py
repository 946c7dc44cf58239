"""CCA pieces (zaya_jax/model/cca.py): causality, value shift, q-k mean skip, padding, QK norm."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model import ZayaConfig
from zaya_jax.model.cca import (
    CCAttention,
    depthwise_conv,
    grouped_conv,
    l2_qk_norm,
    project,
    qk_mean_skip,
)

CFG = ZayaConfig.tiny(cca_time0=3, cca_time1=3, num_attention_heads=4, num_key_value_heads=2)


def _init(cfg=CFG, s=12):
    module = CCAttention(cfg)
    x = jax.random.normal(jax.random.key(0), (2, s, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(s), (2, s))
    variables = module.init(jax.random.key(1), x, positions_bs=pos, padding_mask_bs=None, rope_theta=1e4)
    return module, variables, x, pos


def _qkv(module, variables, x):
    q, k, v, _ = module.apply(variables, x, method=lambda m, x: m.qkv(x, m.initial_state(x.shape[0])))
    return q, k, v


@pytest.mark.parametrize("t", [0, 5, 11])
def test_outputs_before_t_do_not_see_tokens_after_t(t):
    module, variables, x, pos = _init()
    run = lambda x: module.apply(variables, x, positions_bs=pos, padding_mask_bs=None, rope_theta=1e4)[0]
    x2 = x.at[:, t:].set(jax.random.normal(jax.random.key(9), x[:, t:].shape))
    a, b = run(x), run(x2)
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    assert not np.allclose(a[:, t:], b[:, t:])
    # The projections alone (conv + shift) are causal too.
    qa, ka, va = _qkv(module, variables, x)
    qb, kb, vb = _qkv(module, variables, x2)
    for u, w in ((qa, qb), (ka, kb), (va, vb)):
        np.testing.assert_array_equal(np.asarray(u[:, :t]), np.asarray(w[:, :t]))


def test_conv_receptive_field_is_t0_plus_t1_minus_1():
    module, variables, x, _ = _init()
    t, reach = 6, CFG.cca_time0 + CFG.cca_time1 - 2
    x2 = x.at[:, t].add(1.0)
    qa, _, _ = _qkv(module, variables, x)
    qb, _, _ = _qkv(module, variables, x2)
    changed = np.abs(np.asarray(qa - qb)).max(axis=(0, 2, 3)) > 0
    np.testing.assert_array_equal(np.nonzero(changed)[0], np.arange(t, t + reach + 1))


def test_value_shift_first_half_current_second_half_previous():
    module, variables, x, _ = _init()
    p = variables["params"]
    _, _, v = _qkv(module, variables, x)
    v = np.asarray(v).reshape(2, x.shape[1], -1)  # [B, S, Nkv*hd]
    half = v.shape[-1] // 2
    cur = np.asarray(x @ p["v_proj_current"]["kernel"])
    dele = np.asarray(x @ p["v_proj_delayed"]["kernel"])
    np.testing.assert_allclose(v[..., :half], cur, atol=1e-6)
    np.testing.assert_allclose(v[:, 1:, half:], dele[:, :-1], atol=1e-6)
    np.testing.assert_allclose(v[:, 0, half:], 0.0, atol=1e-6)  # projection of a zero vector, no bias


def _dots(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general[")


def test_the_four_projections_backward_is_one_input_gradient_product():
    module, variables, x, _ = _init(CFG.replace(attention_bias=True))
    p = {n: dict(w) if isinstance(w, dict) else w for n, w in variables["params"].items()}
    for i, n in enumerate(("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")):
        p[n]["bias"] = p[n]["bias"] + 0.1 * (i + 1)  # distinct, non-zero biases
    variables = {"params": p}
    dense = lambda n, x: np.asarray(nn.Dense(p[n]["kernel"].shape[1]).apply({"params": p[n]}, x))
    weights = [(p[n]["kernel"], p[n]["bias"]) for n in ("q_proj", "k_proj", "v_proj_current")]
    for got, n in zip(project(x, weights, jnp.float32), ("q_proj", "k_proj", "v_proj_current")):
        np.testing.assert_array_equal(np.asarray(got), dense(n, x))  # nn.Dense's values, to the bit
    # Through the module: the value halves, the first token's 'previous' is Wvd's projection of 0.
    qkv = lambda v, x: _qkv(module, v, x)
    v = np.asarray(qkv(variables, x)[2]).reshape(*x.shape[:2], -1)
    half = v.shape[-1] // 2
    np.testing.assert_allclose(v[..., :half], dense("v_proj_current", x), atol=2e-6)
    np.testing.assert_allclose(v[:, 1:, half:], dense("v_proj_delayed", x)[:, :-1], atol=2e-6)
    np.testing.assert_allclose(v[:, 0, half:], np.broadcast_to(p["v_proj_delayed"]["bias"], (2, half)))
    # Forward: a product per projection (the convolutions are no dot_general). The gradient: those,
    # ONE input-gradient and ONE weight-gradient product for all four, and the grouped conv's
    # kernel gradient, a product per tap (autodiff: 4 + 4 + 4 + taps, and the zero vector's 1 + 1).
    assert _dots(qkv, variables, x) == 4
    loss = lambda v, x: sum(jnp.sum(t * t) for t in qkv(v, x))
    assert _dots(jax.grad(loss, argnums=(0, 1)), variables, x) == 4 + 2 + CFG.cca_time1


def test_qk_mean_skip():
    r = np.random.default_rng(0)
    q0 = r.normal(size=(1, 3, 6, 4)).astype(np.float32)  # 6 query heads
    k0 = r.normal(size=(1, 3, 2, 4)).astype(np.float32)  # 2 kv heads, groups of 3
    mq, mk = qk_mean_skip(jnp.asarray(q0), jnp.asarray(k0))
    for j in range(6):
        np.testing.assert_allclose(mq[:, :, j], (q0[:, :, j] + k0[:, :, j // 3]) / 2, rtol=1e-6)
    for h in range(2):
        np.testing.assert_allclose(mk[:, :, h], np.asarray(mq)[:, :, 3 * h : 3 * h + 3].mean(2), rtol=1e-6)


def test_l2_qk_norm_with_linear_temperature():
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(2, 5, 4, 16)), jnp.float32)
    k = jnp.asarray(r.normal(size=(2, 5, 2, 16)), jnp.float32)
    temp = jnp.array([0.5, 2.0])
    qn, kn = l2_qk_norm(q, k, temp)
    np.testing.assert_allclose(np.linalg.norm(qn, axis=-1), 4.0, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(kn, axis=-1), np.broadcast_to([2.0, 8.0], (2, 5, 2)), rtol=1e-5)


def test_padding_tokens_do_not_leak():
    """Changing a padded token changes nothing for real tokens (neither via conv, shift nor attention)."""
    module, variables, x, pos = _init()
    mask = jnp.ones((2, 12)).at[:, :4].set(0)  # left padding
    run = lambda x: module.apply(variables, x, positions_bs=pos, padding_mask_bs=mask, rope_theta=1e4)[0]
    x2 = x.at[:, :4].set(100.0)
    np.testing.assert_allclose(np.asarray(run(x)[:, 4:]), np.asarray(run(x2)[:, 4:]), atol=1e-6)
    assert np.isfinite(np.asarray(run(x))).all()


def test_incremental_state_equals_full_sequence():
    """Running the projections in two chunks with the carried CCAState equals one full pass."""
    module, variables, x, _ = _init()
    full = _qkv(module, variables, x)

    def chunked(m, x):
        q1, k1, v1, st = m.qkv(x[:, :7], m.initial_state(x.shape[0]))
        q2, k2, v2, _ = m.qkv(x[:, 7:], st)
        return [jnp.concatenate(p, 1) for p in ((q1, q2), (k1, k2), (v1, v2))]

    for a, b in zip(full, module.apply(variables, x, method=chunked)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("per_tap", [False, True])
@pytest.mark.parametrize("taps", [2, 3])
def test_grouped_conv_values_and_gradients_equal_per_group_loop(taps, per_tap):
    """grouped_conv (XLA convolution forward or one product per tap, hand-written backward) equals
    a float64 loop over groups and taps, y[t] = sum_i x[t+i] w[i] per group, and its gradients
    equal the loop's finite differences."""
    n, t, groups, h = 2, 9, 3, 4
    kx, kw, kd, kp = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(kx, (n, t, groups * h))
    w = jax.random.normal(kw, (taps, h, groups * h))
    dy = jax.random.normal(kd, (n, t - taps + 1, groups * h))

    def loop(x, w):
        x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
        y = np.zeros((n, t - taps + 1, groups * h))
        for g in range(groups):
            cols = slice(g * h, (g + 1) * h)
            for i in range(taps):
                y[:, :, cols] += x[:, i : i + t - taps + 1, cols] @ w[i][:, cols]
        return y

    y, vjp = jax.vjp(lambda x, w: grouped_conv(x, w, groups, per_tap), x, w)
    np.testing.assert_allclose(y, loop(x, w), rtol=0, atol=1e-5)
    dx, dw = vjp(dy)
    px, pw = (jax.random.normal(k, a.shape) for k, a in zip(jax.random.split(kp), (x, w)))
    eps = 1e-4
    f = lambda s: np.vdot(
        loop(np.float64(x) + s * eps * np.float64(px), np.float64(w) + s * eps * np.float64(pw)), dy
    )
    fd = (f(1) - f(-1)) / (2 * eps)
    ad = float(jnp.vdot(dx, px) + jnp.vdot(dw, pw))
    assert abs(ad - fd) < 1e-4 * max(1.0, abs(fd)), (ad, fd)


@pytest.mark.parametrize("taps", [2, 3])
def test_depthwise_conv_gradients_equal_autodiff_of_its_taps(taps):
    """depthwise_conv's written-out backward equals autodiff of y[t] = sum_i u[t+i] w[i] (lead axes
    [n, chunks] as the model calls it)."""
    ku, kw, kd = jax.random.split(jax.random.key(6), 3)
    u = jax.random.normal(ku, (2, 3, 7, 5))
    w = jax.random.normal(kw, (taps, 5))
    dy = jax.random.normal(kd, (2, 3, 7 - taps + 1, 5))
    taps_sum = lambda u, w: sum(u[..., i : i + 7 - taps + 1, :] * w[i] for i in range(taps))
    y, vjp = jax.vjp(depthwise_conv, u, w)
    y_ref, vjp_ref = jax.vjp(taps_sum, u, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    for got, want in zip(vjp(dy), vjp_ref(dy)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
