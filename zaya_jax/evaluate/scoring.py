"""Batched, jit-compiled log-likelihood scoring: the engine under perplexity and multiple choice.

A `Request` is one row the model reads: inputs [n] and targets [n] (targets[i] follows inputs[i]),
scored from position `score_from` on. `Scorer.score(requests)` returns per request the summed
log-likelihood of its scored targets, whether every one of them is the model's argmax, and how
many there are.

Batching. Requests are sorted by length (longest first, so a batch holds similar lengths), cut into
batches of `batch_size` rows, and each batch is right-padded to the smallest *bucket* that fits:
powers of two from `min_bucket` up to `max_len`, plus `max_len`. The batch dimension is always
`batch_size` (a short last batch gets all-padding rows), so the step compiles once per bucket, at
most ~log2(max_len / min_bucket) + 1 times whatever the data. Padding is right-sided and masked
(attention_mask 0, never scored): with causal attention and the causal CCA convolution a real token
never sees a later pad, so each row's result equals scoring it alone, unpadded.

Mesh. With a mesh the rows are split over all its axes (batch_size must divide evenly), params are
laid out by the training sharding table and the MoE runs expert-parallel; per-row results come back
replicated, so every process sees all of them. Every process must pass the same requests.
Evaluation is dropless: an expert-capacity limit from the training config is switched off, since a
dropped token would make a score depend on what else shares its batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.hf.pretrained import variable_shardings
from zaya_jax.model import ZayaConfig, ZayaForCausalLM
from zaya_jax.model.loss import chunked_token_logprobs
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.sharding import batch_sharding


@dataclasses.dataclass(frozen=True)
class Request:
    """inputs, targets: int [n] (targets[i] is the token after inputs[i]); targets[score_from:] count."""

    inputs: np.ndarray
    targets: np.ndarray
    score_from: int = 0

    def __post_init__(self):
        if len(self.inputs) != len(self.targets) or len(self.inputs) < 1:
            raise ValueError(
                f"Request: inputs ({len(self.inputs)}) and targets ({len(self.targets)}) must have the "
                "same non-zero length"
            )
        if not 0 <= self.score_from < len(self.targets):
            raise ValueError(f"Request: score_from={self.score_from} outside [0, {len(self.targets)})")

    @classmethod
    def from_sequence(cls, tokens: Sequence[int], num_scored: int) -> Request:
        """Reads tokens[:-1], scores the last `num_scored` tokens of `tokens`."""
        tokens = np.asarray(tokens, np.int32)
        return cls(tokens[:-1], tokens[1:], len(tokens) - 1 - num_scored)


@dataclasses.dataclass(frozen=True)
class Score:
    logprob: float  # sum of log p(target) over the scored targets, nats
    greedy: bool  # every scored target is the argmax
    tokens: int  # number of scored targets


def length_sorted_batches(requests: Sequence[Request], batch_size: int) -> list[list[int]]:
    """Request indices, longest first, cut into batches of `batch_size` (the last may be shorter)."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].inputs))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def right_padded_batch(
    requests: Sequence[Request], rows: Sequence[int], num_rows: int, width: int
) -> dict[str, np.ndarray]:
    """requests[rows] as [num_rows, width] int32 arrays, right padded: input_ids, targets,
    attention_mask (1 on real tokens) and score_mask (bool, the scored targets); rows past
    len(rows) are all padding."""
    ids = np.zeros((num_rows, width), np.int32)
    targets = np.zeros((num_rows, width), np.int32)
    attention = np.zeros((num_rows, width), np.int32)
    scored = np.zeros((num_rows, width), bool)
    for j, i in enumerate(rows):
        r = requests[i]
        n = len(r.inputs)
        ids[j, :n], targets[j, :n], attention[j, :n] = r.inputs, r.targets, 1
        scored[j, r.score_from : n] = True
    return {"input_ids": ids, "targets": targets, "attention_mask": attention, "score_mask": scored}


def sequence_buckets(max_len: int, min_bucket: int = 64) -> tuple[int, ...]:
    """Powers of two in [min_bucket, max_len), then max_len."""
    if max_len < 1 or min_bucket < 1:
        raise ValueError(f"max_len ({max_len}) and min_bucket ({min_bucket}) must be >= 1")
    out, b = [], 1 << (min_bucket - 1).bit_length()
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


class Scorer:
    """Scores `Request`s with one model (see the module docstring)."""

    def __init__(
        self,
        cfg: ZayaConfig,
        *,
        mesh: Mesh | None = None,
        batch_size: int = 8,
        max_len: int = 2048,
        min_bucket: int = 64,
        loss_chunk: int = 512,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if mesh is not None and batch_size % row_devices(mesh):
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of the {row_devices(mesh)} devices of the "
                f"mesh {dict(mesh.shape)} that split rows (all but the context axis)"
            )
        self.cfg = dataclasses.replace(cfg, moe_capacity_factor=None)
        self.mesh = mesh
        self.batch_size = batch_size
        self.max_len = max_len
        self.buckets = sequence_buckets(max_len, min_bucket)
        self.num_traces = 0  # compilations of the step: at most one per bucket
        model = ZayaForCausalLM(self.cfg, mesh)

        def step(variables, batch):
            self.num_traces += 1  # runs only while tracing
            out = model.apply(variables, batch["input_ids"], batch["attention_mask"], return_logits=False)
            head = lambda h: model.apply(variables, h, method=ZayaForCausalLM.logits_from_hidden)
            logp, greedy = chunked_token_logprobs(out.hidden, batch["targets"], head, loss_chunk)
            scored = batch["score_mask"]
            return {
                "logprob": jnp.sum(jnp.where(scored, logp, 0.0), axis=-1),
                "greedy": jnp.all(greedy | ~scored, axis=-1),
                "tokens": jnp.sum(scored, axis=-1, dtype=jnp.int32),
            }

        # inputs keep the layout they are given (params by the sharding table, rows over the mesh)
        self._step = jax.jit(step, out_shardings=None if mesh is None else NamedSharding(mesh, P()))

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if length <= b:
                return b
        raise ValueError(f"a request of {length} tokens is longer than max_len={self.max_len}")

    def _put(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        # every process holds the whole batch; each device takes its rows
        return jax.make_array_from_callback(x.shape, batch_sharding(self.mesh), lambda idx: x[idx])

    def score(
        self,
        variables: Any,
        requests: Sequence[Request],
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Score]:
        """Scores `requests` with `variables` ({"params", "balancing"}), in the order given.
        progress(done, total) is called after each batch."""
        for r in requests:
            self.bucket_for(len(r.inputs))  # fail before any compute
        if self.mesh is not None:  # a no-op for variables already laid out (a training state)
            variables = jax.device_put(variables, variable_shardings(variables, self.mesh))
        results: list[Score | None] = [None] * len(requests)
        done = 0
        for rows in length_sorted_batches(requests, self.batch_size):
            s = self.bucket_for(len(requests[rows[0]].inputs))
            batch = right_padded_batch(requests, rows, self.batch_size, s)
            out = jax.device_get(self._step(variables, {k: self._put(v) for k, v in batch.items()}))
            for j, i in enumerate(rows):
                results[i] = Score(float(out["logprob"][j]), bool(out["greedy"][j]), int(out["tokens"][j]))
            done += len(rows)
            if progress is not None:
                progress(done, len(requests))
        return results  # type: ignore[return-value]
