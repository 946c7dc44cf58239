"""Chunked cross-entropy (zaya_jax/model/loss.py) equals the plain full-logits loss, values and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.model.loss import chunked_cross_entropy, chunked_token_logprobs, token_cross_entropy


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

    def chunked(hidden, w):
        return chunked_cross_entropy(hidden, targets, mask, lambda h: h @ w, chunk)[0]

    np.testing.assert_allclose(chunked(hidden, w), full(hidden, w), rtol=1e-6)
    assert float(chunked_cross_entropy(hidden, targets, mask, lambda h: h @ w, chunk)[1]) == float(mask.sum())
    for a, e in zip(jax.grad(chunked, (0, 1))(hidden, w), jax.grad(full, (0, 1))(hidden, w)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


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
