"""Blockwise attention (zaya_jax/kernels/blockwise_attention.py) against xla_attention +
attention_allowed, values and gradients in fp32 on every mask; the key blocks it skips (counted by
its loop, and its dots in the compiled HLO against the dense schedule's); the model and the train
CLI with attention_impl="blockwise" against "xla", on one device and under mesh.context=2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.context_batch import CFG, padded_batch
from support.train_runs import run_train, train_losses
from support.xla_env import FAST_COMPILE

from zaya_jax.analysis import hlo
from zaya_jax.kernels import attention_choice, block_sizes
from zaya_jax.kernels.blockwise_attention import blockwise_attention, visited_blocks
from zaya_jax.kernels.xla_attention import attention_allowed, xla_attention
from zaya_jax.model import BALANCING, ZayaForCausalLM, init_variables
from zaya_jax.model.loss import token_cross_entropy
from zaya_jax.parallel import make_mesh
from zaya_jax.parallel.sharding import batch_sharding

B, N, K, H, BLOCK = 2, 4, 2, 8, 16
SCALE = H**-0.5


def _inputs(s: int, t: int, seed: int = 0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, s, N, H)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, t, K, H)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, t, K, H)), jnp.float32)
    return q, k, v


def _arange(offset: int, n: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(offset, offset + n, dtype=jnp.int32), (B, n))


def _padding(t: int) -> jax.Array:
    """Row 0 left-padded by 20 (its first 20 queries see no key at all), row 1 right-padded."""
    pos = np.arange(t)
    return jnp.asarray(np.stack([pos >= 20, pos < t - 7]), jnp.int32)


def _segments(n: int, offset: int = 0) -> jax.Array:
    """Packed documents: row 0 breaks at 11 and 40, row 1 at 33 (global positions)."""
    pos = np.arange(offset, offset + n)
    return jnp.asarray(np.stack([(pos >= 11).astype(int) + (pos >= 40), pos >= 33]), jnp.int32)


# name -> (S, T, query offset, masks); S < T with an offset is a context rank's chunk against the
# gathered keys (rank 1 of 2, and rank 1 of 4).
CASES = {
    "causal": (64, 64, 0, {}),
    "window": (64, 64, 0, {"sliding_window": 10}),
    "padding": (64, 64, 0, {"key_mask_bt": _padding(64)}),
    "segments": (64, 64, 0, {"q_segment_bs": _segments(64), "kv_segment_bt": _segments(64)}),
    "context_chunk": (32, 64, 32, {}),
    "context_chunk_window_padding": (
        16,
        64,
        16,
        {"sliding_window": 12, "key_mask_bt": _padding(64)},
    ),
    "context_chunk_segments": (
        32,
        64,
        32,
        {"q_segment_bs": _segments(32, 32), "kv_segment_bt": _segments(64)},
    ),
    "ragged_lengths_window": (50, 50, 0, {"sliding_window": 20}),
    "all_keys_masked": (32, 32, 0, {"key_mask_bt": jnp.zeros((B, 32), jnp.int32)}),
}


def _pair(s: int, t: int, offset: int, masks: dict):
    q_pos, kv_pos = _arange(offset, s), _arange(0, t)

    def reference(q, k, v):
        return xla_attention(q, k, v, attention_allowed(q_pos, kv_pos, **masks), SCALE)

    def blockwise(q, k, v):
        return blockwise_attention(
            q, k, v, q_pos_bs=q_pos, kv_pos_bt=kv_pos, scale=SCALE, block_q=BLOCK, block_k=BLOCK, **masks
        )

    return reference, blockwise


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_xla_attention(name):
    s, t, offset, masks = CASES[name]
    q, k, v = _inputs(s, t)
    reference, blockwise = _pair(s, t, offset, masks)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, s, N, H)), jnp.float32)

    def grads(fn):
        return jax.jit(jax.value_and_grad(lambda *x: jnp.sum(fn(*x) * weights), argnums=(0, 1, 2)))(q, k, v)

    got, want = jax.jit(blockwise)(q, k, v), jax.jit(reference)(q, k, v)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    (_, got_grads), (_, want_grads) = grads(blockwise), grads(reference)
    for arg, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=f"d{arg}")


@pytest.mark.parametrize(
    "name, visited",
    [
        ("causal", 10),  # 4 query blocks x the key blocks up to their own: 1 + 2 + 3 + 4
        ("window", 7),  # a 10-position window reaches one block back: 1 + 2 + 2 + 2
        ("context_chunk", 7),  # rank 1's blocks (query blocks 2 and 3 of 4): 3 + 4
        ("context_chunk_window_padding", 2),  # one query block: its own key block and the one before
        ("all_keys_masked", 0),
    ],
)
def test_entirely_masked_key_blocks_are_skipped(name, visited):
    s, t, offset, masks = CASES[name]
    q, k, v = _inputs(s, t)
    count = visited_blocks(
        q, k, v, q_pos_bs=_arange(offset, s), kv_pos_bt=_arange(0, t), scale=SCALE, block_q=BLOCK,
        block_k=BLOCK, **masks,
    )  # fmt: skip
    assert int(count) == visited


def test_segments_skip_blocks_of_other_documents():
    """Documents aligned to the blocks: each query block reads only its own key block."""
    q, k, v = _inputs(64, 64)
    pos, seg = _arange(0, 64), jnp.broadcast_to(jnp.arange(64) // 16, (B, 64))
    count = visited_blocks(
        q, k, v, q_pos_bs=pos, kv_pos_bt=pos, q_segment_bs=seg, kv_segment_bt=seg, scale=SCALE,
        block_q=BLOCK, block_k=BLOCK,
    )  # fmt: skip
    assert int(count) == 4


def test_block_skipping_in_the_compiled_hlo():
    """Forward + backward compiled: the dense schedule's dots are [S, T]-sized; blockwise's are
    [block, block]-sized, each inside the per-query-block loop (runs = the 4 query blocks) and
    the key-block loop, whose trip count XLA cannot know (it is read from the positions). Run for
    the 10 visited blocks of the causal triangle, that is fewer dot FLOPs than the dense schedule,
    though each visited block does 7 dots (the backward recomputes the logits) to the dense 6."""
    s = 64
    reference, blockwise = _pair(s, s, 0, {})
    q, k, v = _inputs(s, s)

    def dots(fn):
        step = jax.jit(jax.value_and_grad(lambda *x: jnp.sum(fn(*x)), argnums=(0, 1, 2)))
        return [w for w in hlo.work(step.lower(q, k, v).compile().as_text()) if w.kind == "dot"]

    dense, blocked = dots(reference), dots(blockwise)
    pairs = (s // BLOCK) ** 2
    assert len(dense) == 6 and all(w.runs.main == 1 for w in dense)
    assert len(blocked) == 7
    assert {w.flops for w in blocked} == {dense[0].flops / pairs}  # one block pair, nothing S x T
    assert {w.runs.main for w in blocked} == {s // BLOCK}  # the key-block loop's trip count: unknown
    visited = int(visited_blocks(q, k, v, q_pos_bs=_arange(0, s), kv_pos_bt=_arange(0, s), scale=SCALE,
                                 block_q=BLOCK, block_k=BLOCK))  # fmt: skip
    executed = sum(w.flops for w in blocked) / (s // BLOCK) * visited
    assert visited == 10 and executed < sum(w.flops for w in dense)


def test_auto_picks_blockwise_off_gpus_from_the_threshold():
    long, short = block_sizes.BLOCKWISE_AUTO_MIN_SEQ, block_sizes.BLOCKWISE_AUTO_MIN_SEQ - 1
    assert attention_choice("auto", "cpu", long) == "blockwise"
    assert attention_choice("auto", "cpu", short) == "xla"
    assert attention_choice("auto", "cuda", long) == attention_choice("auto", "rocm", short) == "pallas"
    assert attention_choice("blockwise", "cuda", 16) == "blockwise"
    assert attention_choice("xla", "cpu", long) == "xla"


def _model_loss_grads(impl: str, mesh):
    """Loss and gradients of the tiny model (a sliding-window block, padding, packed documents)."""
    cfg = CFG.replace(attention_impl=impl)
    model = ZayaForCausalLM(cfg, mesh)
    variables = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(1))  # one program
    batch = jax.tree.map(jnp.asarray, padded_batch())
    if mesh is not None:
        batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), batch)

    def objective(params):
        out = model.apply(
            {"params": params, BALANCING: variables[BALANCING]},
            batch["input_ids"],
            batch["attention_mask"],
            segment_ids=batch["segment_ids"],
        )
        w = batch["attention_mask"].astype(jnp.float32)
        return jnp.sum(token_cross_entropy(out.logits, batch["targets"]) * w) / jnp.sum(w)

    # Each program runs once: FAST_COMPILE (tests/support/xla_env.py) compiles it faster.
    fn = jax.jit(jax.value_and_grad(objective)).lower(variables["params"])
    return fn.compile(compiler_options=FAST_COMPILE)(variables["params"])


@pytest.fixture(scope="module")
def xla_model_grads():
    return _model_loss_grads("xla", None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, (4, 1, 1, 2)], ids=["one_device", "context2"])
def test_model_blockwise_matches_xla(mesh, monkeypatch, xla_model_grads):
    """16-position blocks on 32-token rows: two query and key blocks on one device; per context
    rank one query block against two key blocks, the second skipped on rank 0."""
    monkeypatch.setitem(block_sizes.TABLE, "blockwise_attention", {"block_q": 16, "block_k": 16})
    mesh = None if mesh is None else make_mesh(*mesh)
    want_loss, want = xla_model_grads
    loss, got = _model_loss_grads("blockwise", mesh)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
        err = jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, err_msg=err)


@pytest.mark.slow
def test_cli_blockwise_trains_like_xla(tmp_path):
    """`python -m zaya_jax.train --config.model.attention_impl=blockwise`, without a context axis (one
    device) and with one (data=4 x context=2 on 8 devices), has the losses of the xla run on one
    device (one reference: neither the device count nor a context axis changes them,
    tests/test_context_parallel.py)."""
    # One-device runs: the cheapest programs to compile, and cached across the suite's processes.
    args = ["--config.train.steps=3", "--config.eval.every_steps=3"]
    run_train(tmp_path / "xla", *args, "--config.model.attention_impl=xla", devices=1)
    want = train_losses(tmp_path / "xla")
    for context, devices in ((1, 1), (2, 8)):
        work = tmp_path / f"blockwise_context{context}"
        blockwise = ["--config.model.attention_impl=blockwise", f"--config.mesh.context={context}"]
        run_train(work, *args, *blockwise, devices=devices)
        got = train_losses(work)
        assert sorted(got) == [1, 2, 3]
        np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], atol=1e-4, rtol=1e-5)
