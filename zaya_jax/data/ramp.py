"""Batch-size ramp (`train.batch_ramp = "START,INCREMENT,RAMP_SEQUENCES"`, Megatron's
`--rampup-batch-size`) and the batched view of a sequence source that follows it.

Rule (Megatron's RampupBatchsizeNumMicroBatches, in exact integer arithmetic): with F = the full
global batch (train.batch_size), N = (F - START) / INCREMENT increments and R = RAMP_SEQUENCES,
the batch of a step that starts after C sequences have been consumed is

    START + INCREMENT * floor(C * N / R)   while C <= R,       F afterwards (and F when N == 0),

so the batch grows by INCREMENT every R / N sequences until it reaches F. A large batch may step
over a level (C jumps past two thresholds at once): the sizes that occur are what `segments` lists.

The schedule is a pure function of the batch index k (batches drawn so far, which is the optimizer
step unless a rollback skipped batches): `size(k)` and `consumed(k)` (sequences in batches
0..k-1) come from a short table of constant-size segments, one per level reached. Batch k is the
global sequences [consumed(k), consumed(k) + size(k)) of the source, so a size change neither
loses nor repeats a sequence. Process p of P takes the ones with index = p (mod P): every size is
a multiple of P (it divides over the mesh), so that is the slice [consumed(k)/P, ...+size(k)/P)
of the process' interleaved rows `source[p::P]`, exactly the rows a fixed batch would give it.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    """Global batch size per batch index. `segments`: (first batch index, size, first consumed
    sequence) of each constant-size stretch; the last one (size = full) runs forever."""

    start: int
    increment: int
    ramp_sequences: int
    full: int
    segments: tuple[tuple[int, int, int], ...]

    @classmethod
    def constant(cls, full: int) -> BatchRamp:
        return cls(full, 1, 0, full, ((0, full, 0),))

    @classmethod
    def create(cls, start: int, increment: int, ramp_sequences: int, full: int) -> BatchRamp:
        checks = (("START", start, 1), ("INCREMENT", increment, 1), ("RAMP_SEQUENCES", ramp_sequences, 0))
        for name, value, low in checks:
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if start > full:
            raise ValueError(f"START={start} exceeds train.batch_size={full}")
        if (full - start) % increment:
            raise ValueError(
                f"train.batch_size - START = {full - start} is not a multiple of INCREMENT={increment}"
            )
        n = (full - start) // increment
        segments, k, consumed = [], 0, 0
        while n and ramp_sequences and consumed <= ramp_sequences:
            level = consumed * n // ramp_sequences
            if level >= n:
                break
            size = start + increment * level
            # first consumed count at the next level: ceil((level + 1) * R / n)
            threshold = -(-(level + 1) * ramp_sequences // n)
            steps = -(-(threshold - consumed) // size)
            segments.append((k, size, consumed))
            k, consumed = k + steps, consumed + steps * size
        segments.append((k, full, consumed))
        return cls(start, increment, ramp_sequences, full, tuple(segments))

    def _segment(self, k: int) -> tuple[int, int, int]:
        if k < 0:
            raise ValueError(f"batch index must be >= 0, got {k}")
        return self.segments[bisect.bisect_right([s[0] for s in self.segments], k) - 1]

    def size(self, k: int) -> int:
        """Global batch size (sequences) of batch k (0-based)."""
        return self._segment(k)[1]

    def consumed(self, k: int) -> int:
        """Sequences in batches 0..k-1 (the first global sequence index of batch k)."""
        first, size, consumed = self._segment(k)
        return consumed + (k - first) * size

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every batch size the schedule uses, in order (distinct, increasing, ends with full)."""
        return tuple(s[1] for s in self.segments)

    def check_divisible(self, devices: int, grad_accum: int) -> None:
        """Every size must split into grad_accum microbatches that divide over `devices` (the
        config checks grad_accum alone with devices=1; the trainer again once the mesh is built)."""
        for size in self.sizes:
            if size % grad_accum or (size // grad_accum) % devices:
                # Over devices the per-microbatch size is what must divide; alone, grad_accum is.
                per, over = (f" (per microbatch {size / grad_accum:g})", f" over the {devices} devices")
                per, over = (per, over) if devices > 1 else ("", "")
                raise ValueError(
                    f"batch size {size}{per} of the ramp is not divisible into train.grad_accum="
                    f"{grad_accum} microbatches{over} (ramp {self.start},{self.increment},"
                    f"{self.ramp_sequences} -> {self.full}, sizes {list(self.sizes)})"
                )


def parse_batch_ramp(spec: str | None, full: int) -> BatchRamp:
    """ "START,INCREMENT,RAMP_SEQUENCES" (None or "" = no ramp) -> BatchRamp up to `full`."""
    if spec is None or not str(spec).strip():
        return BatchRamp.constant(full)
    parts = [p.strip() for p in str(spec).split(",")]
    try:
        values = [int(p.replace("_", "")) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or len(parts) != 3:
        raise ValueError(f"{spec!r}: expected 'START,INCREMENT,RAMP_SEQUENCES' (three ints)")
    return BatchRamp.create(*values, full=full)


class RampBatches:
    """Random-access grain source: batch index k -> this process' rows of global batch k.

    `rows` is the process' interleaved sequences (`source[p::P]`, random access); batch k stacks
    rows [consumed(k)/P, consumed(k)/P + size(k)/P) (see the module doc), in the format of
    zaya_jax.data.pipeline (each key [size(k)/P, S]).
    """

    def __init__(self, rows: Sequence[dict[str, np.ndarray]], ramp: BatchRamp, process_count: int):
        for size in ramp.sizes:
            if size % process_count:
                raise ValueError(
                    f"batch size {size} of the ramp is not divisible by process_count {process_count}"
                )
        self.rows, self.ramp, self.process_count = rows, ramp, process_count

    def __len__(self) -> int:
        return sys.maxsize // self.ramp.full  # endless, like the training sequences it batches

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        k = int(k)
        first = self.ramp.consumed(k) // self.process_count
        items = [self.rows[first + i] for i in range(self.ramp.size(k) // self.process_count)]
        return {key: np.stack([x[key] for x in items]) for key in items[0]}


__all__ = ["BatchRamp", "RampBatches", "parse_batch_ramp"]
