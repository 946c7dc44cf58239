"""Megatron indexed datasets on disk (`PREFIX.bin` + `PREFIX.idx`, megatron-core's
IndexedDataset): the index read and checked, the token ids scanned, and both files written byte
for byte as megatron-core's IndexedDatasetBuilder writes them.

`.idx` layout, little-endian, as megatron/core/datasets/indexed_dataset.py writes it:
    magic b"MMIDIDX\\x00\\x00" (9 bytes), version <Q (1), dtype code <B, sequence count S <Q,
    document index count D + 1 <Q, sequence_lengths int32 [S], sequence_pointers int64 [S]
    (byte offsets into `.bin`), document_indices int64 [D + 1] (document d is the sequences
    document_indices[d] .. document_indices[d + 1] - 1: one sequence per document, or one per
    sentence when preprocessing split sentences), then, in multimodal datasets only, int8 [S]
    modes (not read).
dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6 float64 and 7 float32 hold
no token ids and are refused.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOAT_CODES = {6: "float64", 7: "float32"}
_SCAN_BYTES = 1 << 26  # .bin bytes per read of the token-id scan


def megatron_prefix(source) -> str | None:
    """The Megatron prefix `source` names (PREFIX, PREFIX.bin or PREFIX.idx), or None when
    `source` is not one (no PREFIX.idx next to it; a directory is never one)."""
    if source is None:
        return None
    path = os.fspath(source)
    if path.endswith((".bin", ".idx")):
        path = path[:-4]
    if os.path.isdir(path) or not os.path.isfile(path + ".idx"):
        return None
    return path


@dataclasses.dataclass(frozen=True)
class MegatronIndex:
    """One `.idx` file, checked against its `.bin` (arrays are views of the memory-mapped file)."""

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S], bytes
    document_indices: np.ndarray  # int64 [D + 1]

    @property
    def bin_path(self) -> str:
        return self.prefix + ".bin"


def read_index(prefix: str) -> MegatronIndex:
    """Reads and checks PREFIX.idx (magic, version, dtype, size) and that PREFIX.bin holds every
    token it points to; ValueError naming the file (and the document) otherwise."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size or not header.startswith(MAGIC):
        raise ValueError(f"{idx_path}: not a Megatron index (magic {header[:9]!r}, expected {MAGIC!r})")
    _, version, code, seqs, doc_entries = _HEADER.unpack(header)
    if version != VERSION:
        raise ValueError(f"{idx_path}: Megatron index version {version}; only version {VERSION} is read")
    if code in FLOAT_CODES:
        raise ValueError(f"{idx_path}: the tokens are {FLOAT_CODES[code]}; token ids must be integers")
    if code not in DTYPES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (Megatron's are {sorted(DTYPES)})")
    need = _HEADER.size + 12 * seqs + 8 * doc_entries
    size = os.path.getsize(idx_path)
    if size < need:
        raise ValueError(f"{idx_path}: {size:,} bytes, its header needs {need:,} (a truncated index?)")
    if not os.path.isfile(bin_path):
        raise FileNotFoundError(f"{bin_path}: missing (the data file of {idx_path})")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, np.int32, seqs, _HEADER.size)
    pointers = np.frombuffer(raw, np.int64, seqs, _HEADER.size + 4 * seqs)
    doc_idx = np.frombuffer(raw, np.int64, doc_entries, _HEADER.size + 12 * seqs)
    index = MegatronIndex(prefix, np.dtype(DTYPES[code]), lengths, pointers, doc_idx)
    _check_layout(index, idx_path)
    return index


def _check_layout(index: MegatronIndex, idx_path: str) -> None:
    """document_indices ascend from 0 to S; each document's sequences lie back to back inside .bin."""
    doc_idx, lengths, pointers = index.document_indices, index.sequence_lengths, index.sequence_pointers
    seqs = len(lengths)
    if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != seqs or np.any(np.diff(doc_idx) < 0):
        raise ValueError(f"{idx_path}: document_indices do not run from 0 to the {seqs:,} sequences")
    if np.any(lengths < 0):
        raise ValueError(f"{idx_path}: a negative sequence length")
    item = index.dtype.itemsize
    ends = pointers + lengths.astype(np.int64) * item
    first_of_doc = np.zeros(seqs, bool)
    first_of_doc[doc_idx[:-1][doc_idx[:-1] < seqs]] = True
    gap = ~first_of_doc[1:] & (pointers[1:] != ends[:-1])
    if np.any(gap) or np.any(pointers % item):
        raise ValueError(f"{idx_path}: a document's sequences are not stored back to back in the .bin")
    bin_size = os.path.getsize(index.bin_path)
    if seqs and (np.any(pointers < 0) or int(ends.max()) > bin_size):
        seq = int(np.argmax((ends > bin_size) | (pointers < 0)))
        doc = int(np.searchsorted(doc_idx, seq, side="right")) - 1
        raise ValueError(
            f"{index.bin_path}: {bin_size:,} bytes, but {idx_path} puts document {doc} at bytes "
            f"{int(pointers[seq]):,}..{int(ends[seq]):,} (a truncated .bin?)"
        )


@dataclasses.dataclass(frozen=True)
class Documents:
    """The non-empty documents of an index: start (tokens into .bin) and length, in stored order."""

    start: np.ndarray  # int64 [D']
    length: np.ndarray  # int64 [D']
    stored: np.ndarray  # int64 [D'], the document's number in the .idx (for messages)


def document_table(index: MegatronIndex) -> Documents:
    doc_idx = index.document_indices
    seq_cum = np.concatenate([[0], np.cumsum(index.sequence_lengths, dtype=np.int64)])
    length = seq_cum[doc_idx[1:]] - seq_cum[doc_idx[:-1]]
    stored = np.flatnonzero(length > 0)
    start = index.sequence_pointers[doc_idx[:-1][stored]] // index.dtype.itemsize
    return Documents(start.astype(np.int64), length[stored], stored.astype(np.int64))


# ----------------------------------------------------------------------------------------------
# Token-id scan


def check_token_ids(prefix: str, vocab_size: int, progress: Callable[[str], None] | None = None) -> int:
    """Scans PREFIX.bin once for token ids outside [0, vocab_size), reading it in 64 MiB chunks
    (not through the memory map, so the scan leaves nothing resident in this process); ValueError
    naming the file and document of the first one. Skipped when the dtype cannot hold such an id.
    Returns the bytes scanned."""
    index = read_index(prefix)
    info = np.iinfo(index.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return 0
    docs = document_table(index)
    end = int((docs.start[-1] + docs.length[-1]) * index.dtype.itemsize) if len(docs.start) else 0
    started, last_report, done = time.monotonic(), time.monotonic(), 0
    buffer = np.empty(_SCAN_BYTES // index.dtype.itemsize, index.dtype)  # reused: one read buffer
    with open(index.bin_path, "rb", buffering=0) as f:
        while done < end:
            chunk = buffer[: f.readinto(memoryview(buffer).cast("B")[: end - done]) // index.dtype.itemsize]
            if len(chunk) == 0:
                break
            # max / min are single passes; positions are looked for only when one is out of range
            if int(chunk.max()) >= vocab_size or (info.min < 0 and int(chunk.min()) < 0):
                bad = (chunk >= vocab_size) | (chunk < 0)
                _report_bad_token(index, docs, done // index.dtype.itemsize, chunk, bad, vocab_size)
            done += chunk.nbytes
            if progress is not None and time.monotonic() - last_report > 2.0:
                last_report = time.monotonic()
                progress(
                    f"scanning {index.bin_path} for token ids >= {vocab_size}: "
                    f"{done / end:.0%} of {end / 2**30:.2f} GiB"
                )
    if progress is not None and end >= _SCAN_BYTES:
        progress(f"scanned {index.bin_path}: {end / 2**30:.2f} GiB in {time.monotonic() - started:.1f} s")
    return end


def _report_bad_token(index: MegatronIndex, docs: Documents, first: int, chunk, bad, vocab_size: int):
    """Raises for the first out-of-range token of `chunk` (.bin tokens from `first` on) that lies
    in a document (bytes between documents belong to none)."""
    pos = first + np.flatnonzero(bad)
    k = np.searchsorted(docs.start, pos, side="right") - 1
    inside = (k >= 0) & (pos < docs.start[np.maximum(k, 0)] + docs.length[np.maximum(k, 0)])
    if inside.any():
        i = int(np.argmax(inside))
        doc, at = int(k[i]), int(pos[i])
        raise ValueError(
            f"{index.bin_path}: document {int(docs.stored[doc])} (token {at - int(docs.start[doc])}) "
            f"holds token id {int(chunk[at - first])}, outside the tokenizer's vocabulary "
            f"[0, {vocab_size}) (another tokenizer wrote it? see config.data.tokenizer)"
        )


# ----------------------------------------------------------------------------------------------
# Writing


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocessing picks for a vocabulary (DType.optimal_dtype)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class MegatronWriter:
    """Writes PREFIX.bin + PREFIX.idx byte for byte as megatron-core's IndexedDatasetBuilder does
    Both are built under temporary names and renamed into place by
    `finish`, the .idx last, so an interrupted run leaves no index that looks complete."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        code = {np.dtype(t): c for c, t in DTYPES.items()}.get(self.dtype)
        if code is None:
            raise ValueError(f"Megatron datasets hold no {self.dtype} tokens")
        self.code = code
        folder = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(folder, exist_ok=True)
        fd, self._tmp_bin = tempfile.mkstemp(prefix=f".{os.path.basename(self.prefix)}.bin.", dir=folder)
        self._bin = os.fdopen(fd, "wb")
        self.lengths: list[int] = []  # per sequence
        self.doc_ends: list[int] = [0]  # document_indices

    def add(self, doc: np.ndarray, sentence_lengths: list[int] | None = None) -> None:
        """One document (its EOD included, if it has one), stored as one sequence or, as with
        sentence splitting, as sequences of `sentence_lengths` tokens (IndexedDatasetBuilder's
        add_document)."""
        info = np.iinfo(self.dtype)
        if len(doc) and (int(np.min(doc)) < info.min or int(np.max(doc)) > info.max):
            raise ValueError(f"a token id of document {len(self.doc_ends) - 1} does not fit {self.dtype}")
        lengths = [len(doc)] if sentence_lengths is None else list(sentence_lengths)
        if sum(lengths) != len(doc):
            raise ValueError(f"sentence lengths {lengths} do not add up to the document's {len(doc)} tokens")
        self._bin.write(np.asarray(doc, self.dtype).tobytes(order="C"))
        self.lengths.extend(lengths)
        self.doc_ends.append(len(self.lengths))

    def finish(self) -> dict:
        """Publishes the files; returns the counts."""
        self._bin.close()
        lengths = np.asarray(self.lengths, np.int64)
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1] * self.dtype.itemsize)]).astype(np.int64)
        doc_idx = np.asarray(self.doc_ends, np.int64)
        header = _HEADER.pack(MAGIC, VERSION, self.code, len(lengths), len(doc_idx))
        fd, tmp_idx = tempfile.mkstemp(prefix=f".{os.path.basename(self.prefix)}.idx.",
                                       dir=os.path.dirname(self._tmp_bin))  # fmt: skip
        with os.fdopen(fd, "wb") as f:
            for part in (header, lengths.astype(np.int32), pointers[: len(lengths)], doc_idx):
                f.write(part if isinstance(part, bytes) else part.tobytes(order="C"))
        for tmp in (self._tmp_bin, tmp_idx):
            os.chmod(tmp, 0o644)
        # An old .idx goes first: a .bin replaced under it would look like a complete dataset.
        Path(self.prefix + ".idx").unlink(missing_ok=True)
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")
        return {"num_docs": len(doc_idx) - 1, "num_tokens": int(lengths.sum()), "dtype": self.dtype.name}

    def abort(self) -> None:
        self._bin.close()
        Path(self._tmp_bin).unlink(missing_ok=True)


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = [
    "DTYPES",
    "MegatronIndex",
    "MegatronWriter",
    "check_token_ids",
    "document_table",
    "megatron_dtype",
    "megatron_prefix",
    "read_index",
    "stderr_progress",
]
