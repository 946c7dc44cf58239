"""Tokenizing a stream of documents on N processes, in input order, with a progress line.

Texts are cut into batches of `batch` documents; with workers > 1 each batch is encoded by one of
N spawned processes (each holds its own copy of the tokenizer) and the results are taken back in
submission order, at most 2 N batches in flight, so the output is exactly what one process gives
and memory stays bounded however large the input. Token ids come back as int32 arrays (cheaper to
pass between processes than lists).
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from zaya_jax.tokenizer import Tokenizer

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tok
    # Ctrl-C reaches the whole process group: the main process handles it and ends the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in tok.encode_batch(texts)]


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _encode(_worker_tokenizer, texts)


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_documents(
    texts: Iterable[str], tok: Tokenizer, *, workers: int = 1, batch: int = 256
) -> Iterator[np.ndarray]:
    """The token ids of each text (no EOS added), in input order."""
    if workers <= 1:
        for b in _batches(texts, batch):
            yield from _encode(tok, b)
        return
    # spawn, not fork: a forked copy of an HF tokenizer's thread pool can deadlock.
    ctx = multiprocessing.get_context("spawn")
    # The workers start with SIGINT ignored (SIG_IGN outlives exec): a Ctrl-C to the process group
    # while one still imports would print its traceback. A Ctrl-C in the milliseconds the pool
    # takes to start goes unseen (the next one is not); once up, the main process takes it.
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok,))
    finally:
        signal.signal(signal.SIGINT, handler)
    with pool:
        pending: collections.deque = collections.deque()
        for b in _batches(texts, batch):
            pending.append(pool.apply_async(_encode_in_worker, (b,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


class Progress:
    """One stderr line every `every` seconds (and at the end): documents, tokens, tokens/s, and
    the ETA from the fraction of input bytes read (`position()`, 0..1)."""

    def __init__(self, position: Callable[[], float], *, every: float = 2.0, out=None):
        self.position, self.every, self.out = position, every, out or sys.stderr
        self.docs = self.tokens = 0
        self.started = self._last = time.monotonic()

    def add(self, num_tokens: int) -> None:
        self.docs += 1
        self.tokens += num_tokens
        if time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.report()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        done = min(max(self.position(), 0.0), 1.0)
        eta = elapsed * (1 - done) / done if done > 0 else math.inf
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if math.isfinite(eta) else "?"
        return (
            f"prepare: {self.docs:,} docs, {self.tokens:,} tokens, {self.tokens / elapsed:,.0f} tokens/s, "
            f"input {done:.0%}, ETA {eta_text}"
        )

    def report(self) -> None:
        # one write, line and newline: a signal raising between print's two writes would leave the
        # line open and the interrupt's line would follow on it
        self.out.write(self.line() + "\n")
        self.out.flush()


__all__ = ["Progress", "encode_documents"]
