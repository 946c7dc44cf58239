"""A prepared dataset as the trainer reads it: meta.json and each split's tokens and document
offsets, memory-mapped."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FORMAT_NAME = "zaya_jax.tokens"
FORMAT_VERSION = 1
META_FILENAME = "meta.json"
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class TokenDocuments:
    """A split's documents as token arrays; each document includes its trailing EOS.

    shards:    flat token arrays (memory-mapped when read from disk)
    doc_shard: int32 [D]  shard holding document d
    doc_start: int64 [D]  offset of document d in its shard
    doc_len:   int64 [D]  length of document d, EOS included (always >= 1)
    """

    shards: tuple[np.ndarray, ...]
    doc_shard: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    eos_id: int
    pad_id: int
    vocab_size: int

    @property
    def num_docs(self) -> int:
        return len(self.doc_len)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_len.sum())

    def doc_tokens(self, d: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Tokens [lo:hi) of document d (EOS is its last token), as stored (uint16/uint32/int32)."""
        length = int(self.doc_len[d])
        hi = length if hi is None else min(hi, length)
        start = int(self.doc_start[d])
        return self.shards[int(self.doc_shard[d])][start + lo : start + hi]

    @classmethod
    def from_token_lists(
        cls, docs: Sequence[Sequence[int]], *, eos_id: int, pad_id: int, vocab_size: int
    ) -> TokenDocuments:
        """In-memory documents (without EOS; it is appended here) -> a single-shard TokenDocuments."""
        lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = np.empty(int(offsets[-1]), dtype=np.int32)
        for d, start, end in zip(docs, offsets[:-1], offsets[1:]):
            tokens[start : end - 1] = d
            tokens[end - 1] = eos_id
        return cls(
            shards=(tokens,),
            doc_shard=np.zeros(len(docs), np.int32),
            doc_start=offsets[:-1],
            doc_len=lengths,
            eos_id=eos_id,
            pad_id=pad_id,
            vocab_size=vocab_size,
        )


def read_meta(data_dir: str | os.PathLike) -> dict:
    """meta.json of a prepared dataset, checked for format and version."""
    path = Path(data_dir) / META_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{data_dir} is not a prepared dataset (no {META_FILENAME}); create one with "
            "`python -m zaya_jax.data.prepare --input ... --out DIR`"
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: unreadable ({e}); prepare the dataset again") from None
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: unsupported dataset format {meta.get('format')!r} version "
            f"{meta.get('format_version')!r} (expected {FORMAT_NAME!r} v{FORMAT_VERSION})"
        )
    return meta


def load_split(data_dir: str | os.PathLike, split: str) -> TokenDocuments:
    """Memory-maps one split ("train" or "eval") of a prepared dataset."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    tok = meta["tokenizer"]
    shards, doc_shard, doc_start, doc_len = [], [], [], []
    for i, shard in enumerate(meta["splits"][split]["shards"]):
        tokens = _load_npy(data_dir / split / shard["tokens"], mmap_mode="r")
        offsets = _load_npy(data_dir / split / shard["offsets"])
        if offsets[0] != 0 or offsets[-1] != len(tokens) or len(offsets) != shard["num_docs"] + 1:
            raise ValueError(f"{data_dir / split / shard['offsets']}: offsets do not match the shard")
        shards.append(tokens)
        doc_shard.append(np.full(len(offsets) - 1, i, np.int32))
        doc_start.append(offsets[:-1])
        doc_len.append(np.diff(offsets))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    return TokenDocuments(
        shards=tuple(shards),
        doc_shard=cat(doc_shard, np.int32),
        doc_start=cat(doc_start, np.int64),
        doc_len=cat(doc_len, np.int64),
        eos_id=tok["eos_id"],
        pad_id=tok["pad_id"],
        vocab_size=tok["vocab_size"],
    )


def _load_npy(path: Path, mmap_mode: str | None = None) -> np.ndarray:
    """np.load, with a truncated / missing / garbled shard reported under its file name."""
    try:
        return np.load(path, mmap_mode=mmap_mode)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: cannot read this shard ({e}); prepare the dataset again") from None
