"""The Pallas paths selected by config (attention_impl / moe_impl / ns_impl = "pallas", run in
interpret mode on CPU) give the same loss, gradients and train step as the XLA paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import base_config
from zaya_jax.kernels import NS_AUTO_PALLAS, check_backend, ns_choice, use_pallas
from zaya_jax.model import BALANCING, ZayaConfig, ZayaForCausalLM, init_variables
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.parallel import make_mesh
from zaya_jax.parallel.sharding import batch_sharding
from zaya_jax.training.train_state import create_train_state, loss_and_counts, make_train_step

XLA = ZayaConfig.tiny(
    hidden_size=64,
    num_hidden_layers=2,
    num_experts=4,
    moe_intermediate_size=32,
    vocab_size=64,
    layer_types=("hybrid_sliding", "hybrid"),
    sliding_window=6,
)
PALLAS = XLA.replace(attention_impl="pallas", moe_impl="pallas")


def _batch(b=2, s=19):
    r = np.random.default_rng(0)
    ids = r.integers(3, XLA.vocab_size, size=(b, s + 1))
    return {
        "input_ids": jnp.asarray(ids[:, :-1], jnp.int32),
        "targets": jnp.asarray(ids[:, 1:], jnp.int32),
        "loss_mask": jnp.ones((b, s), jnp.float32),
    }


def test_impl_resolution_and_backend_check():
    assert use_pallas("pallas", "cpu") and not use_pallas("xla", "cuda") and not use_pallas("ragged_dot", "rocm")
    assert use_pallas("auto", "cuda") and use_pallas("auto", "rocm") and not use_pallas("auto", "cpu")
    # Newton-Schulz's auto follows its measurements: XLA on CUDA, the kernel on ROCm
    assert use_pallas("auto", "rocm", NS_AUTO_PALLAS) and not use_pallas("auto", "cuda", NS_AUTO_PALLAS)
    assert use_pallas("pallas", "cuda", NS_AUTO_PALLAS)
    # ... and XLA's iteration goes slice by slice on CPU only (kernels.NS_PER_SLICE)
    auto = [ns_choice("auto", p) for p in ("cpu", "cuda", "rocm", "tpu")]
    assert auto == ["xla per slice", "xla", "pallas", "xla"]
    assert ns_choice("pallas", "cpu") == "pallas" and ns_choice("xla", "rocm") == "xla"
    check_backend("cpu", "pallas", "auto", "xla")  # CPU runs the kernels interpreted: allowed
    check_backend("rocm", "pallas")
    check_backend("tpu", "auto", "xla")  # auto falls back to XLA there
    with pytest.raises(ValueError, match="platform 'tpu' lacks"):
        check_backend("tpu", "pallas")
    with pytest.raises(ValueError, match="attention_impl"):
        ZayaConfig.tiny(attention_impl="triton")


@pytest.mark.slow
def test_pallas_loss_and_gradients_equal_xla():
    variables = jax.jit(init_variables, static_argnums=0)(XLA, jax.random.key(0))  # one program
    batch = _batch()

    def value_and_grad(cfg):
        model = ZayaForCausalLM(cfg)

        def f(p):
            ls, aux = loss_and_counts(model, p, variables[BALANCING], batch)
            return ls / aux[0]

        return jax.jit(jax.value_and_grad(f))(variables["params"])

    ref_loss, ref = value_and_grad(XLA)
    loss, got = value_and_grad(PALLAS)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got)):
        scale = max(float(jnp.abs(a).max()), 1e-6)
        assert float(jnp.abs(a - b).max()) / scale < 1e-4, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_full_train_step_with_every_pallas_path_equals_xla():
    def one_step(cfg, ns_impl):
        c = base_config()
        c.optim.warmup_steps = 1
        c.optim.muon.ns_impl = ns_impl
        tx = make_optimizer(c, total_steps=4)
        bc = bal.BalancingConfig()
        state = create_train_state(cfg, tx, bc, jax.random.key(0))
        new, m = jax.jit(make_train_step(cfg, tx, bc, lr_schedule(c, 4)))(state, _batch())
        return new, m

    ref, mr = one_step(XLA, "xla")
    got, mg = one_step(PALLAS, "pallas")
    assert abs(float(mr["loss"]) - float(mg["loss"])) < 1e-5
    assert abs(float(mr["grad_norm"]) - float(mg["grad_norm"])) < 1e-4 * float(mr["grad_norm"])
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref.params)[0], jax.tree.leaves(got.params)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=2e-5, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.slow
def test_pallas_paths_on_an_expert_parallel_mesh():
    mesh = make_mesh(2, 1, 4)
    cfg = PALLAS.replace(num_experts=8)
    variables = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(2))  # one program
    ids = _batch(b=8)["input_ids"]
    ref = ZayaForCausalLM(cfg.replace(attention_impl="xla", moe_impl="ragged_dot")).apply(variables, ids)
    got = ZayaForCausalLM(cfg, mesh).apply(variables, jax.device_put(ids, batch_sharding(mesh)))
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), atol=1e-5)
