"""zaya_jax/parallel on 8 simulated CPU devices: meshes, sharding table, ZeRO-1, FSDP, expert
parallelism (all-to-all), equality with the single-device step, and bad meshes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.xla_env import FAST_COMPILE

from zaya_jax.config import base_config
from zaya_jax.model import ZayaConfig
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.parallel import make_mesh, resolve_mesh_shape
from zaya_jax.parallel.expert import capacity
from zaya_jax.parallel.mesh import MESH_AXES, parse_mesh_spec, resolve_mesh_sizes
from zaya_jax.parallel.sharding import batch_sharding, global_bytes, per_device_bytes
from zaya_jax.training.train_state import create_train_state, make_train_step, state_shardings

CFG = ZayaConfig.tiny(
    hidden_size=64, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32, vocab_size=128
)
MESHES = {
    "data8": (8, 1, 1),
    "data2_expert4": (2, 1, 4),
    "data2_fsdp2_expert2": (2, 2, 2),
    "expert8": (1, 1, 8),
}
STEPS = 20


def _batch(step, b=8, s=16):
    r = np.random.default_rng(step)
    ids = r.integers(3, CFG.vocab_size, size=(b, s + 1))
    return {
        "input_ids": ids[:, :-1].astype(np.int32),
        "targets": ids[:, 1:].astype(np.int32),
        "loss_mask": np.ones((b, s), np.float32),
    }


def _setup(steps=STEPS):
    """(optimizer config, optimizer, balancing config, create()) of the runs below."""
    c = base_config()
    c.optim.warmup_steps = 2
    tx = make_optimizer(c, total_steps=steps)
    bc = bal.BalancingConfig(lr=1e-2)
    return c, tx, bc, lambda: create_train_state(CFG, tx, bc, jax.random.key(0))


@functools.cache
def _initial_state():
    """The initial train state, created once on one device and kept on the host: every run (one
    device or a mesh) starts from these values, laid out by its own shardings."""
    create = _setup()[3]
    return jax.device_get(jax.jit(create).lower().compile(FAST_COMPILE)())


@functools.cache
def _run(mesh_shape, steps=STEPS):
    """Losses and grad norms of `steps` train steps, the final state, the compiled step and the
    mesh, on a mesh (None = one device); once per mesh in the module."""
    c, tx, bc, create = _setup(steps)
    if mesh_shape is None:
        mesh, state = None, jax.device_put(_initial_state())
        step_fn = jax.jit(make_train_step(CFG, tx, bc, lr_schedule(c, steps)))
        put = lambda b: jax.tree.map(jnp.asarray, b)
    else:
        mesh = make_mesh(*mesh_shape)
        shardings = state_shardings(jax.eval_shape(create), mesh)
        state = jax.device_put(_initial_state(), shardings)
        step_fn = jax.jit(
            make_train_step(CFG, tx, bc, lr_schedule(c, steps), mesh=mesh),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
        )
        put = lambda b: jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), b)
    compiled = step_fn.lower(state, put(_batch(0))).compile(FAST_COMPILE)
    losses, grad_norms = [], []
    for i in range(steps):
        state, m = compiled(state, put(_batch(i)))
        losses.append(float(m["loss"]))
        grad_norms.append(float(m["grad_norm"]))
    return losses, grad_norms, state, compiled, mesh


@pytest.fixture(scope="module")
def single_device():
    return _run(None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_matches_single_device(name, single_device):
    ref_losses, ref_norms, ref_state, _, _ = single_device
    losses, norms, state, _, _ = _run(MESHES[name])
    # Step 1: same loss and gradients (the gradient norm over every parameter) within 1e-5.
    assert abs(losses[0] - ref_losses[0]) < 1e-5
    assert abs(norms[0] - ref_norms[0]) < 1e-5 * max(1.0, ref_norms[0])
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4)
    # The routing decisions (balancing biases are driven by global counts) stayed identical.
    np.testing.assert_allclose(
        bal.get_balancing_biases(state.variables), bal.get_balancing_biases(ref_state.variables), atol=1e-6
    )


def test_first_step_gradients_match_per_parameter():
    """Every parameter's gradient on data=2 x fsdp=2 x expert=2 equals the single-device one."""
    from zaya_jax.model import BALANCING, ZayaForCausalLM, init_variables
    from zaya_jax.training.train_state import loss_and_counts

    variables = jax.jit(init_variables, static_argnums=0)(CFG, jax.random.key(1))  # one program
    batch = jax.tree.map(jnp.asarray, _batch(0))

    def grads(mesh):
        model = ZayaForCausalLM(CFG, mesh)

        def f(p):  # the train step's objective: mean token loss
            loss_sum, aux = loss_and_counts(model, p, variables[BALANCING], batch)
            return loss_sum / aux.weight

        params = variables["params"]
        return jax.jit(jax.value_and_grad(f)).lower(params).compile(FAST_COMPILE)(params)

    ref_loss, ref = grads(None)
    mesh = make_mesh(2, 2, 2)
    loss, got = grads(mesh)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )


def test_expert_parallel_step_uses_all_to_all_and_shards_experts():
    """The data=2 x expert=4 train step exchanges tokens by all-to-all; its state keeps 1/4 of the
    experts per device, the optimizer state split over data on top (ZeRO-1), the rest replicated.
    The compiled step and its state are test_mesh_matches_single_device's data2_expert4 run."""
    _, _, state, compiled, mesh = _run(MESHES["data2_expert4"])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}
    assert "all-to-all" in compiled.as_text()

    experts = state.params["layers"]["mlp"]["experts"]
    assert per_device_bytes(experts) * 4 == global_bytes(experts)  # 1/4 of the experts per device
    assert experts["gate_up_proj"].sharding.spec[1] == "expert"
    # ZeRO-1: the optimizer state is split over data=2 on top of the expert split.
    assert per_device_bytes(state.opt_state) <= global_bytes(state.opt_state) / 2 * 1.05
    # Params outside the experts are replicated under ZeRO-1 (no FSDP).
    q = state.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert per_device_bytes(q) == global_bytes(q)


def test_fsdp_shards_params_and_optimizer_state():
    create = _setup()[3]
    mesh = make_mesh(2, 4, 1)
    # the initial state laid out by the sharding table (the layout jit(create) would return)
    state = jax.device_put(_initial_state(), state_shardings(jax.eval_shape(create), mesh))
    q = state.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "fsdp", None) and per_device_bytes(q) * 4 == global_bytes(q)
    big = {k: v for k, v in state.params.items() if k in ("embed_tokens", "layers")}
    assert per_device_bytes(big) < global_bytes(big) / 3  # the matrices dominate and are split 4 ways
    # Optimizer state: matrices split fsdp 4 x data 2 ways; small vectors only over data.
    assert per_device_bytes(state.opt_state) < global_bytes(state.opt_state) / 4
    mu = [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        if "q_proj" in jax.tree_util.keystr(p) and x.shape == q.shape
    ]
    assert mu and all(per_device_bytes(x) * 8 == global_bytes(x) for x in mu)


@pytest.mark.parametrize(
    "shape, message",
    [
        ((3, 1, 1), "does not equal the 8 available devices"),
        ((2, -1, 3), "not divisible by the fixed axes"),
        ((1, 1, 8), "mesh.expert=8 does not divide model.num_experts=6"),
        ((-1, -1, 1), "only one axis may be -1"),
        ((0, 1, 1), "mesh.data=0"),
    ],
)
def test_bad_mesh_is_a_clear_error(shape, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(*shape, num_experts=6)


def test_resolve_mesh_shape():
    assert resolve_mesh_shape(-1, 2, 2, num_devices=8) == (2, 2, 2, 1)
    assert resolve_mesh_shape(1, 1, -1, num_devices=8) == (1, 1, 8, 1)
    assert dict(make_mesh(data=2, expert=4).shape) == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}


def test_one_mesh_parser_for_every_entry_point():
    """config.validate, the sizing CLI and the evaluator read mesh specs with parallel.mesh."""
    from zaya_jax import config as config_lib
    from zaya_jax import sizing
    from zaya_jax.evaluate import parse_mesh

    assert parse_mesh_spec("expert=4") == {"data": -1, "fsdp": 1, "expert": 4, "context": 1}
    assert parse_mesh_spec(" fsdp = 2 ", default={"data": 3}) == {
        "data": 3,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
    }
    assert resolve_mesh_sizes(parse_mesh_spec("expert=4"), num_devices=8) == {
        "data": 2,
        "fsdp": 1,
        "expert": 4,
        "context": 1,
    }
    for bad in ("gpu=8", "data", "data=two"):
        with pytest.raises(ValueError, match="expected axis=size"):
            parse_mesh_spec(bad)
    with pytest.raises(ValueError, match="expected axis=size"):
        sizing.parse_mesh("gpu=8")
    with pytest.raises(ValueError, match="expected axis=size.*or none / auto"):
        parse_mesh("gpu=8")
    assert dict(parse_mesh("fsdp=2,expert=2").shape) == {"data": 2, "fsdp": 2, "expert": 2, "context": 1}
    with pytest.raises(ValueError, match="does not equal the 8 available devices"):
        resolve_mesh_sizes({"data": 3}, num_devices=8, exact=True)
    c = config_lib.base_config()
    assert set(MESH_AXES) <= set(c.mesh.keys())  # an axis added to MESH_AXES is a config key
    for sizes, message in (
        ({"data": -1, "fsdp": -1}, "config.mesh: only one axis"),
        ({"expert": 0}, "mesh.expert=0"),
    ):
        c = config_lib.base_config()
        for axis, size in sizes.items():
            c.mesh[axis] = size
        with pytest.raises(ValueError, match=message):
            config_lib.validate(c)


def test_capacity_factor_drops_and_counts():
    from zaya_jax.model import BALANCING, ZayaForCausalLM, init_variables

    mesh = make_mesh(2, 1, 4)
    assert capacity(16, 4, None) == 16 and capacity(16, 4, 1.0) == 8 and capacity(64, 4, 1.0) == 16
    ids = jax.device_put(jnp.asarray(_batch(3)["input_ids"]), batch_sharding(mesh))
    variables = jax.jit(init_variables, static_argnums=0)(CFG, jax.random.key(0))  # one program
    # Route everything to expert 0 so the rank owning it overflows a capacity-1.0 bucket.
    biases = jnp.zeros((2, 9)).at[:, 0].set(5.0)
    variables = {**variables, BALANCING: {"layers": {"mlp": {"gate": {"balancing_biases": biases}}}}}
    # jit: one program per model instead of an eager dispatch per op (the same values)
    apply = lambda cfg, mesh=None: jax.jit(ZayaForCausalLM(cfg, mesh).apply)(variables, ids)
    dropless = apply(CFG, mesh)
    capped = apply(CFG.replace(moe_capacity_factor=1.0), mesh)
    single = apply(CFG)
    assert int(dropless.dropped_tokens.sum()) == 0
    np.testing.assert_allclose(dropless.logits, single.logits, atol=1e-5)
    # 8 x 16 tokens over 8 devices -> 16 per device, all to one rank with 8 slots: 8 dropped each.
    np.testing.assert_array_equal(capped.dropped_tokens, [64, 64])
    assert not np.allclose(capped.logits, single.logits)


@pytest.mark.slow
def test_expert_parallel_tiled_dispatch_equals_single_device_ragged_dot():
    """The expert-parallel path runs the same local dispatch: moe_impl="tiled" on data=2 x
    expert=4 (each device's received tokens through the tiled grouped matmul) gives the
    single-device ragged_dot logits."""
    from zaya_jax.model import ZayaForCausalLM, init_variables

    mesh = make_mesh(2, 1, 4)
    variables = jax.jit(init_variables, static_argnums=0)(CFG, jax.random.key(3))  # one program
    ids = jnp.asarray(_batch(4)["input_ids"])
    ref = jax.jit(ZayaForCausalLM(CFG.replace(moe_impl="ragged_dot")).apply)(variables, ids)
    got = jax.jit(ZayaForCausalLM(CFG.replace(moe_impl="tiled"), mesh).apply)(
        variables, jax.device_put(ids, batch_sharding(mesh))
    )
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), atol=1e-5)
