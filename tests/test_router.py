"""The ZAYA1 router (zaya_jax/model/router.py): biased top-1, unbiased weight, skip class, EDA."""

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.model import ZayaConfig
from zaya_jax.model.router import BALANCING, ZayaRouter, init_balancing_biases

CFG = ZayaConfig.tiny(num_experts=4)


def _run(biases=None, prev=None, x=None):
    router = ZayaRouter(CFG)
    x = jax.random.normal(jax.random.key(0), (2, 16, CFG.hidden_size)) if x is None else x
    prev = jnp.zeros((2, 16, CFG.router_hidden_size)) if prev is None else prev
    variables = router.init(jax.random.key(1), x, prev)
    if biases is not None:
        variables = {**variables, BALANCING: {"balancing_biases": jnp.asarray(biases, jnp.float32)}}
    return router.apply(variables, x, prev), variables


def test_initial_biases_make_skip_unlikely():
    np.testing.assert_array_equal(init_balancing_biases(4), [0, 0, 0, 0, -1])


def test_bias_changes_choice_not_weight():
    base, _ = _run()
    probs = np.asarray(base.probs_bse)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(base.expert_bs, probs[..., :4].argmax(-1))
    biased, _ = _run(biases=[0, 0, 0, 10.0, -1])  # expert 3 wins everywhere
    assert (np.asarray(biased.expert_bs) == 3).all()
    np.testing.assert_allclose(biased.weight_bs, probs[..., 3], rtol=1e-6)  # unbiased p[chosen]


def test_skip_class_has_zero_weight():
    out, _ = _run(biases=[0, 0, 0, 0, 10.0])
    assert (np.asarray(out.expert_bs) == 4).all() and (np.asarray(out.weight_bs) == 0).all()


def test_bias_gets_no_gradient_and_weight_does():
    x = jax.random.normal(jax.random.key(0), (2, 16, CFG.hidden_size))
    _, variables = _run(x=x)
    router = ZayaRouter(CFG)
    prev = jnp.zeros((2, 16, CFG.router_hidden_size))
    g = jax.grad(lambda p: router.apply({**variables, "params": p}, x, prev).weight_bs.sum())(
        variables["params"]
    )
    assert np.abs(np.asarray(g["router_mlp"]["out_proj"]["kernel"])).sum() > 0


def test_eda_adds_scaled_previous_state_before_the_norm():
    prev = jax.random.normal(jax.random.key(3), (2, 16, CFG.router_hidden_size))
    zero, _variables = _run()
    with_prev, _ = _run(prev=prev)
    np.testing.assert_allclose(
        np.asarray(with_prev.next_state_bsr - zero.next_state_bsr), np.asarray(prev), rtol=1e-5, atol=1e-5
    )  # scale init 1
