"""Context parallelism (zaya_jax/parallel/context.py) on 8 simulated CPU devices: the halo against
the unsplit left context, the model's loss, logits, expert counts and every gradient on context
meshes against one device (with padding and packed documents), 20 train steps, the halo's
collective-permute in the compiled program, and checkpoints moving between context sizes; all of it
for both layouts (mesh.context_layout), plus the zigzag layout's permutation and its balance of the
blockwise attention's work over ranks."""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.context_batch import CFG, B, S, padded_batch
from support.train_runs import run_train, train_losses
from support.xla_env import FAST_COMPILE

from zaya_jax.config import base_config, validate
from zaya_jax.kernels import reference_attention
from zaya_jax.kernels.blockwise_attention import visited_blocks
from zaya_jax.model import BALANCING, ZayaConfig, ZayaForCausalLM, init_variables
from zaya_jax.model.attention import pallas_attention
from zaya_jax.model.loss import token_cross_entropy
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.parallel import make_mesh
from zaya_jax.parallel.context import (
    CONTIGUOUS,
    LAYOUTS,
    ZIGZAG,
    check_local_length,
    chunk_order,
    context_size,
    flatten_tokens,
    fold_sequences,
    from_layout,
    layout_permutation,
    to_layout,
    unflatten_tokens,
    unfold_sequences,
    with_left_context,
)
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.parallel.sharding import batch_sharding
from zaya_jax.training.checkpoint import Checkpointer
from zaya_jax.training.metrics import read_metrics
from zaya_jax.training.train_state import (
    check_batch_divides,
    create_train_state,
    layout_batch,
    make_train_step,
    state_shardings,
)

# (data, fsdp, expert, context)
MESHES = {
    "context2_data4": (4, 1, 1, 2),
    "context4_expert2": (1, 1, 2, 4),
    "context2_data2_expert2": (2, 1, 2, 2),
    "context8": (1, 1, 1, 8),
    "context4_fsdp2": (1, 2, 1, 4),
}
# Programs run once: tests/support/xla_env.py FAST_COMPILE (interpreted Pallas kernels are large while
# loops; the model equality cases compile ~35% faster with it, measured).


@pytest.mark.parametrize("layout", LAYOUTS)
def test_left_context_is_the_unsplit_one(layout):
    """Each stored chunk's left context is the last rows of the chunk before it in the sequence
    (another rank's, or for zigzag's c_R its own rank's first), the first chunk's the given state."""
    x = np.random.default_rng(0).normal(size=(4, 32, 3)).astype(np.float32)
    left = np.full((4, 3, 3), 7.0, np.float32)
    mesh = make_mesh(2, 1, 1, 4)
    stored = jax.device_put(to_layout(jnp.asarray(x), layout, 4), batch_sharding(mesh))
    order = chunk_order(layout, 4)
    n = 32 // len(order)
    for state in (None, left):
        got = jax.jit(lambda x, s: with_left_context(x, s, 3, mesh, layout))(stored, state)
        full = np.concatenate([np.zeros((4, 3, 3)) if state is None else left, x], axis=1)
        want = np.stack([full[:, n * c : n * c + 3 + n] for c in order], axis=1)  # [B, K*R, 3 + n, C]
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match=r"mesh.context=8: sequence length 8 .* at least 2 positions"):
        check_local_length(8, 8, 2)
    with pytest.raises(ValueError, match=r"multiple of 8 \(the zigzag layout's chunks\) .* per chunk"):
        check_local_length(12, 4, 2, ZIGZAG)
    check_local_length(16, 4, 2, ZIGZAG)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_zigzag_permutation(ranks):
    """Rank r holds chunks c_r and c_{2R-1-r}; `from_layout` inverts `to_layout`."""
    perm = layout_permutation(16, ZIGZAG, ranks)
    chunks = perm.reshape(ranks, 2, -1) if ranks > 1 else perm.reshape(1, 1, -1)
    n = 16 // (2 * ranks)
    for r in range(ranks if ranks > 1 else 0):
        np.testing.assert_array_equal(chunks[r, 0], np.arange(r * n, (r + 1) * n))
        np.testing.assert_array_equal(chunks[r, 1], np.arange((2 * ranks - 1 - r) * n, (2 * ranks - r) * n))
    assert sorted(perm) == list(range(16))
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(from_layout(to_layout(x, ZIGZAG, ranks), ZIGZAG, ranks), x)
    np.testing.assert_array_equal(to_layout(x, ZIGZAG, ranks)[0, :, 0], 3 * perm)
    np.testing.assert_array_equal(layout_permutation(16, CONTIGUOUS, ranks), np.arange(16))


@pytest.mark.parametrize("ranks", [2, 4])
def test_zigzag_balances_blockwise_attention(ranks):
    """Key blocks the blockwise attention visits per rank (its queries against the gathered keys):
    contiguous leaves rank R-1 (2R-1)/R times the mean, zigzag gives every rank the mean."""
    s, block = 64, 4
    q = jnp.ones((1, s, 1, 8), jnp.float32)

    def visits(layout):  # per rank: its queries [S/R] against all keys, in storage order
        perm = jnp.asarray(layout_permutation(s, layout, ranks))[None]
        local = s // ranks
        blocks = {"scale": 1.0, "block_q": block, "block_k": block}
        count = lambda pos: int(
            visited_blocks(q[:, :local], q, q, q_pos_bs=pos, kv_pos_bt=perm, **blocks)
        )
        return [count(perm[:, r * local : (r + 1) * local]) for r in range(ranks)]

    contiguous, zigzag = visits(CONTIGUOUS), visits(ZIGZAG)
    assert sum(contiguous) == sum(zigzag)  # the same causal triangle
    mean = sum(zigzag) / ranks
    assert zigzag == [mean] * ranks
    assert contiguous == sorted(contiguous) and contiguous[-1] / mean > (2 * ranks - 1) / ranks - 0.1


def test_flat_tokens_stay_on_their_device():
    """[B, S] -> flat tokens laid out P(MESH_AXES) (the expert exchange's layout) and folded rows
    [B*R, S/R] move no data, and both invert exactly."""
    mesh = make_mesh(2, 1, 2, 2)
    x = jnp.arange(8 * 16 * 3, dtype=jnp.float32).reshape(8, 16, 3)
    xs = jax.device_put(x, batch_sharding(mesh))
    for fn, spec in ((flatten_tokens, P(MESH_AXES)), (fold_sequences, P(MESH_AXES, None))):
        step = jax.jit(lambda x: fn(x, mesh), out_shardings=NamedSharding(mesh, spec))
        hlo = step.lower(xs).compile().as_text()
        assert not re.search(r"all-to-all|all-gather|collective-permute|all-reduce", hlo), fn.__name__
    np.testing.assert_array_equal(unflatten_tokens(flatten_tokens(x, mesh), 8, mesh), x)
    np.testing.assert_array_equal(unfold_sequences(fold_sequences(x, mesh), 8, mesh), x)
    assert fold_sequences(x, mesh).shape == (16, 8, 3)


@functools.cache
def _variables(cfg: ZayaConfig):
    """init_variables(cfg, key 1) as one jitted program (FAST_COMPILE), not op by op (~20 s on a
    fresh cache), once per model: `_loss_grads` asks with attention_impl reset to CFG's, a field
    that creates no parameter (the attention function is picked at apply time), so every case and
    the single device start from the same arrays."""
    key = jax.random.key(1)
    init = jax.jit(init_variables, static_argnums=0).lower(cfg, key).compile(compiler_options=FAST_COMPILE)
    return init(key)


def _loss_grads(mesh, layout=CONTIGUOUS, cfg=CFG, compiler_options=FAST_COMPILE):
    """jit(value_and_grad) of the mean token loss (padding excluded), with the expert counts and
    the logits (in position order), compiled for `mesh` with the batch in `layout`'s order
    (`layout_batch`, as the train step does); returns ((loss, (counts, logits)), grads) and the
    compiled program's HLO."""
    model = ZayaForCausalLM(cfg, mesh, layout)
    variables = _variables(dataclasses.replace(cfg, attention_impl=CFG.attention_impl))

    def objective(params, batch):
        batch = layout_batch(batch, layout, mesh)
        out = model.apply(
            {"params": params, BALANCING: variables[BALANCING]},
            batch["input_ids"],
            batch["attention_mask"],
            positions=batch.get("positions"),
            segment_ids=batch["segment_ids"],
        )
        w = batch["attention_mask"].astype(jnp.float32)
        loss = jnp.sum(token_cross_entropy(out.logits, batch["targets"]) * w) / jnp.sum(w)
        return loss, (out.expert_counts, from_layout(out.logits, layout, context_size(mesh)))

    batch = padded_batch()
    if mesh is None:
        batch = jax.tree.map(jnp.asarray, batch)
    else:
        batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), batch)
    compiled = (
        jax.jit(jax.value_and_grad(objective, has_aux=True))
        .lower(variables["params"], batch)
        .compile(compiler_options=compiler_options)
    )
    return compiled(variables["params"], batch), compiled.as_text()


@pytest.fixture(scope="module")
def single_device_grads():
    return _loss_grads(None)[0]


# The zigzag layout on two context sizes, with the XLA attention and the blockwise one.
CASES = [(name, CONTIGUOUS, "xla") for name in MESHES] + [
    ("context2_data4", ZIGZAG, "xla"),
    ("context4_expert2", ZIGZAG, "xla"),
    ("context4_fsdp2", ZIGZAG, "blockwise"),
]


def _assert_matches(got_loss_grads, single_device_grads):
    """Loss, expert counts, logits and every gradient equal the single-device ones (fp32)."""
    (ref_loss, (ref_counts, ref_logits)), ref = single_device_grads
    (loss, (counts, logits)), got = got_loss_grads
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    np.testing.assert_allclose(np.asarray(counts), np.asarray(ref_counts), atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.slow
@pytest.mark.parametrize("name,layout,impl", CASES)
def test_context_mesh_matches_single_device(name, layout, impl, single_device_grads):
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    got, hlo = _loss_grads(make_mesh(*MESHES[name]), layout, cfg)
    assert "collective-permute" in hlo  # the CCA halo
    assert "all-gather" in hlo  # keys and values
    if MESHES[name][2] == 1 and layout == CONTIGUOUS:
        # without an expert axis no token ever changes device (no regrouping)
        assert "all-to-all" not in hlo
    _assert_matches(got, single_device_grads)


@pytest.mark.slow
def test_pallas_attention_on_a_zigzag_context_mesh_matches_single_device(single_device_grads):
    """attention_impl="pallas" (interpreted on CPU) on context 4 x expert 2 in the zigzag layout:
    each rank's two query chunks against the gathered keys at their traced offsets; loss, logits
    and gradients equal the XLA path's on one device, sliding window and padding / packed documents
    crossing rank boundaries included."""
    cfg, mesh = CFG.replace(attention_impl="pallas"), make_mesh(*MESHES["context4_expert2"])
    _assert_matches(_loss_grads(mesh, ZIGZAG, cfg)[0], single_device_grads)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pallas_attention_on_context_2_equals_the_reference(layout):
    """model.attention.pallas_attention on data 4 x context 2 (the Pallas kernel interpreted, per
    rank at its traced offsets) against the kernel's XLA reference on the whole sequence, in both
    layouts: output and q / k / v gradients, with GQA, packed documents, padding and a window
    crossing the ranks."""
    b, s, nq, nkv, hd = 8, 32, 4, 2, 16
    r = np.random.default_rng(5)
    q, do = (jnp.asarray(r.normal(size=(b, s, nq, hd)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(r.normal(size=(b, s, nkv, hd)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.cumsum(r.random((b, s)) < 0.1, axis=1), jnp.int32)
    mask = jnp.ones((b, s), jnp.int32).at[1, :20].set(0)
    kw = dict(scale=0.25, sliding_window=12)
    mesh = make_mesh(4, 1, 1, 2)

    def value_and_grads(attn):
        def fn(q, k, v, seg, mask, do):
            out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg, mask), q, k, v)
            return (out, *vjp(do))

        return jax.jit(fn).lower(q, k, v, seg, mask, do).compile(compiler_options=FAST_COMPILE)

    ref = value_and_grads(
        lambda q, k, v, seg, m: reference_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg, key_mask=m, **kw
        )
    )
    got = value_and_grads(
        lambda q, k, v, seg, m: pallas_attention(
            q, k, v, segment_ids=seg, key_mask=m, mesh=mesh, layout=layout, **kw
        )
    )
    # The inputs in the layout's storage order, the outputs back in position order.
    stored = lambda x: jax.device_put(to_layout(x, layout, 2), batch_sharding(mesh))
    want = ref(q, k, v, seg, mask, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got(*map(stored, (q, k, v, seg, mask, do))), want):
        g = from_layout(jnp.asarray(g), layout, 2)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, err_msg=name)


@functools.cache
def _start(steps):
    """(tx, balancing config, lr schedule, initial state): one initial state for every run, created
    once on one device by one jitted program (FAST_COMPILE, not op by op; each run only places it
    on its mesh: no sharded init program to compile)."""
    c = base_config()
    c.optim.warmup_steps = 2
    tx = make_optimizer(c, total_steps=steps)
    bc = bal.BalancingConfig(lr=1e-2)
    key = jax.random.key(0)
    init = jax.jit(lambda k: create_train_state(CFG, tx, bc, k)).lower(key).compile(compiler_options=FAST_COMPILE)
    return tx, bc, lr_schedule(c, steps), init(key)


def _train(mesh, steps, layout=CONTIGUOUS):
    """`steps` train steps of the real train step; (losses, grad norms, final state)."""
    tx, bc, schedule, state = _start(steps)
    step = make_train_step(CFG, tx, bc, schedule, mesh=mesh, context_layout=layout)
    if mesh is None:
        step, put = jax.jit(step), jnp.asarray
    else:
        shardings = state_shardings(state, mesh)
        state = jax.device_put(state, shardings)
        step = jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None))
        put = lambda x: jax.device_put(x, batch_sharding(mesh))
    losses, norms, compiled = [], [], None
    for i in range(steps):
        r = np.random.default_rng(100 + i)
        ids = r.integers(3, CFG.vocab_size, size=(B, S + 1)).astype(np.int32)
        batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((B, S), np.float32)}
        batch = jax.tree.map(put, batch)
        if compiled is None:  # run for a few steps, like the file's other programs: FAST_COMPILE
            compiled = step.lower(state, batch).compile(compiler_options=FAST_COMPILE)
        state, m = compiled(state, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, norms, state


STEPS = 20


@pytest.fixture(scope="module")
def single_device_run():
    return _train(None, STEPS)


def _check_tracks(run, ref):
    """20 steps' losses within 1e-4 of one device's, the first loss and gradient norm within 1e-5,
    the balancing biases within 1e-6."""
    (losses, norms, state), (ref_losses, ref_norms, ref_state) = run, ref
    assert abs(losses[0] - ref_losses[0]) < 1e-5
    assert abs(norms[0] - ref_norms[0]) < 1e-5 * max(1.0, ref_norms[0])
    np.testing.assert_allclose(losses, ref_losses, atol=1e-4)
    np.testing.assert_allclose(
        bal.get_balancing_biases(state.variables), bal.get_balancing_biases(ref_state.variables), atol=1e-6
    )


@pytest.mark.slow
def test_zigzag_train_steps_track_single_device(single_device_run):
    """The real train step with mesh.context_layout "zigzag" on data=2 x context=4 (the step
    permutes the batch into the layout itself)."""
    _check_tracks(_train(make_mesh(2, 1, 1, 4), STEPS, ZIGZAG), single_device_run)


@pytest.mark.slow
def test_train_steps_track_single_device_and_checkpoints_move_between_context_sizes(
    tmp_path, single_device_run
):
    steps = STEPS
    mesh = make_mesh(2, 1, 2, 2)
    run = _train(mesh, steps)
    _check_tracks(run, single_device_run)
    state = run[2]

    # Saved with context=2, restored with context=1 (data=8), saved again and restored with
    # context=2: every array comes back bit for bit (params are never split over context).
    def save_restore(workdir, tree, to_mesh):
        ck = Checkpointer(str(workdir), async_save=False)
        ck.save(steps, tree, {}, {})
        ck.wait()
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            tree,
            state_shardings(tree, to_mesh),
        )
        restored = ck.restore(steps, target)[0]
        ck.close()
        return restored

    one = save_restore(tmp_path / "c2", state, make_mesh(8, 1, 1, 1))
    back = save_restore(tmp_path / "c1", one, mesh)
    for a, b, c in zip(jax.tree.leaves(state), jax.tree.leaves(one), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(a))
    assert dict(back.params["layers"]["self_attn"]["q_proj"]["kernel"].sharding.mesh.shape)["context"] == 2


@pytest.mark.slow
def test_cli_trains_with_a_context_axis(tmp_path):
    """`python -m zaya_jax.train` on 8 devices with data=4 x context=2 and batch 4 (one sequence per
    data rank, split over two context ranks; each block's gradients reduced in the backward), and in
    the zigzag layout on data=2 x context=4, trains,
    evaluates and checkpoints with the losses of the same run on 4 devices without a context axis.
    The batch checks (batch size, ramp) divide by the devices that split rows (8 / context), and
    eval.batch_size 2 is rounded up to the 4 row devices, as on data=4. One block: each of the three
    runs compiles its mesh's programs (never cached across processes), and nothing checked here
    depends on the depth."""
    args = ["--config.train.steps=3", "--config.train.batch_size=4", "--config.eval.batch_size=2"]
    args += ["--config.model.num_hidden_layers=1"]
    # Block gradients reduced in the backward (train.overlap_grad_reduce, GPU meshes' default), here
    # against the run that reduces them after the loop.
    overlap = "--config.train.overlap_grad_reduce=on"
    run_train(tmp_path / "c2", *args, "--config.mesh.context=2", "--config.mesh.data=4", overlap, devices=8)
    run_train(tmp_path / "c1", *args, "--config.mesh.data=4", devices=4)
    zigzag = ["--config.mesh.context=4", "--config.mesh.context_layout=zigzag", "--config.mesh.data=2"]
    run_train(tmp_path / "zz", *args, *zigzag, devices=8)
    c1 = train_losses(tmp_path / "c1")
    for name in ("c2", "zz"):
        losses = train_losses(tmp_path / name)
        assert sorted(losses) == [1, 2, 3]
        np.testing.assert_allclose([losses[s] for s in losses], [c1[s] for s in losses], atol=1e-4)
        assert os.path.isdir(tmp_path / name / "checkpoints" / "3")
    evals = [[r["eval_loss"] for r in read_metrics(str(tmp_path / w), split="eval")] for w in ("c2", "c1")]
    assert len(evals[0]) == 1 and np.allclose(*evals, atol=1e-4), evals


def test_context_layout_config_errors():
    """A layout that is not one is an error naming the key, and so is a sequence that does not
    split into the zigzag layout's 2R chunks."""
    c = base_config()
    c.mesh.context_layout = "striped"
    with pytest.raises(ValueError, match=r"config.mesh.context_layout: must be one of contiguous, zigzag"):
        validate(c)
    c.mesh.context_layout = ZIGZAG
    validate(c)
    c.mesh.context, c.train.seq_len = 4, 36  # a multiple of R = 4, not of the 2R = 8 chunks
    with pytest.raises(ValueError, match=r"config.train.seq_len=36: .* multiple of 8 \(the zigzag"):
        check_batch_divides(c, 8)
