"""Streaming safetensors reading and writing, one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {...}} and the raw little-endian tensor bytes. We read through a
memory map (a tensor is only paged in when it is converted) and write from a generator, so neither
direction ever holds a second full copy of the model. bfloat16 is handled through ml_dtypes, which
plain numpy lacks and the `safetensors` numpy API refuses.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as such (truncated, corrupt header, bad offsets)."""


def read_header(path: str) -> tuple[dict, int]:
    """Returns ({name: {dtype, shape, data_offsets}}, byte offset of the data section)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        start, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        expected = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
        if not 0 <= start <= end <= data_len or end - start != expected:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has offsets {start}..{end} inconsistent with "
                f"shape {info['shape']} {info['dtype']} and data size {data_len} "
                "(truncated or corrupt file)"
            )
    return header, 8 + n


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, read-only memory-mapped array) in file order."""
    header, base = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = info["data_offsets"]
        yield name, mm[base + start : base + end].view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write_file(
    path: str,
    specs: list[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Writes tensors named in `specs` (name, shape, dtype), asking `produce(name)` for each in turn.

    The header is written from the specs first, so each produced tensor can be dropped as soon as its
    bytes are on disk. Written to `path + ".tmp"` and renamed, so a crash never leaves a file that
    looks complete. Returns the number of data bytes.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section as the reference writer does
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in specs:
                arr = np.ascontiguousarray(produce(name), dtype=dtype)
                if arr.shape != tuple(shape):
                    raise ValueError(f"tensor {name!r}: produced shape {arr.shape}, declared {tuple(shape)}")
                f.write(arr.tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return offset


def plan_shards(
    specs: Iterable[tuple[str, tuple[int, ...], np.dtype]], max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...], np.dtype]]]:
    """Greedy split of tensors, in order, into shards of at most max_shard_bytes (a bigger tensor
    gets a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards
