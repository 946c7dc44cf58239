"""Tests for zaya_jax.optim.schedules: WSD / cosine / constant curve shapes and
argument validation."""

import numpy as np
import pytest

from zaya_jax.optim.schedules import (
    make_schedule,
    warmup_constant,
    warmup_cosine,
    warmup_stable_decay,
)


def _curve(schedule, n):
    return np.array([float(schedule(i)) for i in range(n)])


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_shape(shape):
    peak, total, warmup, decay = 2e-3, 50, 10, 15
    lr = _curve(
        warmup_stable_decay(peak, total, warmup, decay_steps=decay, final_lr_fraction=0.1, decay_shape=shape),
        total + 5,
    )
    # Warmup: linear ramp from ~0 (first step peak/warmup) up to peak.
    np.testing.assert_allclose(lr[:warmup], peak * np.arange(1, warmup + 1) / warmup, rtol=1e-6)
    assert lr[0] == pytest.approx(peak / warmup, rel=1e-6)
    # Stable: exactly peak.
    np.testing.assert_allclose(lr[warmup : total - decay], peak, rtol=1e-6)
    # Decay: strictly decreasing, below peak, ends at the final fraction on the last step.
    d = lr[total - decay : total]
    assert np.all(np.diff(d) < 0) and d[0] < peak
    np.testing.assert_allclose(lr[total - 1], 0.1 * peak, rtol=1e-5)
    # After the end: stays at the final value.
    np.testing.assert_allclose(lr[total:], 0.1 * peak, rtol=1e-5)
    # Whole curve: non-decreasing then non-increasing.
    assert np.all(np.diff(lr[: total - decay]) >= 0)
    assert np.all(np.diff(lr[warmup - 1 :]) <= 1e-12)


def test_wsd_decay_shapes_differ_as_expected():
    kw = dict(peak_lr=1.0, total_steps=20, warmup_steps=0, decay_steps=10)
    mid = 14  # p = 0.5
    lin = float(warmup_stable_decay(**kw, decay_shape="linear")(mid))
    cos = float(warmup_stable_decay(**kw, decay_shape="cosine")(mid))
    sq = float(warmup_stable_decay(**kw, decay_shape="sqrt")(mid))
    assert lin == pytest.approx(0.5)
    assert cos == pytest.approx(0.5)
    assert sq == pytest.approx(1 - np.sqrt(0.5))
    early = 11  # p = 0.2: cosine stays higher than linear early on
    assert float(warmup_stable_decay(**kw, decay_shape="cosine")(early)) > 0.8


def test_wsd_decay_fraction_and_no_warmup():
    lr = _curve(warmup_stable_decay(1.0, 100, 0, decay_fraction=0.2), 100)
    assert lr[0] == pytest.approx(1.0)
    np.testing.assert_allclose(lr[:80], 1.0)
    assert lr[80] < 1.0 and lr[99] == pytest.approx(0.0, abs=1e-7)


def test_warmup_cosine_shape():
    peak, total, warmup = 1.0, 40, 5
    lr = _curve(warmup_cosine(peak, total, warmup, final_lr_fraction=0.05), total)
    np.testing.assert_allclose(lr[:warmup], np.arange(1, warmup + 1) / warmup, rtol=1e-6)
    assert np.all(np.diff(lr[warmup - 1 :]) < 0)
    np.testing.assert_allclose(lr[-1], 0.05, rtol=1e-5)
    # Half-way through the decay the cosine is at the mean of peak and final.
    decay = total - warmup
    half = warmup - 1 + decay / 2
    assert float(warmup_cosine(peak, total, warmup, 0.05)(half)) == pytest.approx(0.525, rel=1e-5)


def test_constant_and_dispatch():
    lr = _curve(warmup_constant(3.0, 10, 2), 12)
    np.testing.assert_allclose(lr, [1.5] + [3.0] * 11)
    a = make_schedule("wsd", peak_lr=1.0, total_steps=10, warmup_steps=2, decay_steps=3)
    b = warmup_stable_decay(1.0, 10, 2, decay_steps=3)
    np.testing.assert_allclose(_curve(a, 12), _curve(b, 12))
    c = make_schedule("cosine", peak_lr=1.0, total_steps=10, warmup_steps=2)
    np.testing.assert_allclose(_curve(c, 12), _curve(warmup_cosine(1.0, 10, 2), 12))


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("nope", dict(peak_lr=1.0, total_steps=10, warmup_steps=0)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=-1, decay_steps=2)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=11, decay_steps=0)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=5, decay_steps=6)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=0)),  # no decay given
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=0, decay_steps=2, decay_fraction=0.2)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=0, decay_fraction=1.5)),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=0, decay_steps=2, decay_shape="exp")),
        ("wsd", dict(peak_lr=1.0, total_steps=10, warmup_steps=0, decay_steps=2, final_lr_fraction=-0.1)),
        ("wsd", dict(peak_lr=-1.0, total_steps=10, warmup_steps=0, decay_steps=2)),
        ("wsd", dict(peak_lr=1.0, total_steps=0, warmup_steps=0, decay_steps=0)),
        ("wsd", dict(peak_lr=1.0, total_steps=10.5, warmup_steps=0, decay_steps=2)),
        ("cosine", dict(peak_lr=1.0, total_steps=10, warmup_steps=10)),
        ("cosine", dict(peak_lr=1.0, total_steps=10, warmup_steps=2, bogus=1)),
        ("constant", dict(peak_lr=1.0, total_steps=10, warmup_steps=20)),
    ],
)
def test_bad_args_raise(name, kwargs):
    with pytest.raises(ValueError):
        make_schedule(name, **kwargs)
