"""ZeRO-1's fp32 master weights in the optimizer's shard (zaya_jax/parallel/zero1.py `shards_master`)
on 8 simulated CPU devices: the state's layout, the bf16 compute weights computing what the forward's
cast computed, every mesh equal to one device, train.grad_reduce_dtype through the trainer, and a
kill -9 resume bit for bit with the master sharded over 8 data ranks."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import final_params, kill_9_after_step
from support.train_runs import run_train, train_cmd, train_losses
from support.xla_env import FAST_COMPILE
from support.zero1_steps import DATA4_EXPERT2, DATA4_FSDP2, MESH_CFG, MESH_STEPS, Step, run_steps, step_config

from zaya_jax import config as config_lib
from zaya_jax.analysis import hlo, report
from zaya_jax.model import ZayaConfig
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.parallel.overlap import BLOCK_GATHER_SCOPE
from zaya_jax.parallel.sharding import grad_specs, param_shardings
from zaya_jax.parallel.zero1 import compute_dtypes, shards_master
from zaya_jax.reshard import reshard
from zaya_jax.training.train_state import abstract_batch, train_program

BF16 = ZayaConfig.tiny(num_hidden_layers=2, vocab_size=128, moe_intermediate_size=32, dtype="bfloat16")
CAST = {
    "self_attn/q_proj/kernel",
    "self_attn/o_proj/kernel",
    "experts/gate_up_proj",
    "conv_qk_depthwise/kernel",
}


def _program(mesh: dict[str, int], cfg: ZayaConfig = BF16, zero1: bool = True, grad_accum: int = 1, **train):
    """(config, validated model config, train_program) of MESH_STEPS steps of `cfg` on `mesh`:
    mesh.zero1 `zero1`, `grad_accum` microbatches of 8 sequences, `train` overriding the rest."""
    c = step_config(mesh, grad_accum, cfg=cfg)
    c.train.steps, c.mesh.zero1 = MESH_STEPS, zero1
    for key, value in train.items():
        c.train[key] = value
    devices = jax.devices()[: math.prod(mesh.values())]
    model = config_lib.validate(c, "cpu")
    return c, model, train_program(c, model, mesh_from_config(c, devices=devices))


def test_master_is_sharded_with_the_moments_and_compute_weights_are_bf16():
    """bf16 model on data=8: every fp32 param lives in its ZeRO-1 shard (the optimizer state's
    layout), the compute weights of the matrices the model casts are bf16, the rest fp32; an fp32
    model keeps its params replicated over data (the compute weights are the params)."""
    _, cfg, program = _program({"data": 8})
    params = program.abstract_state().params
    assert shards_master(cfg.params_dtype, cfg.compute_dtype)
    specs = grad_specs(params, program.mesh)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    split = 0
    for (path, x), spec in zip(flat, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.P))):
        assert x.dtype == jnp.float32 and x.sharding.spec == spec, jax.tree_util.keystr(path)
        split += "data" in jax.tree.leaves(tuple(spec))
    assert split >= len(flat) // 2  # most leaves are split over the 8 data ranks
    moments = program.shardings.opt_state[1].inner_states["muon"].inner_state[0].mu
    q = lambda t: t["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q(moments).spec == q(params).sharding.spec
    dtypes = compute_dtypes(params, cfg.compute_dtype)
    for path, dt in jax.tree_util.tree_flatten_with_path(dtypes)[0]:
        name = "/".join(k.key for k in path)
        want = jnp.bfloat16 if any(name.endswith(s) for s in CAST) else None
        assert want is None or dt == want, name
    assert dtypes["embed_tokens"]["embedding"] == jnp.float32  # looked up in fp32
    assert dtypes["layers"]["mlp"]["gate"]["down_proj"]["kernel"] == jnp.float32  # the fp32 router

    _, fp32, fp32_program = _program({"data": 8}, cfg=MESH_CFG)
    assert not shards_master(fp32.params_dtype, fp32.compute_dtype)
    replicated = param_shardings(fp32_program.abstract_state().params, fp32_program.mesh)
    assert jax.tree.leaves(fp32_program.shardings.params) == jax.tree.leaves(replicated)


def _bf16_run(mesh: tuple[tuple[str, int], ...], zero1: bool = True, grad_accum: int = 1, **train):
    """(compiled HLO text, mesh, losses, grad norms, final params on the host) of MESH_STEPS steps of
    the bf16 model (`_program`); nothing kept (the process' map limit: docs/xla-cpu-map-count.md)."""
    c, cfg, program = _program(dict(mesh), zero1=zero1, grad_accum=grad_accum, **train)
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, program.mesh)
    compiled = program.train_step.lower(program.abstract_state(), batch).compile(FAST_COMPILE)
    losses, norms, state = run_steps(Step(compiled, program, c, cfg, BF16), MESH_STEPS)
    return compiled.as_text(), program.mesh, losses, norms, jax.device_get(state.params)


def _run(
    mesh: tuple[tuple[str, int], ...],
    zero1: bool = True,
    grad_reduce_dtype: str = "float32",
    grad_accum: int = 1,
):
    """(losses, grad norms, final params on the host) of `_bf16_run` with the config's overlaps
    ("auto": off on CPU); once per its arguments in the module, however the call spells them."""
    return _run_once(mesh, zero1, grad_reduce_dtype, grad_accum)


@functools.cache
def _run_once(mesh: tuple[tuple[str, int], ...], zero1: bool, grad_reduce_dtype: str, grad_accum: int):
    """`_run`, cached on all its arguments, positionally."""
    return _bf16_run(mesh, zero1, grad_accum, grad_reduce_dtype=grad_reduce_dtype)[2:]


@pytest.mark.slow
def test_bf16_compute_weights_compute_what_the_forward_cast_computed():
    """One device, bf16 model: the step with the fp32 master and bf16 compute weights (mesh.zero1
    on) equals, bit for bit, the step casting the fp32 params in every forward (zero1 off): the
    weights the model reads and the fp32 gradients it accumulates are the same values."""
    one = (("data", 1),)
    (a_losses, a_norms, a), (b_losses, b_norms, b) = _run(one, True), _run(one, False)
    assert a_losses == b_losses and a_norms == b_norms
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# bf16 compute: the matmuls of a mesh sum in another order than one device's, and bf16 rounding
# amplifies that. Measured over 3 steps against one device: data=8, data=4 x expert=2 and
# data=2 x fsdp=2 x expert=2 differ by up to 1.2e-4 in the loss, 1.1e-3 in the grad norm and
# 2.7e-3 in a parameter (an update of lr 1e-3 times Muon's scale is ~2e-3); the fp32 params
# replicated and cast in every forward gave the same gaps at data=8, to the digit. fp32 meshes
# stay within 1e-5 (tests/test_zero1.py).
BF16_MESHES = [(("data", 8),), (("data", 4), ("expert", 2)), (("data", 2), ("fsdp", 2), ("expert", 2))]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", BF16_MESHES, ids=lambda m: "_".join(f"{a}{n}" for a, n in m))
def test_bf16_every_mesh_equals_one_device(mesh):
    want_losses, want_norms, want = _run((("data", 1),))
    losses, norms, got = _run(mesh)
    assert want_losses[-1] != want_losses[0]
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=2.5e-4)
    np.testing.assert_allclose(norms, want_norms, rtol=0, atol=2.5e-3)
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=4e-3)


@pytest.mark.slow
def test_bf16_gradient_reduction_stays_near_fp32():
    """train.grad_reduce_dtype=bfloat16 on data=8: the gradients cross the data axis in bf16 and
    the step stays within the bf16-compute tolerance of the fp32 reduction."""
    data8 = (("data", 8),)
    (a_losses, a_norms, a), (b_losses, b_norms, b) = _run(data8), _run(data8, True, "bfloat16")
    assert a_norms != b_norms  # the reduction's dtype changed something
    np.testing.assert_allclose(b_losses, a_losses, rtol=0, atol=2.5e-4)
    np.testing.assert_allclose(b_norms, a_norms, rtol=0, atol=2.5e-3)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=4e-3)


# The per-rank meshes with the overlaps they run (train.overlap_param_gather "on", and
# train.overlap_grad_reduce), whether the test also compiles the step that gathers before the
# loop to compare with, and grad_accum: the weights gathered in the first microbatch alone, with
# fsdp (its split leaves gathered before the loop: the bytes must not grow), with the gradients
# reduced in the last microbatch and expert parallelism, with a context axis, and both in the one
# microbatch of a step without accumulation (overlap.BlockGatherReduce).
GATHER_MESHES = [
    ((("data", 8),), "off", True, 2),
    ((("data", 4), ("fsdp", 2)), "on", True, 2),
    ((("data", 4), ("expert", 2)), "on", False, 2),
    ((("data", 4), ("context", 2)), "off", False, 2),
    ((("data", 8),), "on", True, 1),
]


def _gather_run(mesh: tuple[tuple[str, int], ...], grad_accum: int, gather: str, reduce: str = "off"):
    """`_bf16_run` at `grad_accum` with the two overlaps as given."""
    return _bf16_run(mesh, grad_accum=grad_accum, overlap_param_gather=gather, overlap_grad_reduce=reduce)


def _one_device(grad_accum: int):
    """(losses, grad norms, final params) of `_gather_run` on one device: `_run`'s, computed once
    for the file. One device runs no per-rank loop, so both overlaps are off whatever their setting
    (zaya_jax/parallel/overlap.py) and the config's "auto" builds the same step as "off"."""
    return _run((("data", 1),), grad_accum=grad_accum)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, reduce, against_before, grad_accum", GATHER_MESHES, ids=str)
def test_block_weights_gathered_in_forward_equal_one_device(mesh, reduce, against_before, grad_accum):
    """train.overlap_param_gather=on: the first microbatch all-gathers each block's bf16 weights in
    its layer scan's forward (collectives named by overlap.BLOCK_GATHER_SCOPE) and the others compute
    with what it gathered: MESH_STEPS steps equal one device's to the bf16 tolerances of
    BF16_MESHES; where `against_before`, the step's data-parallel bytes are those of the gather
    before the loop and its steps equal that step's to 1e-5 in the losses, 1e-4 in the norms and
    every fp32 param."""
    hlo_on, step_mesh, *on = _gather_run(mesh, grad_accum, "on", reduce)
    assert any(BLOCK_GATHER_SCOPE in c.op_name for c in hlo.collectives(hlo_on))
    (losses, norms, got) = on
    if against_before:
        hlo_off, _, want_losses, want_norms, want = _gather_run(mesh, grad_accum, "off", reduce)
        assert report.data_parallel_bytes(hlo_on, step_mesh) == report.data_parallel_bytes(hlo_off, step_mesh)
        # The first microbatch is compiled on its own, so XLA may round its bf16 ops otherwise:
        # measured on data=8 the losses were equal and the norms and params 3.3e-5 apart at most.
        np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-4, atol=1e-4)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-4)
    one_losses, one_norms, one = _one_device(grad_accum)
    np.testing.assert_allclose(losses, one_losses, rtol=0, atol=2.5e-4)
    np.testing.assert_allclose(norms, one_norms, rtol=0, atol=2.5e-3)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=4e-3)


BF16_ARGS = [
    "--config.model.num_hidden_layers=1",  # a resume bit for bit does not depend on the depth
    "--config.model.dtype=bfloat16",
    "--config.train.grad_reduce_dtype=bfloat16",
    # the first microbatch gathers the block weights in its forward (off by default on CPU)
    "--config.train.batch_size=16",
    "--config.train.grad_accum=2",
    "--config.train.overlap_param_gather=on",
    "--config.train.steps=8",
    "--config.checkpoint.every_steps=2",
    "--config.eval.every_steps=0",
]


@pytest.mark.slow
def test_bf16_master_trains_and_resumes_bit_exact_after_kill_9(tmp_path):
    """`python -m zaya_jax.train` with a bf16 model and bf16 gradient reduction on 8 devices (data=8:
    the fp32 master split 8 ways; two microbatches, the first gathering the block weights in its
    forward): a run killed with SIGKILL after its first checkpoint and restarted
    logs the uninterrupted run's losses and ends with its fp32 master, bit for bit; reshard moves
    that checkpoint onto another mesh unchanged."""
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    cmd = train_cmd(killed, *BF16_ARGS, "--config.fault.spike_zscore=0")
    resumed_from = kill_9_after_step(cmd, killed, 3, devices=8)
    assert resumed_from is not None and resumed_from < 8
    # the restart, then the uninterrupted run (each compiles its step: programs of 8 devices with a
    # collective in a loop are not cached)
    run_train(killed, *BF16_ARGS, devices=8)
    run_train(ref, *BF16_ARGS, devices=8)
    want, got = train_losses(ref), train_losses(killed)
    assert sorted(got) == list(range(1, 9)) and all(np.isfinite(list(want.values())))
    for s in range(resumed_from + 1, 9):
        assert got[s] == want[s], (s, got[s], want[s])
    (sa, a), (sb, b) = final_params(ref), final_params(killed)
    assert sa == sb == 8
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"]), strict=True):
        assert x.dtype == np.float32  # the checkpoint holds the fp32 master
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # resharded onto data=2 x expert=4 (the master split 2 ways, experts 4): the same fp32 state as
    # the killed run's step-8 checkpoint (`b`)
    resharded = tmp_path / "resharded"
    reshard(str(killed / "checkpoints" / "8"), str(resharded), {"data": 2, "expert": 4})
    (_, d) = final_params(resharded)
    for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(d), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "shape, stored, mesh",
    [
        ((8, 4, 32, 64), jax.P("data", "expert", None, None), DATA4_EXPERT2),  # its own block
        ((12, 64, 32), jax.P("data", None, None), DATA4_EXPERT2),  # padded
        ((2, 64, 32), jax.P(None, None, "data"), DATA4_EXPERT2),  # moved whole and back
        ((4, 64, 32), jax.P(None, "fsdp", "data"), DATA4_FSDP2),
        ((4, 64, 64), jax.P(None, None, ("fsdp", "data")), (2, 2, 2, 1)),
    ],
    ids=["aligned", "padded", "moved", "fsdp", "fsdp_data_one_dim"],
)
def test_owned_newton_schulz_into_the_master_shard(shape, stored, mesh):
    """With the fp32 master in the ZeRO-1 shard the owners' results stay in that shard (`spec` =
    `stored`: nothing all-gathered over the data axis) and equal Newton-Schulz of the whole stack."""
    from zaya_jax.kernels.newton_schulz import orthogonalize
    from zaya_jax.parallel import make_mesh
    from zaya_jax.parallel.zero1 import owned_orthogonalize

    mesh = make_mesh(*mesh)
    x = jax.random.normal(jax.random.key(3), shape)
    placed = jax.device_put(x, jax.NamedSharding(mesh, stored))
    fn = jax.jit(lambda y: owned_orthogonalize(orthogonalize, y, stored, stored, mesh))
    got = fn(placed)
    assert got.sharding.is_equivalent_to(jax.NamedSharding(mesh, stored), x.ndim)
    names, devices = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    for c in hlo.collectives(fn.lower(placed).compile().as_text()):
        assert c.op != "all-gather" or "data" not in hlo.group_axes(c.groups, names, devices), c
    np.testing.assert_allclose(np.asarray(got), np.asarray(orthogonalize(x)), rtol=1e-6, atol=2e-6)
