"""Weighted mixtures of datasets (`data.mixture = "PATH:WEIGHT,PATH:WEIGHT,..."`): prepared
directories and Megatron dataset prefixes (zaya_jax.data.megatron), mixed freely.

A mixture is one endless random-access sequence source, like a single dataset's PackedSequences:
global sequence index i -> (source k, index j within source k) -> source k's packed sequence j.
Each source packs and reshuffles its own documents every epoch (its own seed, derived from the
run's), so a small source simply repeats; `epochs_report` says how often.

Assignment (a pure function of (seed, i), O(K) arithmetic, no table): sources are peeled off in
the order given. Source 0 takes the positions where the running count floor(n * r0 + phase0)
steps up (systematic sampling, as the train/eval split does), r0 = w0; source 1 does the same on
the positions left, with r1 = w1 / (w1 + ... + w_{K-1}), and so on; the last source takes the rest.
So after any n sequences every source has had its share to within about one sequence per level
(no drift, no sampling noise), a batch of G sequences holds ~w_k * G of source k, and the number
of sequences of each source among the first n is known in closed form (`counts`), which is what
`mixture/<name>` in metrics.jsonl reports and what a resume restores: the data position (one
index, saved in the checkpoint) determines every source's position.

Sharding and the batch-size ramp work on the mixture exactly as on one dataset (process p reads
only the global indices = p mod P; zaya_jax.data.pipeline.batch_sequences).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import numpy as np

from zaya_jax.data.megatron import MegatronOptions
from zaya_jax.data.megatron_format import megatron_prefix
from zaya_jax.data.pipeline import PackedSequences, load_documents, tokenizer_info


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    name: str  # the directory's (Megatron prefix's) basename: `mixture/<name>`, `eval_loss/<name>`
    path: str
    weight: float  # normalised: the weights of a mixture sum to 1


def parse_mixture(spec: str) -> tuple[MixtureSource, ...]:
    """"PATH:WEIGHT,PATH:WEIGHT,..." -> sources with normalised weights (format checks only)."""
    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if not entries:
        raise ValueError(f"{spec!r}: expected 'PATH:WEIGHT,PATH:WEIGHT,...'")
    parsed = []
    for entry in entries:
        path, sep, weight = entry.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not sep or not path or not math.isfinite(w) or w <= 0:
            raise ValueError(f"{entry!r}: expected PATH:WEIGHT with a weight > 0")
        parsed.append((path, w))
    names = [os.path.basename(os.path.normpath(megatron_prefix(p) or p)) for p, _ in parsed]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two sources are named {name!r} (a source's name is its directory's basename)")
    total = sum(w for _, w in parsed)
    return tuple(MixtureSource(n, p, w / total) for n, (p, w) in zip(names, parsed))


def check_sources(sources: tuple[MixtureSource, ...], megatron: MegatronOptions | None = None) -> None:
    """Every source is a prepared dataset or a Megatron prefix (whose tokenizer is data.tokenizer),
    and all share one tokenizer (an error names both)."""
    first = tokenizer_info(sources[0].path, megatron)
    for s in sources[1:]:
        tok = tokenizer_info(s.path, megatron)
        if tok != first:
            raise ValueError(
                f"{sources[0].path} and {s.path} were prepared with different tokenizers "
                f"({first} vs {tok}); a mixture needs one tokenizer"
            )


class MixedSequences:
    """Random-access grain data source over a weighted mixture (see the module doc); endless.

    Element: {"input_ids": int32 [S], "targets": int32 [S], "loss_mask": float32 [S]}.
    """

    def __init__(self, sequences: list[PackedSequences], weights: list[float], *, seed: int = 0):
        if len(sequences) != len(weights) or not sequences:
            raise ValueError("one weight per source, at least one source")
        self.sequences = sequences
        left = np.cumsum(np.asarray(weights, np.float64)[::-1])[::-1]  # w_k + ... + w_{K-1}
        self._rates = [w / rest for w, rest in zip(weights[:-1], left[:-1])]
        rng = np.random.default_rng([seed, 0x313C])
        self._phases = [float(p) for p in rng.random(len(self._rates))]

    def __len__(self) -> int:
        return sys.maxsize

    def _selected(self, level: int, n: int) -> int:
        """Positions among the first n at `level` that go to source `level`: floor(n r + phase)."""
        return math.floor(n * self._rates[level] + self._phases[level])

    def assign(self, index: int) -> tuple[int, int]:
        """Global sequence index -> (source k, index within source k)."""
        rank = index
        for level in range(len(self._rates)):
            before = self._selected(level, rank)
            if self._selected(level, rank + 1) > before:
                return level, before
            rank -= before  # rank among the positions the levels so far left over
        return len(self.sequences) - 1, rank

    def counts(self, n: int) -> list[int]:
        """Sequences of each source among global indices [0, n)."""
        out = []
        for level in range(len(self._rates)):
            out.append(self._selected(level, n))
            n -= out[-1]
        return out + [n]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        k, j = self.assign(int(index))
        return self.sequences[k][j]


def mixed_sequences(
    sources: tuple[MixtureSource, ...], *, seq_len: int, seed: int, megatron: MegatronOptions | None = None
) -> MixedSequences:
    """The training mixture: each source's train split packed with its own seed (from `seed`)."""
    packed = [
        PackedSequences(
            load_documents(s.path, "train", megatron),
            seq_len=seq_len,
            seed=int(np.random.SeedSequence([seed, k]).generate_state(1)[0]),
        )
        for k, s in enumerate(sources)
    ]
    return MixedSequences(packed, [s.weight for s in sources], seed=seed)


def epochs_report(sources: tuple[MixtureSource, ...], mix: MixedSequences, total_sequences: int) -> str:
    """Start-up lines: each source's share of the run's sequences and how many epochs that makes."""
    counts = mix.counts(total_sequences)
    lines = [f"data.mixture: {total_sequences:,} sequences over the run"]
    for s, seqs, n in zip(sources, mix.sequences, counts):
        lines.append(
            f"  {s.name}: weight {s.weight:.3f}, {n:,} sequences = "
            f"{n / seqs.sequences_per_epoch:.2f} epochs of {seqs.sequences_per_epoch:,} ({s.path})"
        )
    return "\n".join(lines)


__all__ = [
    "MixedSequences",
    "MixtureSource",
    "check_sources",
    "epochs_report",
    "mixed_sequences",
    "parse_mixture",
]
