"""ZeRO-1 data parallelism (zaya_jax/parallel/zero1.py) on 8 simulated CPU devices: the data-parallel
traffic of the compiled train step is the formula's whatever train.grad_accum (nothing per
microbatch), train.grad_reduce=microbatch (ZeRO-2) trains as step and one device do with its own
formula's bytes and less memory, distributed Muon gives the same updates as Muon on one device
with each matrix orthogonalised once, and the train step on every mesh of two or three axes equals
one device over several steps."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.xla_env import FAST_COMPILE
from support.zero1_steps import (
    CFG,
    DATA4_EXPERT2,
    DATA4_FSDP2,
    MESH_CFG,
    MESH_STEPS,
    Step,
    run_steps,
    step_config,
    step_program,
)

from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.analysis import report
from zaya_jax.config import base_config
from zaya_jax.model import ZayaConfig, init_variables
from zaya_jax.optim.chain import make_optimizer
from zaya_jax.parallel import make_mesh
from zaya_jax.parallel.mesh import MESH_AXES, mesh_from_config
from zaya_jax.parallel.overlap import BLOCK_REDUCE_SCOPE
from zaya_jax.parallel.sharding import opt_state_shardings, param_shardings
from zaya_jax.parallel.zero1 import owner_plan, step_bytes
from zaya_jax.training.train_state import abstract_batch, train_program


@functools.cache
def _compiled(
    mesh: tuple[tuple[str, int], ...],
    grad_accum: int,
    grad_reduce: str = "step",
    cfg: ZayaConfig = CFG,
    steps: int = 0,
) -> Step:
    """The train step of `step_program` compiled from abstract state and batch, not run; once per
    (mesh, grad_accum, grad_reduce, cfg, train.steps) in the module."""
    model = cfg
    c, cfg, program = step_program(mesh, grad_accum, grad_reduce, model, steps)
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, program.mesh)
    compiled = program.train_step.lower(program.abstract_state(), batch).compile(FAST_COMPILE)
    return Step(compiled, program, c, cfg, model)


def _train(mesh: tuple[tuple[str, int], ...], grad_accum: int, grad_reduce: str = "step", steps: int = 2):
    """(losses, final params) of `steps` steps of the compiled train step (`_compiled`)."""
    losses, _, state = run_steps(_compiled(mesh, grad_accum, grad_reduce), steps)
    return losses, jax.device_get(state.params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh", [(("data", 8),), (("data", 4), ("expert", 2)), (("data", 4), ("fsdp", 2))], ids=str
)
def test_data_parallel_bytes_are_the_formula_whatever_grad_accum(mesh):
    """The collectives spanning the data axis run once per optimizer step (none in the model, i.e.
    per microbatch): the same bytes at grad_accum 1 and 4, within 1.25x of the formula's
    4 P (1 + 1/n). The model's own collectives (expert all-to-all, fsdp's gathers, GSPMD's
    reductions over the expert / fsdp axes) are not data-parallel traffic of the formula."""
    per_step = {}
    for grad_accum in (1, 4):
        step = _compiled(mesh, grad_accum)
        hlo = step.compiled.as_text()
        once, in_model = report.data_parallel_bytes(hlo, step.mesh)
        assert in_model == 0, report.axis_rows(hlo, step.mesh)
        per_step[grad_accum] = once
    formula = step_bytes(step.state.params, step.mesh)
    assert per_step[1] == per_step[4]
    assert formula <= per_step[1] <= 1.25 * formula, (per_step, formula)


GRAD_ACCUM = 4  # the equality and the bytes / memory tests share the data=8 programs


@pytest.mark.slow
def test_grad_reduce_microbatch_equals_step_and_one_device():
    """train.grad_reduce=microbatch (each microbatch's gradients reduce-scattered inside the
    per-rank loop, only the rank's shard summed) trains as the default step mode and as one device
    do: data=8, grad_accum 4, fp32, two optimizer steps (losses, then every parameter)."""
    data8 = (("data", 8),)
    one_losses, one = _train((("data", 1),), GRAD_ACCUM)
    step_losses, step = _train(data8, GRAD_ACCUM, "step")
    micro_losses, micro = _train(data8, GRAD_ACCUM, "microbatch")
    assert step_losses[1] != step_losses[0]  # the first update moved the params
    np.testing.assert_allclose(micro_losses, step_losses, atol=1e-5)
    np.testing.assert_allclose(micro_losses, one_losses, atol=1e-5)
    leaves = jax.tree_util.tree_flatten_with_path(one)[0]
    for (path, a), b, c in zip(leaves, jax.tree.leaves(step), jax.tree.leaves(micro), strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(c, b, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(c, a, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_grad_reduce_microbatch_bytes_are_its_formula_and_memory_falls():
    """microbatch mode's data-parallel bytes are its formula's 4 P (1 + A/n) (the reduce-scatter in
    every microbatch, nothing inside the model), within 1.25x; its temporaries are below step
    mode's at grad_accum 4 (one whole fp32 gradient buffer instead of two), by about what sizing
    says the sum's shard saves."""
    data8 = (("data", 8),)
    step, micro = _compiled(data8, GRAD_ACCUM, "step"), _compiled(data8, GRAD_ACCUM, "microbatch")
    once, in_model = report.data_parallel_bytes(micro.compiled.as_text(), micro.mesh)
    assert in_model == 0
    params = micro.state.params
    formula = step_bytes(params, micro.mesh, grad_accum=GRAD_ACCUM, grad_reduce="microbatch")
    assert formula > step_bytes(params, micro.mesh, grad_accum=GRAD_ACCUM)  # 4 reduce-scatters, not 1
    assert formula <= once <= 1.25 * formula, (once, formula)
    temp = {s.c.train.grad_reduce: s.compiled.memory_analysis().temp_size_in_bytes for s in (step, micro)}
    shape = {a: int(s) for a, s in micro.mesh.shape.items()}
    est = {
        mode: sizing.config_memory_per_device(step_config(dict(data8), GRAD_ACCUM, mode), CFG, shape, "cpu")
        for mode in ("step", "microbatch")
    }
    assert est["microbatch"].sharded_sum and est["step"].grad_buffers == 2
    saved = est["step"].grads - est["microbatch"].grads  # 4 P - 4 P / n
    assert temp["microbatch"] < temp["step"]
    assert 0.75 * saved <= temp["step"] - temp["microbatch"] <= 1.25 * saved, (temp, saved)


# Every mesh of the 8 devices with two or three axes larger than 1 (a pair both ways round).
EVERY_MESH = [
    *(((a, 4), (b, 2)) for a, b in itertools.permutations(MESH_AXES, 2)),
    *(tuple((a, 2) for a in axes) for axes in itertools.combinations(MESH_AXES, 3)),
]


def _mesh_run(mesh: tuple[tuple[str, int], ...], grad_accum: int = 1):
    """(losses, grad norms, final state on the host) of MESH_STEPS train steps of MESH_CFG as the
    trainer builds them (train_program: ZeRO-1, distributed Muon, the balancing biases) on `mesh`;
    once per (mesh, grad_accum) in the module, grad_accum given or not."""
    return _mesh_run_once(mesh, grad_accum)


@functools.cache
def _mesh_run_once(mesh: tuple[tuple[str, int], ...], grad_accum: int):
    """`_mesh_run`, cached on both arguments."""
    step = _compiled(mesh, grad_accum, cfg=MESH_CFG, steps=MESH_STEPS)
    losses, norms, state = run_steps(step, MESH_STEPS)
    return losses, norms, jax.device_get(state)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", EVERY_MESH, ids=lambda m: "_".join(f"{a}{n}" for a, n in m))
def test_every_mesh_equals_one_device(mesh):
    """The train step on `mesh` equals one device over MESH_STEPS steps, fp32, to 1e-5: every step's
    loss and gradient norm, then every parameter, optimizer-state leaf and balancing bias."""
    _assert_equals_one_device(_mesh_run((("data", 1),)), _mesh_run(mesh))


# The meshes where the microbatch loop runs per data rank (zero1.loop_per_rank), with the grad_accum
# each runs: 1 (the last microbatch is the only one) and more (the earlier ones summed first).
PER_RANK_MESHES = [
    ((("data", 8),), 3),
    ((("data", 4), ("fsdp", 2)), 2),
    ((("data", 4), ("expert", 2)), 1),
    ((("data", 4), ("context", 2)), 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, grad_accum", PER_RANK_MESHES, ids=str)
def test_block_gradients_reduced_in_backward_equal_one_device(mesh, grad_accum):
    """train.overlap_grad_reduce=on: each block's gradients are reduce-scattered in the layer scan's
    backward of the last microbatch (collectives named by overlap.BLOCK_REDUCE_SCOPE), the step's
    data-parallel bytes are those of the reduction after the loop (counted once per step, nothing
    in the model), and MESH_STEPS steps equal one device's to 1e-5, as every mesh's do. Its
    programs are not kept (`_uncached`): the file's live executables stay under the process' map
    limit (docs/xla-cpu-map-count.md)."""
    step = _uncached(mesh, grad_accum, "on")
    hlo = step.compiled.as_text()
    assert any(BLOCK_REDUCE_SCOPE in c.op_name for c in hlo_lib.collectives(hlo))
    assert not _context_reductions_in_model(hlo, step.mesh)
    # "auto" is "off" on CPU. Its data-parallel bytes are once per step whatever grad_accum
    # (test_data_parallel_bytes_are_the_formula_whatever_grad_accum), so a mesh of EVERY_MESH
    # compares with the every-mesh test's program (grad_accum 1), compiled once in the file.
    cached = grad_accum == 1 or mesh in EVERY_MESH
    after = _compiled(mesh, 1, cfg=MESH_CFG, steps=MESH_STEPS) if cached else _uncached(mesh, grad_accum)
    bytes_after = report.data_parallel_bytes(after.compiled.as_text(), after.mesh)
    assert report.data_parallel_bytes(hlo, step.mesh) == bytes_after
    losses, norms, state = run_steps(step, MESH_STEPS)
    _assert_equals_one_device(_mesh_run((("data", 1),), grad_accum), (losses, norms, jax.device_get(state)))


def _context_reductions_in_model(hlo: str, mesh: jax.sharding.Mesh) -> list[hlo_lib.Collective]:
    """The all-reduces of the model's forward / backward (run per microbatch) that span the context
    axis: none where the per-rank loop sums each context rank's gradients itself and reduces them
    once per step (the keys' and values' gather reduce-scatters in the backward)."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    spans = lambda c: "context" in hlo_lib.group_axes(c.groups, names, shape)
    ops = report.moving(hlo_lib.collectives(hlo))
    return [c for c in ops if c.op == "all-reduce" and report.in_model(c) and spans(c)]


def _uncached(mesh: tuple[tuple[str, int], ...], grad_accum: int, overlap: str = "auto") -> Step:
    """`_compiled` of MESH_CFG for MESH_STEPS steps, built afresh and kept by nobody."""
    c = step_config(dict(mesh), grad_accum, "step", MESH_CFG, MESH_STEPS, overlap)
    cfg = config_lib.validate(c, "cpu")
    devices = jax.devices()[: math.prod(size for _, size in mesh)]
    program = train_program(c, cfg, mesh_from_config(c, devices=devices))
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, program.mesh)
    compiled = program.train_step.lower(program.abstract_state(), batch).compile(FAST_COMPILE)
    return Step(compiled, program, c, cfg, MESH_CFG)


def _assert_equals_one_device(want_run, got_run):
    """Losses and gradient norms, then every parameter, optimizer-state leaf and balancing bias of
    two `_mesh_run`s equal to 1e-5."""
    (want_losses, want_norms, want), (losses, norms, got) = want_run, got_run
    assert want_losses[-1] != want_losses[0]  # the updates moved the params
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5, atol=1e-5)
    parts = {"params": (want.params, got.params), "opt_state": (want.opt_state, got.opt_state)}
    parts["balancing"] = (want.balancing, got.balancing)
    for part, (a_tree, b_tree) in parts.items():
        leaves = jax.tree_util.tree_flatten_with_path(a_tree)[0]
        for (path, a), b in zip(leaves, jax.tree.leaves(b_tree), strict=True):
            name = part + jax.tree_util.keystr(path)
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=name)


def _tree(params, seed):
    """A tree of `params`' shapes and dtypes of standard normal draws (numpy's: no op run by op)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), params)


@pytest.mark.slow
def test_distributed_muon_equals_muon_and_orthogonalises_each_matrix_once():
    """Two optimizer steps on a data=4 x expert=2 mesh (ZeRO-1 state; each matrix orthogonalised
    by the rank that owns it, the results all-gathered) give the updates of the same optimizer
    on one device to 1e-6; the compiled update's Newton-Schulz dots per device are sizing's total
    over the 8 devices."""
    c = base_config()
    c.optim.schedule, c.optim.warmup_steps = "constant", 0
    mesh = make_mesh(data=4, expert=2)
    # initialised in one compiled program (op by op, flax's init took 20 s)
    init, key = jax.jit(lambda k: init_variables(CFG, k)["params"]), jax.random.key(0)
    params = init.lower(key).compile(FAST_COMPILE)(key)
    grads = [_tree(params, 1), _tree(params, 2)]

    def run(tx, params_sharding=None, state_sharding=None):
        update = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=(params_sharding, state_sharding))
        # the initial state laid out as the updates return it: both steps call the one compiled
        # program (a Compiled takes no state in another layout: it raises instead of recompiling)
        state = jax.device_put(tx.init(params), state_sharding)
        compiled = update.lower(grads[0], state, params).compile(FAST_COMPILE)  # both sides alike
        out = []
        for g in grads:
            updates, state = compiled(g, state, params)
            out.append(updates)
        return out, compiled

    want, _ = run(make_optimizer(c, 10, "cpu"))
    tx = make_optimizer(c, 10, "cpu", mesh)
    ps = param_shardings(params, mesh)
    ss = opt_state_shardings(jax.eval_shape(tx.init, params), params, mesh)
    got, compiled = run(tx, ps, ss)  # both steps ran the program whose dots are counted below
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    ns = report.flops_per_step(hlo_lib.work(compiled.as_text()))
    assert ns == pytest.approx(sizing.newton_schulz_flops(CFG) / 8, rel=0.01)


@pytest.mark.parametrize(
    "shape, stored, impl, mesh",
    [
        ((8, 4, 32, 64), P("data", "expert", None, None), "pallas", DATA4_EXPERT2),  # its own block
        ((2, 64, 32), P(None, None, "data"), "pallas", DATA4_EXPERT2),  # moved whole, padded 2 -> 8
        ((8, 64, 32), P("data", None, None), "xla", DATA4_EXPERT2),  # its block, split over expert
        ((12, 64, 32), P("data", None, None), "xla", DATA4_EXPERT2),  # 3 per rank over 2: padded
        ((4, 64, 32), P(None, "fsdp", "data"), "xla", DATA4_FSDP2),  # fsdp splits the matrix
        ((8, 64, 32), P(None, None, None), "xla", DATA4_EXPERT2),  # mesh.zero1 off: all take a part
        # fsdp splits the dimension that the padded stack's expert / context owners split too on
        # the way back: fsdp's split stays the outer one there (o_proj of a 4-layer model)
        ((4, 64, 64), P(None, None, "fsdp"), "xla", (1, 2, 4, 1)),
        ((4, 64, 64), P(None, None, "fsdp"), "xla", (1, 4, 2, 1)),
        ((4, 64, 64), P(None, None, ("fsdp", "data")), "xla", (2, 2, 2, 1)),
        ((4, 64, 32), P(None, None, "fsdp"), "xla", (1, 2, 1, 4)),
    ],
    ids=[
        "aligned",
        "moved",
        "spread",
        "padded",
        "fsdp",
        "zero1_off",
        "fsdp2_expert4",
        "fsdp4_expert2",
        "data2_fsdp2_expert2",
        "fsdp2_context4",
    ],
)
def test_owned_newton_schulz_equals_newton_schulz_of_the_stack(shape, stored, impl, mesh):
    """Each rank orthogonalises the matrices it owns (inside shard_map: the Pallas kernel,
    interpreted on CPU, runs per device) and the results come back in the parameter's layout: equal
    to the XLA Newton-Schulz of the whole stack, for every way a stack can be stored."""
    from zaya_jax.kernels import kernel_options, newton_schulz
    from zaya_jax.kernels.newton_schulz import orthogonalize
    from zaya_jax.parallel.zero1 import owned_orthogonalize

    mesh = make_mesh(*mesh)
    x = jax.random.normal(jax.random.key(3), shape)
    without_data = lambda a: tuple(b for b in a if b != "data") if isinstance(a, tuple) else a
    spec = P(*(None if a == "data" else without_data(a) for a in stored))
    kernel = functools.partial(newton_schulz, **kernel_options("cpu")) if impl == "pallas" else orthogonalize
    placed = jax.device_put(x, NamedSharding(mesh, stored))
    got = jax.jit(lambda y: owned_orthogonalize(kernel, y, stored, spec, mesh))(placed)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    # fp32 through 5 Newton-Schulz iterations, the kernel's tiled dots against XLA's: in a fresh
    # process "aligned" differed by 1.55e-6 at 1 of 65,536 entries (|x| 0.35), over atol=rtol=1e-6.
    np.testing.assert_allclose(np.asarray(got), np.asarray(orthogonalize(x)), rtol=1e-6, atol=2e-6)


def test_owner_plan():
    """Which rank orthogonalises what: the stack split on its layers by ZeRO-1 is the rank's own
    (nothing moves); a matrix split on a dimension is made whole by an all-to-all; an axis the
    stack is replicated over splits it further."""
    mesh = make_mesh(data=4, expert=2)
    plan = owner_plan((8, 4, 64, 64), P("data", "expert", None, None), mesh)
    assert (plan.flat, plan.aligned, plan.moved, plan.spread) == (1, True, (), ())
    assert plan.kept == (("expert", 1),)
    plan = owner_plan((2, 64, 64), P(None, "data", None), mesh)
    assert (plan.flat, plan.moved, plan.spread, plan.ranks) == (1, (("data", 1),), ("expert",), 8)
    plan = owner_plan((8, 64, 64), P("data", None, None), mesh)
    assert (plan.flat, plan.aligned, plan.spread, plan.ranks) == (1, True, ("expert",), 2)
