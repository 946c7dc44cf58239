"""model.scan_layers: the unrolled blocks are the scanned blocks (same parameter layout, values and
gradients), and "auto" picks the unrolled path only on CPU for shallow models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model import ZayaConfig
from zaya_jax.model.transformer import ZayaForCausalLM, init_variables, resolve_scan_layers

CFG = ZayaConfig.tiny(num_hidden_layers=2, num_experts=4, initializer_range=0.2)


def _loss_and_grads(cfg, variables, ids):
    def loss(params):
        out = ZayaForCausalLM(cfg).apply({**variables, "params": params}, ids)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
        return nll, (out.logits, out.expert_counts, out.router_probs)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])


@pytest.mark.slow  # two compiled forward+backward programs (~30 s on a quiet 2-core CPU)
def test_unrolled_blocks_equal_scanned_blocks():
    scan, unroll = (dataclasses.replace(CFG, scan_layers=v) for v in ("scan", "unroll"))
    key = jax.random.PRNGKey(0)
    v_scan, v_unroll = (jax.jit(lambda k, c=c: init_variables(c, k))(key) for c in (scan, unroll))
    # Same [l, ...] stacks under the same names, same initial values (same RNG splits).
    assert jax.tree.structure(v_scan) == jax.tree.structure(v_unroll)
    for a, b in zip(jax.tree.leaves(v_scan), jax.tree.leaves(v_unroll)):
        np.testing.assert_array_equal(a, b)
    assert all(x.shape[0] == 2 for x in jax.tree.leaves(v_unroll["params"]["layers"]))

    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, CFG.vocab_size)
    (l_s, aux_s), g_s = _loss_and_grads(scan, v_scan, ids)
    (l_u, aux_u), g_u = _loss_and_grads(unroll, v_scan, ids)
    np.testing.assert_allclose(l_u, l_s, rtol=1e-6)
    for a, b in zip(aux_u, aux_s):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    paths = jax.tree_util.tree_flatten_with_path(g_s)[0]
    for (path, gs), gu in zip(paths, jax.tree.leaves(g_u)):
        scale = float(jnp.max(jnp.abs(gs))) or 1.0
        err = float(jnp.max(jnp.abs(gu - gs))) / scale
        assert err < 1e-5, (jax.tree_util.keystr(path), err)


def test_auto_unrolls_shallow_models_on_cpu_only():
    assert resolve_scan_layers("auto", 4, "cpu") == "unroll"
    assert resolve_scan_layers("auto", 8, "cpu") == "unroll"
    assert resolve_scan_layers("auto", 40, "cpu") == "scan"
    assert resolve_scan_layers("auto", 4, "rocm") == resolve_scan_layers("auto", 4, "cuda") == "scan"
    assert resolve_scan_layers("scan", 4, "cpu") == "scan"
    assert resolve_scan_layers("unroll", 40, "cuda") == "unroll"
