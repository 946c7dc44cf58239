"""Batches of the data pipeline taken and compared key by key."""

import numpy as np

KEYS = {"input_ids", "targets", "loss_mask"}


def take(ds_or_it, n):
    """The first `n` batches of a dataset or iterator."""
    it = iter(ds_or_it)
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    """Two lists of batches with the same KEYS and equal arrays."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y) == KEYS
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
