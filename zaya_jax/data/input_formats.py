"""The columnar and compressed inputs of `prepare`: parquet files, Hugging Face datasets saved to
disk, and zstd-compressed text; each streamed, never read whole into memory.

    .parquet            the `--text-field` column, one row group's batches at a time (pyarrow)
    DIR (save_to_disk)  a `datasets` Dataset saved with `save_to_disk`: its state.json lists the
                        arrow files (IPC streams) in order, read batch by batch (pyarrow; the
                        `datasets` package is not needed). A DatasetDict's directory is refused:
                        name one split's directory.
    .zst                zstd-compressed .txt / .jsonl (`zstandard`)

pyarrow and zstandard are the optional extra `data` (`pip install 'zaya_jax[data]'`); a missing
one is an error naming the package when such an input is given.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

HF_STATE = "state.json"
HF_DICT = "dataset_dict.json"
_BATCH_ROWS = 1024  # rows per record batch read from parquet


def _need(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(
            f"reading {what} needs the {module.split('.')[0]} package (pip install 'zaya_jax[data]')"
        ) from None


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and ((path / HF_STATE).is_file() or (path / HF_DICT).is_file())


def open_zst_text(raw: io.BufferedIOBase, path: Path) -> io.TextIOBase:
    """Text of the zstd stream `raw` (the file `path`), decompressed as it is read."""
    zstandard = _need("zstandard", f"{path}")
    stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.TextIOWrapper(stream, encoding="utf-8")


def hf_arrow_files(path: Path) -> list[Path]:
    """The arrow files of a dataset saved with `save_to_disk`, in row order."""
    if (path / HF_DICT).is_file():
        splits = json.loads((path / HF_DICT).read_text()).get("splits", [])
        raise ValueError(
            f"{path} holds a DatasetDict (splits {splits}): give one split's directory, e.g. {path / 'train'}"
        )
    try:
        state = json.loads((path / HF_STATE).read_text())
        files = [path / f["filename"] for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path / HF_STATE}: not a dataset's state ({e})") from None
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (listed in {path / HF_STATE})")
    return files


def text_columns(path: Path, kind: str) -> list[str]:
    """The column names of a parquet file or a saved HF dataset (read from the schema only)."""
    pa = _need("pyarrow", f"{path}")
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except pa.ArrowException as e:
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    files = hf_arrow_files(path)
    if not files:
        return []
    with pa.memory_map(str(files[0])) as source:
        return list(pa.ipc.open_stream(source).schema.names)


def check_text_column(path: Path, kind: str, text_field: str) -> None:
    columns = text_columns(path, kind)
    if text_field not in columns:
        raise ValueError(
            f"{path} has no column {text_field!r} (columns: {', '.join(columns)}); see --text-field"
        )


def _texts_of_batches(batches, path: Path, text_field: str, first_row: int = 0) -> Iterator[str]:
    row = first_row
    for batch in batches:
        for value in batch.column(text_field).to_pylist():
            if not isinstance(value, str):
                raise ValueError(f"{path}: row {row}: {text_field!r} is {type(value).__name__}, not a string")
            yield value
            row += 1


def iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    """The text column of a parquet file, streamed in record batches."""
    _need("pyarrow", f"{path}")
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    batches = pf.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field])
    yield from _texts_of_batches(batches, path, text_field)


def iter_hf_dataset(path: Path, text_field: str) -> Iterator[str]:
    """The text column of a saved HF dataset, arrow file by arrow file, batch by batch."""
    pa = _need("pyarrow", f"{path}")
    rows = 0
    for f in hf_arrow_files(path):
        with pa.memory_map(str(f)) as source:
            reader = pa.ipc.open_stream(source)
            for text in _texts_of_batches(reader, path, text_field, rows):
                rows += 1
                yield text


__all__ = [
    "check_text_column",
    "hf_arrow_files",
    "is_hf_dataset_dir",
    "iter_hf_dataset",
    "iter_parquet",
    "open_zst_text",
    "text_columns",
]
