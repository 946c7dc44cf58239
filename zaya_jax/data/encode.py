"""Tokenizing a stream of documents on N processes, in input order, with a progress line.

Texts are cut into batches of `batch` documents; with workers > 1 each batch is encoded by one of
N spawned processes in turn (each holds its own copy of the tokenizer), one batch in flight per
process, and the results are taken back in submission order, so the output is exactly what one
process gives and memory stays bounded however large the input. Token ids come back as int32 arrays (cheaper to
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

from zaya_jax.data.tokenizer import Tokenizer


def _encode(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, np.int32) for ids in tok.encode_batch(texts)]


def _worker(conn, tok: Tokenizer) -> None:
    """A worker process: batches of texts in, their token arrays (or the exception) out, until
    None comes or the main process is gone."""
    # Ctrl-C reaches the whole process group: the main process handles it and ends the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while (texts := conn.recv()) is not None:
            try:
                conn.send(_encode(tok, texts))
            except Exception as e:  # the main process raises it
                conn.send(e)
    except (EOFError, OSError):  # the main process ended
        pass


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
    procs, conns = _start_workers(tok, workers)
    finished = False
    try:
        in_flight: collections.deque = collections.deque()  # workers, in the order of their batches
        for k, b in enumerate(_batches(texts, batch)):
            if len(in_flight) == workers:  # the oldest batch's worker is this batch's: one each
                yield from _receive(conns[in_flight.popleft()], then_send=(conns[k % workers], b))
            else:
                conns[k % workers].send(b)
            in_flight.append(k % workers)
        while in_flight:
            yield from _receive(conns[in_flight.popleft()])
        finished = True
    finally:
        _stop_workers(procs, conns, finished)


def _receive(conn, then_send: tuple | None = None) -> list[np.ndarray]:
    """A worker's result; `then_send` (conn, batch) goes out before the caller takes its time
    over the result, so that the worker is busy meanwhile."""
    result = conn.recv()
    if then_send is not None:
        then_send[0].send(then_send[1])
    if isinstance(result, Exception):
        raise result
    return result


def _start_workers(tok: Tokenizer, workers: int) -> tuple[list, list]:
    """`workers` spawned processes (spawn, not fork: a forked copy of an HF tokenizer's thread pool
    can deadlock), each with a pipe; at most one batch per worker is in flight, so neither end
    ever waits on a full pipe while the other does. Plain pipes and processes, no
    multiprocessing.Pool: ending them is one SIGKILL each, and no lock is shared with them."""
    ctx = multiprocessing.get_context("spawn")
    # The workers start with SIGINT ignored (SIG_IGN outlives exec): a Ctrl-C to the process group
    # while one still imports would print its traceback. A Ctrl-C in the moment the workers take
    # to start goes unseen (the next one is not); once they are up, the main process takes it.
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    conns, procs = [], []
    try:
        for _ in range(workers):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(theirs, tok), daemon=True)
            proc.start()
            theirs.close()
            conns.append(ours)
            procs.append(proc)
    finally:
        signal.signal(signal.SIGINT, handler)
    return procs, conns


def _stop_workers(procs: list, conns: list, finished: bool) -> None:
    """After the last batch each worker is told to end; after an error or a signal, killed at once."""
    for conn, proc in zip(conns, procs):
        if finished:
            conn.send(None)
        else:
            proc.kill()
    for conn, proc in zip(conns, procs):
        proc.join(timeout=10)
        conn.close()


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
