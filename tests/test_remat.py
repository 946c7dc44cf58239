"""model.remat: every policy gives the loss and gradients of no remat, "matmuls" keeps our kernels'
outputs (flash attention, the grouped expert matmuls) that dots_saveable recomputes, and the dry
run's fit search reports the policy with the least recompute that fits."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from support.xla_env import XLA_DEFAULT_COMPILE

from zaya_jax import sizing
from zaya_jax.analysis import compiled as compiled_lib
from zaya_jax.analysis import fit
from zaya_jax.config import base_config, set_model
from zaya_jax.kernels.flash_attention import FLASH_LSE, FLASH_OUT
from zaya_jax.kernels.grouped_matmul import GMM_OUT
from zaya_jax.model import ZayaConfig
from zaya_jax.model.config import REMAT_POLICIES
from zaya_jax.model.transformer import REMAT_POLICIES as POLICIES
from zaya_jax.model.transformer import ZayaBlock, ZayaForCausalLM, init_variables
from zaya_jax.runtime import gpu_target

CFG = ZayaConfig.tiny(num_hidden_layers=2, num_experts=4, initializer_range=0.2, scan_layers="scan")
# Our kernels, interpreted on CPU: the paths whose outputs "matmuls" keeps by name.
KERNELS = dict(attention_impl="pallas", moe_impl="pallas")


def _loss_and_grads(cfg, variables, ids):
    def loss(params):
        out = ZayaForCausalLM(cfg).apply({**variables, "params": params}, ids)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    # XLA's default code generation: at LLVM O0 the policies round up to 2e-6 apart.
    return jax.jit(jax.value_and_grad(loss), compiler_options=XLA_DEFAULT_COMPILE)(variables["params"])


@pytest.mark.slow  # the interpreted kernels: several compiled forward+backward programs
@pytest.mark.parametrize("impls", [{}, KERNELS], ids=["xla", "kernels"])
def test_every_remat_policy_gives_the_loss_and_gradients_of_none(impls):
    """fp32 tiny: the loss and every parameter gradient under each policy equal remat "none"'s
    within 1e-6 (relative to the gradient's largest entry)."""
    base = CFG.replace(**impls)
    variables = jax.jit(lambda k: init_variables(base, k))(jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, CFG.vocab_size)
    ref_loss, ref_grads = _loss_and_grads(base, variables, ids)
    for remat in [r for r in REMAT_POLICIES if r != "none"]:
        loss, grads = _loss_and_grads(base.replace(remat=remat), variables, ids)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=remat)
        paths = jax.tree_util.tree_flatten_with_path(ref_grads)[0]
        for (path, g_ref), g in zip(paths, jax.tree.leaves(grads)):
            scale = float(jnp.max(jnp.abs(g_ref))) or 1.0
            err = float(jnp.max(jnp.abs(g - g_ref))) / scale
            assert err < 1e-6, (remat, jax.tree_util.keystr(path), err)


def _saved_names(remat: str) -> set[str]:
    """The names among the residuals one block, remat'd with the policy, keeps for its backward
    (the kernels' path)."""
    cfg = CFG.replace(**KERNELS)
    block = ZayaBlock(cfg)
    carry = (jnp.ones((1, 16, cfg.hidden_size)), jnp.zeros((1, 16, cfg.router_hidden_size)))
    args = (carry, (jnp.float32(1e4), jnp.int32(0), None), jnp.arange(16)[None], None, None)
    variables = block.init(jax.random.PRNGKey(0), *args)
    f = lambda params: block.apply({**variables, "params": params}, *args)[0][0].sum()
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        print_saved_residuals(jax.checkpoint(f, policy=POLICIES[remat]), variables["params"])
    return set(re.findall(r"named '([^']+)'", listing.getvalue()))


@pytest.mark.slow  # the interpreted kernels' forward (~90 s on a loaded 2-core CPU)
def test_matmuls_keeps_the_kernel_outputs_dots_saveable_recomputes():
    """Under "matmuls" the flash-attention output and log-sum-exp and the grouped matmuls' outputs
    are residuals of the backward (not recomputed); dots_saveable and full keep none of them."""
    kernels = {FLASH_OUT, FLASH_LSE, GMM_OUT}
    assert kernels <= _saved_names("matmuls")
    assert not kernels & _saved_names("dots_saveable")
    assert not kernels & _saved_names("full")


HLO = "ENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n"  # a module without model work


class _Stats:
    def __init__(self, total):
        self.argument_size_in_bytes = self.output_size_in_bytes = self.alias_size_in_bytes = 0
        self.temp_size_in_bytes = total


def test_fit_search_reports_the_least_recompute_that_fits(monkeypatch):
    """--dry_run_fit compiles the policies from least recompute to most at the config's microbatch
    and stops at the first whose compiled step fits; the microbatch search then runs with it. Full
    remat goes first: when it does not fit, nothing else is compiled. The config's own step is
    reused, not compiled again. (Memory stubbed per policy and microbatch; the real compiles:
    test_gpu_compile.)"""
    mib = {"none": 40, "matmuls": 30, "dots_saveable": 20, "full": 8}
    seen = []

    def fake_compile(trial, devices):
        micro = trial.train.batch_size // 8 // trial.train.grad_accum
        seen.append((trial.model.remat, micro))
        stats = _Stats(micro * mib[trial.model.remat] * 2**20)
        methods = {"memory_analysis": lambda self: stats, "as_text": lambda self: HLO}
        compiled = type("C", (), methods)()
        return dataclasses.replace(own, compiled=compiled)

    c = base_config()
    set_model(c, CFG.replace(remat="full"))
    c.train.batch_size, c.train.grad_accum = 8 * 4, 2  # 2 sequences per device per microbatch
    own = compiled_lib.CompiledStep(None, None, None, 0.0, 0.0)
    own = fake_compile(c, None)
    seen.clear()
    monkeypatch.setattr(fit, "compile_step", fake_compile)
    gpu = gpu_target.GpuTarget("small", "cuda", "", 50 * 2**20, "sm_90")
    out = fit.fit_report(c, list(range(8)), gpu, done=own)
    # none (80 MiB) and matmuls (60) do not fit at 2 sequences, dots_saveable (40) does; the
    # microbatch search with it: 2 is reused, 4 (80 MiB) does not fit.
    assert seen == [("none", 2), ("matmuls", 2), ("dots_saveable", 2), ("dots_saveable", 4)], seen
    assert out[0] == (
        "Least recompute that fits at 2 sequences per device (train.grad_accum=2): "
        "--config.model.remat=dots_saveable"
    )
    rows = {line.split()[0]: line.split()[-1] for line in out[2:5]}
    assert rows == {"none": "fit", "matmuls": "fit", "dots_saveable": "fits"}
    assert "Largest microbatch that fits: 2 sequences per device (train.grad_accum=2)" in out
    seen.clear()
    gpu = gpu_target.GpuTarget("tiny", "cuda", "", 10 * 2**20, "sm_90")
    out = fit.fit_report(c, list(range(8)), gpu, done=own)
    # full (the config's own, reused) needs the least memory and does not fit at 2: no other policy
    # is compiled, and full is the one the microbatch search takes
    assert [r for r, m in seen if m == 2] == []
    assert out[0].endswith(": none") and "Largest microbatch that fits: 1 sequences per device" in " ".join(out)
    assert "  (full needs the least memory: as it does not fit, the rest were not compiled)" in out
    seen.clear()
    c.model.remat = "none"  # its own step (40 MiB a sequence) does not fit: full is compiled next
    own = fake_compile(c, None)
    seen.clear()
    out = fit.fit_report(c, list(range(8)), gpu, done=own)
    assert [r for r, m in seen if m == 2] == ["full"] and out[0].endswith(": none")
    assert [line.split()[0] for line in out[2:4]] == ["none", "full"]
    assert sizing.REMAT_CHOICES == ("none", "matmuls", "dots_saveable", "full")
