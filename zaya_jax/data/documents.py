"""The documents of prepare's inputs: .txt cut by a separator, .jsonl, parquet and HF datasets
(zaya_jax.data.input_formats), compressed or not, read in order."""

from __future__ import annotations

import codecs
import collections
import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from zaya_jax.data import input_formats

_SEPARATORS = {"blank-line": re.compile(r"\n[ \t]*\n+"), "form-feed": "\f"}


def parse_separator(spec: str | None) -> str | re.Pattern | None:
    if spec is None or spec == "none":
        return None
    if spec in _SEPARATORS:
        return _SEPARATORS[spec]
    literal = codecs.decode(spec, "unicode_escape")
    if not literal:
        raise ValueError("--doc-separator must not be empty")
    return literal


def _open_text(path: Path, raw: io.BufferedIOBase | None = None) -> io.TextIOBase:
    """A text stream over `path` (decompressed), reading through `raw` when given (the caller
    then closes it)."""
    if path.suffix == ".gz":
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if raw is not None else gzip.open(path, "rb")
        return io.TextIOWrapper(stream, encoding="utf-8")
    raw = raw or open(path, "rb")
    if path.suffix == ".zst":
        return input_formats.open_zst_text(raw, path)
    return io.TextIOWrapper(raw, encoding="utf-8")


def _input_kind(path: Path) -> str:
    if input_formats.is_hf_dataset_dir(path):
        return "hf"
    name = path.name.removesuffix(".gz").removesuffix(".zst")
    for kind in ("txt", "jsonl", "parquet"):
        if name.endswith("." + kind) and not (kind == "parquet" and name != path.name):
            return kind
    raise ValueError(
        f"unsupported input {path}: expected .txt or .jsonl (optionally .gz / .zst), .parquet, "
        "or a directory written by a Hugging Face dataset's save_to_disk"
    )


def iter_documents(
    path: Path,
    *,
    separator: str | re.Pattern | None = None,
    text_field: str = "text",
    raw: io.BufferedIOBase | None = None,
) -> Iterator[str]:
    """Yields the raw documents of one input (see the module docstring for the rules); a text
    file is read through `raw` (its compressed bytes) when given."""
    kind = _input_kind(path)
    if kind == "parquet":
        yield from input_formats.iter_parquet(path, text_field)
        return
    if kind == "hf":
        yield from input_formats.iter_hf_dataset(path, text_field)
        return
    try:
        yield from _read_documents(path, kind, separator, text_field, raw)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}: {e.reason}); convert it to UTF-8 "
            "first (a latin-1 file: iconv -f latin1 -t utf-8 FILE > NEW)"
        ) from None


def _read_documents(
    path: Path,
    kind: str,
    separator: str | re.Pattern | None,
    text_field: str,
    raw: io.BufferedIOBase | None,
) -> Iterator[str]:
    with _open_text(path, raw) as f:
        if kind == "txt":
            yield from _split_text(f.read(), separator)
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object with a string field {text_field!r}"
                )
            yield record[text_field]


def _split_text(text: str, separator: str | re.Pattern | None) -> list[str]:
    if separator is None:
        return [text]
    if isinstance(separator, str):
        return text.split(separator)
    return separator.split(text)


class _Inputs:
    """The non-empty documents of every input in order (`texts()`), counting the empty ones
    skipped, and how far through the input bytes the reading is (`position()`, 0..1).
    `taken()` marks the next document as handed on to be written (the tokenizing runs ahead);
    `written()` says where those documents end, and `start_at` starts after them."""

    def __init__(self, paths: list[Path], separator, text_field: str):
        self.paths, self.separator, self.text_field = paths, separator, text_field
        self.sizes = [_input_size(p) for p in paths]
        self.skipped_by_input: list[int] = []  # empty documents of each input read to its end
        self._skipped_here = 0
        self._first_input, self._drop = 0, 0
        self._inputs_of_texts: collections.deque = collections.deque()
        self._at = (0, 0)  # (input, its non-empty documents) of the written documents
        self._done_bytes = 0
        self._raw: io.BufferedIOBase | None = None

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_input) + self._skipped_here

    def start_at(self, written: dict) -> None:
        """Skips the documents `written()` described (reading, not tokenizing them)."""
        self.skipped_by_input = list(written["skipped_by_input"])
        self._first_input = len(self.skipped_by_input)
        self._drop = written["docs_in_input"]
        self._at = (self._first_input, self._drop)
        self._done_bytes = sum(self.sizes[: self._first_input])

    def taken(self) -> None:
        i = self._inputs_of_texts.popleft()
        self._at = (i, (self._at[1] if i == self._at[0] else 0) + 1)

    def written(self) -> dict:
        return {"skipped_by_input": self.skipped_by_input[: self._at[0]], "docs_in_input": self._at[1]}

    def position(self) -> float:
        current = self._raw.tell() if self._raw is not None and not self._raw.closed else 0
        return (self._done_bytes + current) / max(sum(self.sizes), 1)

    def texts(self) -> Iterator[str]:
        for i in range(self._first_input, len(self.paths)):
            path, drop = self.paths[i], self._drop if i == self._first_input else 0
            self._raw = open(path, "rb") if path.is_file() else None
            try:
                for text in iter_documents(
                    path, separator=self.separator, text_field=self.text_field, raw=self._raw
                ):
                    if not text.strip():
                        self._skipped_here += 1
                    elif drop:
                        drop -= 1
                    else:
                        self._inputs_of_texts.append(i)
                        yield text
            finally:
                if self._raw is not None:
                    self._raw.close()
                self._raw = None
            self.skipped_by_input.append(self._skipped_here)
            self._skipped_here = 0
            self._done_bytes += self.sizes[i]


def _input_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
