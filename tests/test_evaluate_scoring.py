"""Batched, bucketed scoring (zaya_jax/evaluate/scoring.py) equals scoring each row alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.evaluate.scoring import Request, Scorer, sequence_buckets
from zaya_jax.generate import generate
from zaya_jax.model import ZayaConfig, ZayaForCausalLM, init_variables


def test_sequence_buckets():
    assert sequence_buckets(2048, 64) == (64, 128, 256, 512, 1024, 2048)
    assert sequence_buckets(40, 8) == (8, 16, 32, 40)
    assert sequence_buckets(40, 5) == (8, 16, 32, 40)  # rounded up to a power of two
    assert sequence_buckets(8, 64) == (8,)
    with pytest.raises(ValueError, match="max_len"):
        sequence_buckets(0)


@functools.partial(jax.jit, static_argnums=0)
def full_logits(cfg, variables, ids):
    return ZayaForCausalLM(cfg).apply(variables, ids).logits


@pytest.fixture(scope="module")
def model():
    cfg = ZayaConfig.tiny(vocab_size=61, num_hidden_layers=2)
    return cfg, jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(3))  # one program


def alone(cfg, variables, r: Request):
    """The scored log-likelihood of one request from a plain unpadded forward pass."""
    logits = full_logits(cfg, variables, jnp.asarray(r.inputs)[None])[0]
    logp = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(r.targets)), r.targets]
    greedy = np.asarray(jnp.argmax(logits, -1)) == r.targets
    return logp[r.score_from :].sum(), bool(greedy[r.score_from :].all())


def test_scores_equal_unpadded_rows_and_compile_once_per_bucket(model):
    cfg, variables = model
    r = np.random.default_rng(0)
    lengths = [1, 8, 9, 17, 40, 40, 7, 7, 1]  # every bucket (8, 16, 32, 40) and its edges
    requests = []
    for n in lengths:
        tokens = r.integers(3, 61, size=n + 1)
        requests.append(Request.from_sequence(tokens, int(r.integers(1, n + 1))))
    scorer = Scorer(cfg, batch_size=3, max_len=40, min_bucket=8)
    scores = scorer.score(variables, requests)
    for req, s in zip(requests, scores):
        logp, greedy = alone(cfg, variables, req)
        np.testing.assert_allclose(s.logprob, logp, rtol=1e-5, atol=1e-5)
        assert s.greedy == greedy and s.tokens == len(req.targets) - req.score_from
    assert scorer.num_traces <= len(scorer.buckets) == 4
    before = scorer.num_traces
    scorer.score(variables, requests[::-1][:5])  # new batch compositions, same buckets: no new compilation
    assert scorer.num_traces == before


def test_greedy_flag_on_the_models_own_continuation(model):
    cfg, variables = model
    seq = [5, 9, *generate(cfg, variables, [[5, 9]], 6)[0]]  # the model's own greedy continuation
    scorer = Scorer(cfg, batch_size=2, max_len=16, min_bucket=8)
    greedy, other = scorer.score(
        variables, [Request.from_sequence(seq, 6), Request.from_sequence(seq[:-1] + [0], 6)]
    )
    assert greedy.greedy and not other.greedy


def test_bad_requests_are_rejected(model):
    cfg, variables = model
    with pytest.raises(ValueError, match="same non-zero length"):
        Request(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="score_from"):
        Request(np.array([1, 2]), np.array([1, 2]), score_from=2)
    scorer = Scorer(cfg, batch_size=2, max_len=8, min_bucket=8)
    with pytest.raises(ValueError, match="longer than max_len=8"):
        scorer.score(variables, [Request.from_sequence(range(3, 13), 2)])
    assert scorer.num_traces == 0  # rejected before any compute
    with pytest.raises(ValueError, match="batch_size"):
        Scorer(cfg, batch_size=0)
