"""The dropless expert exchange (zaya_jax/parallel/expert.py) on 8 simulated CPU devices: the main
round plus the spill equals the single device whatever the routing (balanced, skewed onto one
rank, skewed on one data group only), and the dropping mode still drops and counts. The compiled
train step's all-to-all bytes per MoE block (within 2x the ideal 4 x T x d x itemsize) are
tests/test_systems_benchmarks.py's, through `benchmarks.collectives --expert-exchange`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.xla_env import FAST_COMPILE, XLA_DEFAULT_COMPILE

from zaya_jax.analysis import hlo
from zaya_jax.model import BALANCING, ZayaConfig, ZayaForCausalLM, init_variables
from zaya_jax.model.moe import cotangent_as, dense_moe, tiled_moe
from zaya_jax.model.transformer import REMAT_POLICIES
from zaya_jax.parallel import make_mesh
from zaya_jax.parallel.expert import BATCH, capacity, expert_parallel_moe, remat_saved_bytes
from zaya_jax.parallel.sharding import batch_sharding
from zaya_jax.training.metrics import read_metrics
from zaya_jax.training.train_state import SPILL_BLOCKS, SPILL_STEP_FRACTION, loss_and_counts

CFG = ZayaConfig.tiny(
    hidden_size=64, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32, vocab_size=128
)
E, D, F = 8, 16, 8  # experts, width, expert FFN width of the function-level tests
T = 256  # global tokens of the function-level tests: 32 per device


def _experts(key):
    k1, k2, k3 = jax.random.split(key, 3)
    x_td = jax.random.normal(k1, (T, D), jnp.float32)
    gate_up_edf = jax.random.normal(k2, (E, D, 2 * F), jnp.float32) / 4
    down_efd = jax.random.normal(k3, (E, F, D), jnp.float32) / 3
    return x_td, gate_up_edf, down_efd


def _routing(kind: str) -> np.ndarray:
    """expert_t [T] in [0, E] (E = skip class). Device i holds tokens [32 i, 32 i + 32)."""
    r = np.random.default_rng(0)
    if kind == "balanced":  # every device sends each expert the same number of tokens: no overflow
        return np.arange(T) % E
    if kind == "skewed":  # 7/8 of the tokens to expert 0 (rank 0), some to the skip class
        return np.where(r.random(T) < 0.875, 0, r.integers(0, E + 1, T))
    if kind == "one_group_skewed":  # devices 0-3 (data group 0) skewed, 4-7 balanced: only group 0 spills
        return np.where(np.arange(T) < T // 2, _routing("skewed"), _routing("balanced"))
    return r.integers(0, E + 1, T)  # "random"


def _moe_loss(fn, x, gate_up, down, expert, w):
    y, dropped, spilled = fn(x, expert, gate_up, down)
    return jnp.mean(y * w), (y, dropped, spilled)  # a mean, like the train objective: gradients ~1e-2


def _reference(x, expert, gate_up, down):
    return dense_moe(x, expert, gate_up, down, jax.nn.silu), jnp.zeros((), jnp.int32), None


def _expected_spills(expert: np.ndarray, mesh_shape) -> np.ndarray:
    """[devices]: 1 on every device of an expert group in which some device has more tokens for
    one rank than the main round's capacity. Devices hold T/8 tokens each, in mesh order, the
    expert axis last: a group is n consecutive devices."""
    n = mesh_shape[2]
    per_device = expert.reshape(8, T // 8)
    full = [
        np.bincount(row[row < E] // (E // n), minlength=n).max() > capacity(T // 8, n, 1.5)
        for row in per_device
    ]
    return np.repeat(np.asarray(full).reshape(-1, n).any(axis=1), n).astype(np.int32)


@pytest.mark.parametrize("mesh_shape", [(2, 1, 4), (1, 1, 8)])
@pytest.mark.parametrize("kind", ["balanced", "random", "skewed", "one_group_skewed"])
def test_dropless_exchange_matches_single_device(mesh_shape, kind):
    """Outputs and gradients (x, both expert weights) equal the single-device dense reference,
    nothing dropped, whether no bucket, some or most overflow the main round; `spilled` names the
    expert groups that ran the spill round (only data group 0 for one_group_skewed on data=2)."""
    mesh = make_mesh(*mesh_shape)
    x, gate_up, down = _experts(jax.random.key(1))
    expert = jnp.asarray(_routing(kind), jnp.int32)
    w = jax.random.normal(jax.random.key(2), (T, D))
    ep = functools.partial(expert_parallel_moe, act=jax.nn.silu, local_moe=tiled_moe, mesh=mesh)
    tok = NamedSharding(mesh, P(BATCH))
    x, expert = jax.device_put(x, tok), jax.device_put(expert, tok)
    grad = lambda fn: jax.jit(jax.value_and_grad(functools.partial(_moe_loss, fn), (0, 1, 2), has_aux=True))
    (_, (y_ref, *_)), g_ref = grad(_reference)(x, gate_up, down, expert, w)
    (_, (y, dropped, spilled)), g = grad(ep)(x, gate_up, down, expert, w)
    assert int(dropped) == 0
    want = _expected_spills(_routing(kind), mesh_shape)
    np.testing.assert_array_equal(spilled, want)
    assert {"balanced": not want.any(), "skewed": want.all()}.get(kind, True)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for a, b, name in zip(g, g_ref, ("x", "gate_up", "down")):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


def test_bf16_exchange_equals_one_device_bit_for_bit():
    """In bf16 the combine's backward sends the cotangent in bf16 (the dispatch consumes it so:
    `cotangent_as`): on expert=8 the loss gradients equal one device's to the bit (data=1: no
    reduction over data groups to reorder)."""
    mesh = make_mesh(1, 1, 8)
    x, gate_up, down = (a.astype(jnp.bfloat16) for a in _experts(jax.random.key(4)))
    expert = jnp.asarray(_routing("random"), jnp.int32)
    w = jax.random.normal(jax.random.key(5), (T, D))
    local = lambda x, *rest: cotangent_as(tiled_moe(x, *rest), x.dtype)  # as ZayaExperts
    one = lambda x, e, g, d: (local(x, e, g, d, jax.nn.silu), None, None)
    ep = functools.partial(expert_parallel_moe, act=jax.nn.silu, local_moe=local, mesh=mesh)
    grad = lambda fn: jax.jit(jax.grad(lambda *a: _moe_loss(fn, *a)[0], (0, 1, 2)))
    tok = NamedSharding(mesh, P(BATCH))
    got = grad(ep)(jax.device_put(x, tok), gate_up, down, jax.device_put(expert, tok), w)
    want = grad(one)(x, gate_up, down, expert, w)
    for a, b, name in zip(got, want, ("x", "gate_up", "down")):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


@pytest.mark.parametrize("policy", [*REMAT_POLICIES, "nothing_saveable"])
def test_remat_reuses_what_the_exchange_received(policy):
    """The exchange under jax.checkpoint with the model's remat policies (value_and_grad, data=2 x
    expert=4, bf16): the backward reuses the saved exchange outputs, so the main path has 5
    all-to-alls (tokens, ids, outputs forward; the outputs' and tokens' cotangents backward), not
    the 8 of replaying the forward (nothing_saveable), and keeps exactly `remat_saved_bytes` per
    device more than nothing_saveable (what sizing adds under remat)."""
    mesh = make_mesh(2, 1, 4)
    tok = NamedSharding(mesh, P(BATCH))
    x, gate_up, down = (a.astype(jnp.bfloat16) for a in _experts(jax.random.key(6)))
    x, expert = jax.device_put(x, tok), jax.device_put(jnp.asarray(_routing("balanced"), jnp.int32), tok)
    ep = lambda x, g, d: expert_parallel_moe(x, expert, g, d, jax.nn.silu, tiled_moe, mesh)[0]

    def residuals(name):
        pol = REMAT_POLICIES.get(name, jax.checkpoint_policies.nothing_saveable)
        f = jax.checkpoint(lambda *a: jnp.sum(ep(*a) ** 2), policy=pol)  # uses y: its value is needed
        vjp = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], x, gate_up, down)
        return f, [(r.shape, r.dtype) for r in jax.tree.leaves(vjp)]

    nbytes = lambda leaves: sum(math.prod(shape) * dtype.itemsize for shape, dtype in leaves)
    f, saved = residuals(policy)
    # XLA's default pipeline: with the fusion emitters off CSE merges two of nothing_saveable's 8.
    lowered = jax.jit(jax.value_and_grad(f, (0, 1, 2))).lower(x, gate_up, down)
    text = lowered.compile(XLA_DEFAULT_COMPILE).as_text()
    main = [c for c in hlo.collectives(text) if c.op == "all-to-all" and c.runs.main]
    assert len(main) == (8 if policy == "nothing_saveable" else 5)
    extra = nbytes(saved) - nbytes(residuals("nothing_saveable")[1])
    if policy == "matmuls":
        # matmuls keeps dots_saveable's and the grouped matmuls' outputs (GMM_OUT): fp32 rows of the
        # slots the devices received, 8 devices x 4 ranks x capacity.
        added = list(saved)
        for leaf in residuals("dots_saveable")[1]:
            added.remove(leaf)
        slots = 8 * 4 * capacity(T // 8, 4, 1.5)
        assert added and all(shape[0] == slots and dtype == jnp.float32 for shape, dtype in added), added
        extra -= nbytes(added)
    per_device = remat_saved_bytes(T // 8, 4, D, E, 2, 1.5)
    assert extra == (0 if policy == "nothing_saveable" else 8 * per_device)


def test_capacity_factor_drops_and_counts_exactly():
    """The dropping mode: each device's first `cap` tokens per rank run, the rest get 0 and are
    counted. Skewed routing on data=2 x expert=4: 32 tokens per device, cap = 8 per rank."""
    mesh = make_mesh(2, 1, 4)
    x, gate_up, down = _experts(jax.random.key(3))
    expert = _routing("skewed")
    tok = NamedSharding(mesh, P(BATCH))
    fn = jax.jit(
        functools.partial(
            expert_parallel_moe, act=jax.nn.silu, local_moe=tiled_moe, mesh=mesh, capacity_factor=1.0
        )
    )
    y, dropped, spilled = fn(jax.device_put(x, tok), jax.device_put(jnp.asarray(expert), tok), gate_up, down)
    assert not np.any(spilled)  # the dropping mode has no spill round
    cap = capacity(32, 4, 1.0)
    rank = np.where(expert < E, expert // 2, 4).reshape(8, 32)  # per device
    slot = np.stack([[np.sum(row[:i] == row[i]) for i in range(32)] for row in rank]).reshape(-1)
    kept = (rank.reshape(-1) < 4) & (slot < cap)
    assert int(dropped) == int(np.sum((expert < E) & ~kept)) > 0
    ref = dense_moe(x, jnp.asarray(np.where(kept, expert, E)), gate_up, down, jax.nn.silu)
    np.testing.assert_allclose(y, ref, atol=1e-5)


def _model_loss_and_grads(cfg, mesh, variables, batch):
    """((mean token loss, dropped), gradients), compiled with FAST_COMPILE (tests/support/xla_env.py: a
    program run once; the single device and the meshes alike)."""
    model = ZayaForCausalLM(cfg, mesh)

    def f(p):  # the train step's objective: mean token loss
        loss_sum, aux = loss_and_counts(model, p, variables[BALANCING], batch)
        return loss_sum / aux.weight, aux.dropped

    params = variables["params"]
    compiled = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(params).compile(compiler_options=FAST_COMPILE)
    return compiled(params)


@pytest.fixture(scope="module")
def model_case():
    """Tiny model, 8 x 32 tokens, a skewed router (balancing bias +5 on expert 0: most tokens of
    every device go to rank 0) and its single-device loss and gradients. The variables come from
    one jitted init program (FAST_COMPILE), not op by op."""
    key = jax.random.key(0)
    init = jax.jit(init_variables, static_argnums=0).lower(CFG, key).compile(compiler_options=FAST_COMPILE)
    variables = init(key)
    biases = jnp.zeros((CFG.num_hidden_layers, CFG.num_experts + 1)).at[:, 0].set(5.0)
    variables = {**variables, BALANCING: {"layers": {"mlp": {"gate": {"balancing_biases": biases}}}}}
    ids = np.random.default_rng(0).integers(3, CFG.vocab_size, size=(8, 33))
    batch = {
        "input_ids": jnp.asarray(ids[:, :-1], jnp.int32),
        "targets": jnp.asarray(ids[:, 1:], jnp.int32),
        "loss_mask": jnp.ones((8, 32), jnp.float32),
    }
    return variables, batch, _model_loss_and_grads(CFG, None, variables, batch)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, remat", [((2, 1, 4), "full"), ((1, 1, 8), "none")])
def test_model_with_skewed_router_matches_single_device(mesh_shape, remat, model_case):
    """ZayaForCausalLM's mean loss and every parameter gradient on the mesh equal the single device
    (no remat) within 1e-5, with no token dropped, though the router sends most tokens to one rank
    (main round and spill); with remat "full" the backward reuses the saved exchange outputs."""
    variables, batch, ((ref_loss, _), ref_grads) = model_case
    mesh = make_mesh(*mesh_shape)
    batch = jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh)), batch)
    (loss, dropped), grads = _model_loss_and_grads(CFG.replace(remat=remat), mesh, variables, batch)
    assert int(np.sum(dropped)) == 0
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref_grads)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )


def test_bad_exchange_capacity_factor_is_a_one_line_error(tmp_path):
    """`--config.model.moe_exchange_capacity_factor=0`: one `error:` line naming the key, exit 2,
    and no workdir created."""
    from support.cli_runs import TINY, assert_one_line_error, run_cli

    workdir = tmp_path / "run"
    proc = run_cli(
        "train", "--config", TINY, "--config.model.moe_exchange_capacity_factor=0", "--workdir", workdir
    )
    assert_one_line_error(proc, "moe_exchange_capacity_factor")
    assert not workdir.exists()
    with pytest.raises(ValueError, match="moe_exchange_capacity_factor=-1.0 must be > 0"):
        CFG.replace(moe_exchange_capacity_factor=-1.0)


@pytest.mark.slow
def test_train_logs_the_spill_rounds(tmp_path):
    """`python -m zaya_jax.train` at expert=4 (2 blocks, 4 experts, 64 tokens per device), 4 steps
    logged every 2: with moe_exchange_capacity_factor 0.25 (C = 8 slots per peer, a fair share is
    ~16) on data=2 x expert=4 (the per-rank microbatch loop of zaya_jax/parallel/zero1.py) both
    blocks of both expert groups take the spill round on every step, so metrics.jsonl and
    TensorBoard hold expert_exchange/spill_blocks = 4 and spill_step_fraction = 1, and `python -m
    zaya_jax.plot` draws them; at 4 on expert=4 alone (C = T: no bucket can overflow) both are 0."""
    from support.events import event_tags
    from support.plots import is_png, run_plot
    from support.train_runs import run_train

    spills = {}
    for factor, devices in ((0.25, 8), (4.0, 4)):
        workdir = tmp_path / str(factor)
        args = [f"--config.model.moe_exchange_capacity_factor={factor}", "--config.mesh.expert=4"]
        args += ["--config.train.steps=4", "--config.logging.every_steps=2", "--config.eval.every_steps=0"]
        args += ["--config.checkpoint.every_steps=0"]  # the final checkpoint only: none is read here
        run_train(workdir, *args, "--config.logging.tensorboard=True", devices=devices)
        records = read_metrics(str(workdir), split="train")
        assert [r["step"] for r in records] == [2, 4]
        spills[factor] = [(r[SPILL_BLOCKS], r[SPILL_STEP_FRACTION]) for r in records]
        tags = event_tags(workdir / "tensorboard")
        assert [v for _, v in tags[f"train/{SPILL_BLOCKS}"]] == [b for b, _ in spills[factor]]
        assert [v for _, v in tags[f"train/{SPILL_STEP_FRACTION}"]] == [f for _, f in spills[factor]]
    assert spills == {0.25: [(4.0, 1.0), (4.0, 1.0)], 4.0: [(0.0, 0.0), (0.0, 0.0)]}
    res = run_plot(tmp_path / "0.25")
    assert res.returncode == 0, res.stderr
    assert str(tmp_path / "0.25" / "expert_exchange.png") in res.stdout.split()
    assert is_png(tmp_path / "0.25" / "expert_exchange.png")
