"""The jit train step (zaya_jax/training/train_state.py): accumulation, non-finite skipping, determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.train_runs import run_train, summary_of, train_losses

from zaya_jax.config import base_config
from zaya_jax.model import ZayaConfig
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.training.train_state import create_train_state, make_train_step

CFG = ZayaConfig.tiny(num_hidden_layers=2)


def _setup(grad_accum=1):
    c = base_config()
    c.optim.warmup_steps = 2
    tx = make_optimizer(c, total_steps=10)
    step = jax.jit(make_train_step(CFG, tx, bal.BalancingConfig(), lr_schedule(c, 10), grad_accum))
    state = create_train_state(CFG, tx, bal.BalancingConfig(), jax.random.key(0))
    r = np.random.default_rng(0)
    ids = r.integers(3, CFG.vocab_size, size=(4, 17))
    batch = {
        "input_ids": jnp.asarray(ids[:, :-1], jnp.int32),
        "targets": jnp.asarray(ids[:, 1:], jnp.int32),
        "loss_mask": jnp.asarray(r.random((4, 16)) > 0.2, jnp.float32),
    }
    return state, step, batch


def test_grad_accumulation_equals_one_big_batch():
    s1, step1, batch = _setup(1)
    s2, step2, _ = _setup(2)
    a, ma = step1(s1, batch)
    b, mb = step2(s2, batch)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
    np.testing.assert_allclose(ma["grad_norm"], mb["grad_norm"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(x, y, atol=1e-5)
    np.testing.assert_array_equal(
        bal.get_balancing_biases(a.variables), bal.get_balancing_biases(b.variables)
    )


def test_step_updates_params_and_balancing_biases():
    state, step, batch = _setup()
    new, m = step(state, batch)
    assert int(new.step) == 1 and np.isfinite(float(m["loss"]))
    assert not np.allclose(
        new.params["layers"]["self_attn"]["q_proj"]["kernel"],
        state.params["layers"]["self_attn"]["q_proj"]["kernel"],
    )
    assert not np.array_equal(
        bal.get_balancing_biases(new.variables), bal.get_balancing_biases(state.variables)
    )
    assert m["expert_load_max_over_mean"].shape == (CFG.num_hidden_layers,)


def test_non_finite_loss_skips_the_update():
    state, step, batch = _setup()
    poisoned = state.replace(params=jax.tree.map(lambda x: x, state.params))
    poisoned.params["norm"]["scale"] = poisoned.params["norm"]["scale"].at[0].set(jnp.nan)
    new, m = step(poisoned, batch)
    assert not np.isfinite(float(m["loss"])) and bool(m["update_skipped"])
    assert int(new.skipped_steps) == 1 and int(new.step) == 1
    # everything but the two counters is the old state bit for bit: params, both optimizer states
    # (Muon / AdamW moments and counts) and the balancing biases
    kept = lambda s: (s.params, s.opt_state, s.balancing, s.balancing_opt_state)
    for x, y in zip(jax.tree.leaves(kept(new)), jax.tree.leaves(kept(poisoned)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_clip_reuses_the_step_grad_norm():
    """chain.clip_by_global_norm with the extra argument grad_norm equals optax's clip (which
    computes the norm itself) bit for bit, and without it too."""
    from zaya_jax.optim.chain import clip_by_global_norm

    r = np.random.default_rng(0)
    grads = {
        "a": jnp.asarray(r.normal(size=(3, 5)), jnp.float32),
        "b": jnp.asarray(r.normal(size=(7,)), jnp.float32),
    }
    for max_norm in (0.5, 100.0):  # clipping active, then not
        want, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        ours = clip_by_global_norm(max_norm)
        got, _ = ours.update(grads, ours.init(grads), grad_norm=optax.tree.norm(grads))
        alone, _ = ours.update(grads, ours.init(grads))
        for w, g, a in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(a, w)


def test_same_seed_same_losses():
    losses = []
    for _ in range(2):
        state, step, batch = _setup()
        run = []
        for _ in range(3):
            state, m = step(state, batch)
            run.append(float(m["loss"]))
        losses.append(run)
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0]


@pytest.mark.slow
def test_tiled_moe_step_equals_ragged_dot_step():
    """moe_impl="tiled" (the sparse plain-XLA grouped matmul, "auto" on CPU) gives the ragged_dot
    train step in fp32: loss, gradient norm and every updated parameter within 1e-5."""
    c = base_config()
    c.optim.warmup_steps = 1
    tx = make_optimizer(c, total_steps=4)
    _, _, batch = _setup()

    def one_step(cfg):
        bc = bal.BalancingConfig()
        state = create_train_state(cfg, tx, bc, jax.random.key(0))
        return jax.jit(make_train_step(cfg, tx, bc, lr_schedule(c, 4)))(state, batch)

    ref, mr = one_step(CFG.replace(moe_impl="ragged_dot"))
    got, mg = one_step(CFG.replace(moe_impl="tiled"))
    assert abs(float(mr["loss"]) - float(mg["loss"])) < 1e-5
    assert abs(float(mr["grad_norm"]) - float(mg["grad_norm"])) < 1e-5 * max(1.0, float(mr["grad_norm"]))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref.params)[0], jax.tree.leaves(got.params)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )
    np.testing.assert_allclose(
        bal.get_balancing_biases(got.variables), bal.get_balancing_biases(ref.variables), atol=1e-6
    )


def test_one_abstract_train_state_for_the_trainer_and_every_checkpoint_reader():
    """abstract_train_state (reshard, import_hf, export / load_model, the trainer's restore target,
    the dry run) is the train program's abstract state: the eval_shape of the initial state with
    the mesh's shardings (the variables' from variable_shardings), and allocates nothing."""
    from zaya_jax import config as config_lib
    from zaya_jax.parallel.mesh import make_mesh
    from zaya_jax.training.train_state import abstract_train_state, train_program, variable_shardings

    c = base_config()
    config_lib.set_model(c, CFG)
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    live = len(jax.live_arrays())
    abstract = abstract_train_state(c, CFG, mesh)
    assert len(jax.live_arrays()) == live
    leaves = jax.tree.leaves(abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    program = train_program(c, CFG, mesh)
    assert jax.tree.structure(abstract) == jax.tree.structure(program.abstract_state())
    for a, b in zip(leaves, jax.tree.leaves(program.abstract_state()), strict=True):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)
    shapes = jax.eval_shape(program.create)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
        lambda x: (x.shape, x.dtype), abstract
    )
    want = variable_shardings(shapes.variables, mesh)
    got = jax.tree.map(lambda x: x.sharding, abstract.variables)
    assert got == want
    # ZeRO-1: some optimizer state is split over `data` where its param is not
    specs = [x.sharding.spec for x in jax.tree.leaves(abstract.opt_state)]
    assert any("data" in jax.tree.leaves(tuple(s)) for s in specs)
    # without a mesh (a checkpoint read onto one device): everything on the first device
    single = abstract_train_state(c, CFG)
    assert {d for x in jax.tree.leaves(single) for d in x.sharding.device_set} == {jax.devices()[0]}


def test_initial_state_is_the_created_state_and_keeps_no_executable():
    """TrainProgram.initial_state (the trainer's fresh start, import_hf) equals create() jit-compiled
    on the mesh, laid out by the program's shardings, and leaves nothing in jax's compilation
    cache: the initializer runs once, and its executable (~70 MB on tiny) must not stay for the run
    as jax.jit(create)() leaves it. On a data x fsdp x expert mesh it is one device's initial
    state, value for value (the mesh-equivalence tests start every mesh from one device's)."""
    from jax._src.interpreters import pxla

    from zaya_jax import config as config_lib
    from zaya_jax.parallel.mesh import make_mesh
    from zaya_jax.training.train_state import train_program

    c = base_config()
    config_lib.set_model(c, CFG)
    program = train_program(c, CFG, make_mesh(data=2, fsdp=2, expert=2))
    cached = lambda: pxla._cached_compilation.cache_info().currsize
    before = cached()
    state = program.initial_state()
    assert cached() == before
    kept = jax.jit(program.create, out_shardings=program.shardings)()
    assert cached() == before + 1  # the plain jit call does keep it: the check above can fail
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(kept), strict=True):
        assert a.sharding == b.sharding and bool(jnp.array_equal(a, b))
    one = train_program(c, CFG, make_mesh(data=1, devices=jax.devices()[:1])).initial_state()
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(one)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_cli_trains_and_resumes_bf16_parameters(tmp_path):
    """`python -m zaya_jax.train` with model.param_dtype=bfloat16 (the dry run's leanest layout) on a
    data x fsdp x expert mesh: trains with finite losses, saves, and resumes to the end."""
    flags = ["--config.model.param_dtype=bfloat16", "--config.mesh.data=2", "--config.mesh.fsdp=2"]
    flags.append("--config.model.num_hidden_layers=1")  # the layout of a block is what is checked
    flags += ["--config.mesh.expert=2", "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0"]
    flags.append("--config.train.allow_schedule_change=True")  # the resumed run plans 4 steps, not 3
    run_train(tmp_path, *flags, "--config.train.steps=3", devices=8)
    resumed = summary_of(run_train(tmp_path, *flags, "--config.train.steps=4", devices=8))
    losses = train_losses(tmp_path)
    assert resumed["start_step"] == 3 and sorted(losses) == [1, 2, 3, 4]  # saved at its last step
    assert all(np.isfinite(v) for v in losses.values()) and losses[4] < losses[1]
