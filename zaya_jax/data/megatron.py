"""Megatron indexed datasets as training sources, read in place: a prefix's documents over the
memory-mapped `.bin` (format: zaya_jax.data.megatron_format), split into train and eval.

Documents are read as stored: a document is its sequences' tokens back to back, ending in the EOD
token when preprocessing appended one (`--append-eod`). Without it documents run into each
other in the packed stream with no boundary token, as in Megatron. Zero-token documents are
skipped. The eval split holds out documents by `zaya_jax.data.is_eval_document` over the
remaining documents in stored order, exactly as `prepare` does, so a Megatron dataset and a
`prepare` directory made from the same documents give the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np

from zaya_jax.data import eval_document_mask
from zaya_jax.data.megatron_format import Documents, document_table, read_index
from zaya_jax.data.prepare import split_tail
from zaya_jax.data.prepared import TokenDocuments
from zaya_jax.data.tokenizer import Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    """How Megatron sources are read (config data.tokenizer / data.eval_fraction / data.split_seed)."""

    tokenizer: str | None = None
    eval_fraction: float = 0.01
    split_seed: int = 0

    @classmethod
    def of(cls, data) -> MegatronOptions:
        """From the config's `data` section."""
        # getattr with defaults: configs saved by older versions lack the keys
        return cls(
            getattr(data, "tokenizer", None),
            float(getattr(data, "eval_fraction", 0.01)),
            int(getattr(data, "split_seed", 0)),
        )


def tokenizer_of(options: MegatronOptions | None, prefix: str) -> Tokenizer:
    """The tokenizer data.tokenizer names (a Megatron dataset stores only ids)."""
    if options is None or options.tokenizer is None:
        raise ValueError(
            f"{prefix} is a Megatron dataset, which stores token ids only: set config.data.tokenizer "
            "to the tokenizer that wrote them ('byte' or a tokenizer.json)"
        )
    return load_tokenizer(options.tokenizer)


def load_megatron_split(prefix: str, split: str, options: MegatronOptions) -> TokenDocuments:
    """One split of a Megatron dataset as TokenDocuments over the memory-mapped .bin (cached while
    the files are unchanged: the trainer asks for the eval split at every evaluation)."""
    try:
        stamp = tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, (prefix + ".idx", prefix + ".bin")))
    except FileNotFoundError:
        read_index(prefix)  # names the missing file
        raise
    return _load_split(prefix, split, options, stamp)


@functools.lru_cache(maxsize=8)
def _load_split(prefix: str, split: str, options: MegatronOptions, stamp: tuple) -> TokenDocuments:
    del stamp  # part of the cache key only
    tok = tokenizer_of(options, prefix)
    index = read_index(prefix)
    docs = document_table(index)
    if len(docs.length) == 0:
        raise ValueError(f"{index.bin_path}: no documents with tokens")
    tokens = np.memmap(index.bin_path, dtype=index.dtype, mode="r")
    held_out = eval_document_mask(len(docs.length), options.eval_fraction, options.split_seed)
    if options.eval_fraction > 0 and not held_out.any():
        return _tail_split(tokens, docs, split, options.eval_fraction, tok)
    keep = held_out if split == "eval" else ~held_out
    return TokenDocuments(
        shards=(tokens,),
        doc_shard=np.zeros(int(keep.sum()), np.int32),
        doc_start=docs.start[keep],
        doc_len=docs.length[keep],
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        vocab_size=tok.vocab_size,
    )


def _tail_split(tokens: np.ndarray, docs: Documents, split: str, fraction: float, tok) -> TokenDocuments:
    """Too few documents for a whole one to be held out: as `prepare`, the eval split is the tail
    of the last document (ceil(fraction * all tokens) of them) and train keeps its head."""
    n = math.ceil(fraction * int(docs.length.sum()))
    last = np.asarray(tokens[docs.start[-1] : docs.start[-1] + docs.length[-1]], np.int64)
    head, tail = split_tail(last, n, tok.eos_id)
    if split == "eval":
        return TokenDocuments.from_token_lists([tail[:-1]], eos_id=tok.eos_id, pad_id=tok.pad_id,
                                               vocab_size=tok.vocab_size)  # fmt: skip
    head_shard = head.astype(np.int32)
    front = len(docs.length) - 1
    return TokenDocuments(
        shards=(tokens, head_shard),
        doc_shard=np.concatenate([np.zeros(front, np.int32), [1]]).astype(np.int32),
        doc_start=np.concatenate([docs.start[:-1], [0]]).astype(np.int64),
        doc_len=np.concatenate([docs.length[:-1], [len(head_shard)]]).astype(np.int64),
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        vocab_size=tok.vocab_size,
    )


def tokenizer_record(tok: Tokenizer) -> dict:
    """What meta.json records of a tokenizer (mixture sources must agree on it)."""
    return {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "pad_id": tok.pad_id, "bos_id": tok.bos_id}  # fmt: skip


__all__ = ["MegatronOptions", "load_megatron_split", "tokenizer_of", "tokenizer_record"]
