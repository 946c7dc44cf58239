"""grain input pipeline: token documents -> packed, process-sharded, checkpointable LM batches.

Batch format (numpy, B = global_batch_size // process_count local rows, S = seq_len):
    input_ids  int32   [B, S]
    targets    int32   [B, S]   targets[:, t] is the token that follows input_ids[:, t]
    loss_mask  float32 [B, S]   1 for real targets, 0 for padding

Packing, sharding and the checkpointed data position: docs/design/data-pipeline.md.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np

from zaya_jax.data import EMBEDDED_EVAL_FRACTION, EMBEDDED_SPLIT_SEED, load_embedded_corpus, split_documents
from zaya_jax.data.megatron import MegatronOptions, load_megatron_split, tokenizer_of, tokenizer_record
from zaya_jax.data.megatron_format import megatron_prefix
from zaya_jax.data.prepared import SPLITS, TokenDocuments, load_split, read_meta
from zaya_jax.data.ramp import BatchRamp, RampBatches
from zaya_jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

Source = str | os.PathLike | None
_EMBEDDED = "embedded"


# ----------------------------------------------------------------------------------------------
# Sources


def _is_embedded(source: Source) -> bool:
    return source is None or (isinstance(source, str) and source == _EMBEDDED)


@functools.lru_cache(maxsize=len(SPLITS))
def _embedded_documents(split: str) -> TokenDocuments:
    # Small (~1.5 M byte tokens, well under a second to tokenize): kept in memory, never cached on disk.
    train, held_out = split_documents(load_embedded_corpus(), EMBEDDED_EVAL_FRACTION, EMBEDDED_SPLIT_SEED)
    tok = ByteTokenizer()
    docs = train if split == "train" else held_out
    return TokenDocuments.from_token_lists(
        tok.encode_batch(docs), eos_id=tok.eos_id, pad_id=tok.pad_id, vocab_size=tok.vocab_size
    )


def load_documents(
    source: Source, split: str = "train", megatron: MegatronOptions | None = None
) -> TokenDocuments:
    """Token documents of `split`: from a prepared data dir, a Megatron dataset prefix (read as
    `megatron` says: its tokenizer and eval split), or the embedded corpus (None/"embedded")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if _is_embedded(source):
        return _embedded_documents(split)
    prefix = megatron_prefix(source)
    if prefix is not None:
        return load_megatron_split(prefix, split, megatron or MegatronOptions())
    return load_split(source, split)


def source_tokenizer(source: Source, megatron: MegatronOptions | None = None) -> Tokenizer:
    """The tokenizer of `source`: the one that prepared it, data.tokenizer for a Megatron dataset
    (which a prepared source must then match), the byte tokenizer for the embedded corpus."""
    if _is_embedded(source):
        return ByteTokenizer()
    prefix = megatron_prefix(source)
    if prefix is not None:
        return tokenizer_of(megatron, prefix)
    stored = read_meta(source)["tokenizer"]  # clear error if this is not a prepared dataset
    if megatron is not None and megatron.tokenizer is not None:
        named = tokenizer_record(tokenizer_of(megatron, str(source)))
        if named != stored:
            raise ValueError(
                f"{source} was prepared with tokenizer {stored}, config.data.tokenizer is {named}"
            )
    return load_tokenizer(Path(source))


def tokenizer_info(source: Source, megatron: MegatronOptions | None = None) -> dict:
    """The tokenizer record (name, vocab_size, special ids) of a prepared or Megatron source."""
    prefix = megatron_prefix(source)
    if prefix is not None:
        return tokenizer_record(tokenizer_of(megatron, prefix))
    return read_meta(source)["tokenizer"]


# ----------------------------------------------------------------------------------------------
# Packing


class PackedSequences:
    """Random-access grain data source: global sequence index -> one packed example (see module doc).

    Element: {"input_ids": int32 [S], "targets": int32 [S], "loss_mask": float32 [S]}.
    Length: num_epochs * sequences_per_epoch rounded up to a multiple of `pad_to_multiple`
    (extra indices are all-padding sequences), or sys.maxsize when num_epochs is None.
    """

    def __init__(
        self,
        docs: TokenDocuments,
        *,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        pad_to_multiple: int = 1,
    ):
        if docs.num_docs == 0:
            raise ValueError("cannot build sequences from an empty split")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None (repeat forever) or >= 1, got {num_epochs}")
        self.docs = docs
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.tokens_per_epoch = docs.num_tokens
        self.sequences_per_epoch = math.ceil(self.tokens_per_epoch / seq_len)
        if num_epochs is None:
            self._num_real = sys.maxsize
            self._len = sys.maxsize
        else:
            self._num_real = num_epochs * self.sequences_per_epoch
            self._len = math.ceil(self._num_real / pad_to_multiple) * pad_to_multiple
        self._lock = threading.Lock()
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._len

    # grain may pickle the source into worker processes (mp_prefetch); locks do not pickle.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_layouts")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._layouts = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document order of `epoch`: int64 [D], a permutation seeded by (seed, epoch) if shuffling."""
        if not self.shuffle:
            return np.arange(self.docs.num_docs, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.docs.num_docs)

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, ends): document order and cumulative end offsets in the epoch's stream, int64 [D]."""
        with self._lock:
            layout = self._layouts.get(epoch)
            if layout is None:
                order = self.epoch_order(epoch)
                layout = (order, np.cumsum(self.docs.doc_len[order]))
                # Readers only ever touch the current epoch and, at the boundary, its neighbours.
                if len(self._layouts) >= 3:
                    self._layouts.pop(min(self._layouts))
                self._layouts[epoch] = layout
            return layout

    def _read_stream(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """Epoch stream positions [lo, hi) as int32; position -1 is EOS, positions >= T are padding."""
        out = np.full(hi - lo, self.docs.pad_id, dtype=np.int32)
        if lo < 0:  # only ever -1: the EOS in front of the epoch's first document
            out[:-lo] = self.docs.eos_id
        order, ends = self._layout(epoch)
        pos, end = max(lo, 0), min(hi, self.tokens_per_epoch)
        k = int(np.searchsorted(ends, pos, side="right"))  # first document ending after `pos`
        while pos < end:
            doc = int(order[k])
            doc_begin = int(ends[k]) - int(self.docs.doc_len[doc])
            take = min(end, int(ends[k])) - pos
            out[pos - lo : pos - lo + take] = self.docs.doc_tokens(
                doc, pos - doc_begin, pos - doc_begin + take
            )
            pos += take
            k += 1
        return out

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        s = self.seq_len
        if index >= self._num_real:  # padding sequence that rounds the total up to whole global batches
            return {
                "input_ids": np.full(s, self.docs.pad_id, np.int32),
                "targets": np.full(s, self.docs.pad_id, np.int32),
                "loss_mask": np.zeros(s, np.float32),
            }
        epoch, i = divmod(index, self.sequences_per_epoch)
        window = self._read_stream(epoch, i * s - 1, (i + 1) * s)  # [S + 1]
        num_targets = min(s, self.tokens_per_epoch - i * s)
        loss_mask = np.zeros(s, np.float32)
        loss_mask[:num_targets] = 1.0
        return {"input_ids": window[:-1], "targets": window[1:], "loss_mask": loss_mask}


# ----------------------------------------------------------------------------------------------
# Datasets


class Lookahead:
    """An iterator (with grain's get_state / set_state) that can show its next element early:
    `peek()` reads it, the next `next()` returns it, and `get_state()` meanwhile is the state
    before it, so a checkpoint saved after a peek resumes at the peeked element."""

    def __init__(self, it: Any):
        self._it = it
        self._peeked: Any = None
        self._state_before: Any = None

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._peeked is None:
            return next(self._it)
        item, self._peeked = self._peeked, None
        return item

    def peek(self) -> Any:
        if self._peeked is None:
            self._state_before = self._it.get_state()
            self._peeked = next(self._it)
        return self._peeked

    def get_state(self) -> Any:
        return self._state_before if self._peeked is not None else self._it.get_state()

    def set_state(self, state: Any) -> None:
        self._peeked = None
        self._it.set_state(state)


def make_dataset(
    source: Source = None,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
    num_epochs: int | None = None,
    shuffle: bool | None = None,
    num_threads: int = 2,
    prefetch_buffer_size: int = 4,
    ramp: BatchRamp | None = None,
    megatron: MegatronOptions | None = None,
) -> grain.IterDataset:
    """grain IterDataset of this process' share of the packed batches (format in the module doc).

    Args:
      source: a directory written by `python -m zaya_jax.data.prepare`, a Megatron dataset prefix
        (read as `megatron` says), or None/"embedded" for the embedded corpus (byte tokenizer).
      seq_len: S, tokens per sequence.
      global_batch_size: sequences per step over all processes; must be divisible by process_count.
      seed: shuffling seed; the document order of epoch e is a function of (seed, e) only.
      process_index, process_count: this process' position (jax.process_index()/process_count()).
      split: "train" or "eval".
      num_epochs: None repeats forever; otherwise the dataset ends after that many epochs, the
        last batch filled up with all-padding rows.
      shuffle: shuffle documents each epoch; defaults to True for "train", False for "eval".
      num_threads, prefetch_buffer_size: grain read threads and how many batches they read ahead.
      ramp: batch k holds ramp.size(k) sequences (zaya_jax.data.ramp; global_batch_size is then the
        full size); None = every batch holds global_batch_size.
      megatron: tokenizer and eval split of a Megatron source (zaya_jax.data.megatron).

    Iterate with `it = iter(ds)`; `it.get_state()` is a JSON-serialisable dict and
    `it.set_state(state)` on a fresh iterator of the same dataset resumes at the same batch.
    """
    if global_batch_size < 1 or process_count < 1:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) and process_count ({process_count}) must be >= 1"
        )
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by process_count {process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} out of range for process_count {process_count}")
    docs = load_documents(source, split, megatron)
    if docs.num_docs == 0:
        raise ValueError(f"the {split!r} split of {source or _EMBEDDED} has no documents")
    if ramp is not None and num_epochs is not None:
        raise ValueError("a batch-size ramp needs an endless dataset (num_epochs=None)")
    sequences = PackedSequences(
        docs,
        seq_len=seq_len,
        seed=seed,
        shuffle=(split == "train") if shuffle is None else shuffle,
        num_epochs=num_epochs,
        pad_to_multiple=global_batch_size,
    )
    return batch_sequences(
        sequences,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        ramp=ramp,
        num_threads=num_threads,
        prefetch_buffer_size=prefetch_buffer_size,
    )


def batch_sequences(
    sequences,
    *,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    ramp: BatchRamp | None = None,
    num_threads: int = 2,
    prefetch_buffer_size: int = 4,
) -> grain.IterDataset:
    """This process' batches of a random-access sequence source (PackedSequences, a mixture).

    Fixed global batches, or with `ramp` the batch sizes of zaya_jax.data.ramp (an endless source).
    """
    ds = grain.MapDataset.source(sequences)
    ds = ds[process_index::process_count]  # interleaved rows: see "Sharding" in the module doc
    if ramp is None:
        # The total is a multiple of the global batch, so every local batch is full.
        ds = ds.batch(global_batch_size // process_count, drop_remainder=True)
    else:
        ds = grain.MapDataset.source(RampBatches(ds, ramp, process_count))
    return ds.to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    )


def make_eval_dataset(
    source: Source = None,
    *,
    seq_len: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    **kwargs,
) -> grain.IterDataset:
    """One deterministic pass over the held-out split (documents in stored order, no shuffling).

    The last batch is filled with padding (loss_mask 0); every process yields the same number of batches.
    """
    return make_dataset(
        source,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        split="eval",
        num_epochs=1,
        shuffle=False,
        **kwargs,
    )


def interleave_process_batches(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Reassembles the global batch from every process' local batch (list indexed by process).

    Inverse of the sharding: global row r*P + p is row r of process p. Useful for tests and debugging;
    training never needs the global batch on one host.
    """
    return {
        k: np.stack([b[k] for b in batches], axis=1).reshape(-1, *batches[0][k].shape[1:]) for k in batches[0]
    }


__all__ = [
    "PackedSequences",
    "batch_sequences",
    "interleave_process_batches",
    "load_documents",
    "make_dataset",
    "make_eval_dataset",
    "source_tokenizer",
    "tokenizer_info",
]
