"""Chunked cross-entropy (zaya_jax/model/loss.py) equals the plain full-logits loss, values and grads,
and its gradients cost 3 head matmuls per chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.loss import (
    LOSS_CHUNK_TOKENS,
    chunk_positions,
    chunked_cross_entropy,
    chunked_token_logprobs,
    token_cross_entropy,
)


@pytest.mark.parametrize("s, chunk", [(16, 4), (13, 5), (7, 64)])
def test_chunked_equals_full(s, chunk):
    r = np.random.default_rng(s)
    b, d, v = 2, 8, 11
    hidden = jnp.asarray(r.normal(size=(b, s, d)), jnp.float32)
    w = jnp.asarray(r.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(r.integers(0, v, size=(b, s)), jnp.int32)
    mask = jnp.asarray(r.random((b, s)) > 0.3, jnp.float32)

    def full(hidden, w):
        return jnp.sum(token_cross_entropy(hidden @ w, targets) * mask)

    head = lambda p, h: h @ p

    def chunked(hidden, w):
        return chunked_cross_entropy(hidden, targets, mask, head, w, chunk)[0]

    np.testing.assert_allclose(chunked(hidden, w), full(hidden, w), rtol=1e-6)
    assert float(chunked_cross_entropy(hidden, targets, mask, head, w, chunk)[1]) == float(mask.sum())
    for a, e in zip(jax.grad(chunked, (0, 1))(hidden, w), jax.grad(full, (0, 1))(hidden, w)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_bf16_grads_equal_full(logits_dtype):
    """bf16 hidden and head weights, the head's logits fp32 (as LMHead's) or bf16: the fused
    gradients come out in bf16 and match the full-logits ones."""
    r = np.random.default_rng(0)
    b, s, d, v, chunk = 2, 24, 16, 37, 7
    hidden = jnp.asarray(r.normal(size=(b, s, d)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(d, v)) / 4, jnp.bfloat16)
    targets = jnp.asarray(r.integers(0, v, size=(b, s)), jnp.int32)
    mask = jnp.asarray(r.random((b, s)) > 0.3, jnp.float32)
    head = lambda p, h: jnp.einsum("...d,dv->...v", h, p, preferred_element_type=logits_dtype)
    full = lambda hidden, w: jnp.sum(token_cross_entropy(head(w, hidden), targets) * mask)
    chunked = lambda hidden, w: chunked_cross_entropy(hidden, targets, mask, head, w, chunk)[0]
    value, grads = jax.value_and_grad(chunked, (0, 1))(hidden, w)
    want_value, want_grads = jax.value_and_grad(full, (0, 1))(hidden, w)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    # Measured (seeds 0-4): d hidden identical; d w within 0.031 = 1 bf16 ulp at |d w| ~5, at most
    # 0.0075 of max |d w| (each chunk's d w is rounded to bf16 by the head's vjp before the fp32 sum,
    # the full one once).
    for a, e in zip(grads, want_grads):
        assert a.dtype == e.dtype == jnp.bfloat16
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        np.testing.assert_allclose(a, e, rtol=1e-2, atol=2e-2 * np.abs(e).max())


def test_chunked_gradients_cost_three_head_matmuls():
    """value_and_grad of the chunked loss lowers to 3 dot_generals, each [B, chunk, d] x [d, V] sized,
    all in the one scan over chunks (its body appears once in the text): 6 N d V FLOPs. The loss
    value is used as in the train step; a checkpointed chunk loss would lower to 4 (the forward
    scan's head matmul for the value; the backward scan's recompute and 2 gradient matmuls): 8 N d V.
    (Under jax.grad alone the forward's matmul is dead code and both lower to 3.)"""
    b, s, d, v, chunk = 2, 64, 32, 48, 16
    hidden, w = jnp.ones((b, s, d)), jnp.full((d, v), 0.01)
    targets, mask = jnp.zeros((b, s), jnp.int32), jnp.ones((b, s))

    def loss(hidden, w):
        return chunked_cross_entropy(hidden, targets, mask, lambda p, h: h @ p, w, chunk)[0]

    text = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(hidden, w).as_text()
    assert text.count("stablehlo.dot_general") == 3


def test_token_cross_entropy_matches_log_softmax():
    logits = jnp.array([[[1.0, 2.0, 3.0]]])
    np.testing.assert_allclose(
        token_cross_entropy(logits, jnp.array([[2]])), -jax.nn.log_softmax(logits)[..., 2], rtol=1e-6
    )


@pytest.mark.parametrize("s, chunk", [(16, 4), (13, 5), (3, 64)])
def test_chunked_token_logprobs_equal_log_softmax(s, chunk):
    r = np.random.default_rng(s)
    b, d, v = 3, 8, 11
    hidden = jnp.asarray(r.normal(size=(b, s, d)), jnp.float32)
    w = jnp.asarray(r.normal(size=(d, v)), jnp.float32)
    logits = hidden @ w
    targets = r.integers(0, v, size=(b, s))
    targets[0] = np.argmax(np.asarray(logits[0]), -1)  # one row of greedy targets
    logp, greedy = chunked_token_logprobs(hidden, jnp.asarray(targets, jnp.int32), lambda h: h @ w, chunk)
    want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(greedy, targets == np.argmax(np.asarray(logits), -1))
    assert bool(greedy[0].all()) and logp.shape == greedy.shape == (b, s)


def test_chunk_positions_spread_the_chunk_tokens_over_the_rows():
    """A loss chunk holds LOSS_CHUNK_TOKENS tokens per device whatever the rows: 4 sequences get a
    quarter of the positions, more rows than tokens one position each."""
    assert chunk_positions(1) == LOSS_CHUNK_TOKENS
    assert chunk_positions(4) == LOSS_CHUNK_TOKENS // 4
    assert chunk_positions(2 * LOSS_CHUNK_TOKENS) == 1
    assert chunk_positions(3, tokens=12) == 4
