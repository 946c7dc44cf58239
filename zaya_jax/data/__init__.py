"""Training data: the embedded public-domain corpus and the train/eval document split.

Submodules:
    zaya_jax.data.prepare   `python -m zaya_jax.data.prepare`: text/jsonl -> token shards on disk
    zaya_jax.data.pipeline  grain pipeline: token documents -> packed, sharded, checkpointable batches
    zaya_jax.data.mixture   weighted mixtures of prepared datasets (data.mixture)
    zaya_jax.data.ramp      batch-size ramp (train.batch_ramp) and the batches that follow it

The embedded corpus (see `corpus/README.md` for provenance) lets every config train out of the box,
with no download: Melville's *Moby-Dick* plus 15 early U.S. State of the Union addresses, ~1.5 MB
of English text. Each work is stored gzip-compressed with its sections (chapters, addresses)
separated by form feeds; `load_embedded_corpus` cuts the sections further into documents of whole
paragraphs so that a held-out split of whole documents is meaningful.
"""

from __future__ import annotations

import gzip
import math
import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources

import numpy as np

# Target document size when cutting sections into paragraph groups. A single paragraph longer than
# this stays whole (documents are never cut mid-paragraph; the addresses have no paragraph breaks),
# and a group shorter than _MIN_DOC_CHARS is never closed, so headings stay with their text.
_MAX_DOC_CHARS = 4000
_MIN_DOC_CHARS = 500
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")

# The embedded corpus' held-out split is fixed (independent of the training seed), so eval numbers
# of runs with different seeds are comparable.
EMBEDDED_EVAL_FRACTION = 0.02
EMBEDDED_SPLIT_SEED = 0


def _paragraph_groups(section: str, max_chars: int) -> list[str]:
    """Greedily groups consecutive paragraphs of `section` into chunks of <= max_chars characters."""
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for para in _PARAGRAPH_BREAK.split(section.strip()):
        para = para.strip()
        if not para:
            continue
        if size >= _MIN_DOC_CHARS and size + len(para) > max_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        docs.append("\n\n".join(current))
    return docs


@lru_cache(maxsize=1)
def _embedded_corpus() -> tuple[str, ...]:
    corpus_dir = resources.files(__name__).joinpath("corpus")
    files = sorted(
        (f for f in corpus_dir.iterdir() if f.name.endswith((".txt", ".txt.gz"))), key=lambda f: f.name
    )
    if not files:
        raise FileNotFoundError(f"embedded corpus is missing: no .txt/.txt.gz files in {corpus_dir}")
    docs: list[str] = []
    for f in files:
        raw = f.read_bytes()
        text = (gzip.decompress(raw) if f.name.endswith(".gz") else raw).decode("utf-8")
        for section in text.split("\f"):
            docs.extend(_paragraph_groups(section, _MAX_DOC_CHARS))
    return tuple(docs)


def load_embedded_corpus() -> list[str]:
    """The embedded public-domain corpus as a deterministic list of documents (~450 documents, ~1.5 MB)."""
    return list(_embedded_corpus())


def is_eval_document(index: int, eval_fraction: float, seed: int) -> bool:
    """Whether document number `index` (0-based, in input order) belongs to the held-out split.

    Systematic sampling: document i is held out when the running count floor(i * f + phase) steps
    up, with a seed-dependent phase in [0, 1). This needs no look-ahead (so `prepare` can stream
    arbitrarily large inputs), holds out floor or ceil of n * f documents out of any first n, and
    spreads them evenly over the inputs (every input file gets its share).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0.0:
        return False
    phase = _split_phase(seed)
    return math.floor((index + 1) * eval_fraction + phase) > math.floor(index * eval_fraction + phase)


def eval_document_mask(num_docs: int, eval_fraction: float, seed: int) -> np.ndarray:
    """`is_eval_document` of documents 0 .. num_docs - 1 at once: bool [num_docs] (the same float64
    arithmetic, vectorised, for indexes of millions of documents)."""
    is_eval_document(0, eval_fraction, seed)  # validates eval_fraction
    if eval_fraction == 0.0:
        return np.zeros(num_docs, bool)
    phase = _split_phase(seed)
    index = np.arange(num_docs, dtype=np.float64)
    return np.floor((index + 1) * eval_fraction + phase) > np.floor(index * eval_fraction + phase)


@lru_cache(maxsize=16)
def _split_phase(seed: int) -> float:
    # Cached: `prepare` asks once per document.
    return float(np.random.default_rng([seed, 0x5EED]).random())


def split_documents(docs: Sequence[str], eval_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """Splits documents into disjoint (train, eval) lists, each keeping the input order.

    Every document goes to exactly one side (see `is_eval_document`); with
    eval_fraction * len(docs) >= 1 the eval side is never empty.
    """
    train: list[str] = []
    held_out: list[str] = []
    for i, doc in enumerate(docs):
        (held_out if is_eval_document(i, eval_fraction, seed) else train).append(doc)
    return train, held_out


__all__ = [
    "EMBEDDED_EVAL_FRACTION",
    "EMBEDDED_SPLIT_SEED",
    "eval_document_mask",
    "is_eval_document",
    "load_embedded_corpus",
    "split_documents",
]
