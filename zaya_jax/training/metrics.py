"""The training metrics sink: a JSONL file, TensorBoard scalars and a console progress line.

    with MetricsLogger(workdir, total_steps=10_000, resume_step=restored_step) as log:
        log.log_train(step, {"loss": loss, "lr": lr, "tokens_per_sec": tps, "mfu": mfu,
                             "expert_load_max_over_mean": load_l})        # load_l: [L]
        log.log_eval(step, {"loss": eval_loss})

The files it writes and their format: docs/reference/metrics.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self, TextIO

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TRAIN, EVAL = "train", "eval"


def to_python(value: Any) -> Any:
    """numpy/jax scalars and arrays -> Python bool/int/float or (nested) lists; others unchanged."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        arr = np.asarray(value)  # a jax array is fetched from its device here
        if arr.dtype == np.bool_:
            pass
        elif np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.int64)
        elif arr.dtype.name == "bfloat16" or (
            np.issubdtype(arr.dtype, np.floating) and arr.dtype.itemsize <= 4
        ):
            # str of a numpy float32 is its shortest round-trip decimal; float() of that prints the same
            short = np.array([float(str(v)) for v in arr.astype(np.float32).ravel()], np.float64)
            arr = short.reshape(arr.shape)
        elif np.issubdtype(arr.dtype, np.number):
            arr = arr.astype(np.float64)
        return arr.tolist()  # 0-d -> Python scalar, n-d -> nested lists
    return value


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a/b": x}, values converted with :func:`to_python`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = to_python(value)
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_INVALID_TAG = re.compile(r"[^-/\w.]")  # tensorboardX's rule for tags (add_scalar's _clean_tag)


def tensorboard_scalars(tag: str, value: Any) -> list[tuple[str, float]]:
    """(tag, value) scalars of one record value: a number as `tag`; a per-layer list [L] as
    `tag/layer_{l}`; a per-layer per-expert list [L][E] as `tag/layer_{l}/expert_{e}`; anything
    else (text, flags, other shapes) none."""
    tag = _INVALID_TAG.sub("_", tag)
    if _number(value):
        return [(tag, float(value))]
    if not isinstance(value, list):
        return []
    if all(_number(v) for v in value):
        return [(f"{tag}/layer_{i}", float(v)) for i, v in enumerate(value)]
    if all(isinstance(row, list) and all(_number(v) for v in row) for row in value):
        return [
            (f"{tag}/layer_{i}/expert_{j}", float(v))
            for i, row in enumerate(value)
            for j, v in enumerate(row)
        ]
    return []


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file. A torn last line (the process died mid-write) is dropped;
    a malformed line anywhere else is an error: the file is not ours or is corrupt."""
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record: {e}") from e
    return records


def read_metrics(workdir: str | os.PathLike, split: str | None = None) -> list[dict[str, Any]]:
    """All records of ``WORKDIR/metrics.jsonl`` in file order (optionally one split only).
    Raises FileNotFoundError if the file does not exist."""
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {workdir}")
    records = _parse_lines(path)
    return records if split is None else [r for r in records if r.get("split") == split]


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop the records with step > ``step`` from a metrics file (atomically: a temp file is
    renamed over it, so a crash leaves either the old or the new file). Returns how many."""
    path = Path(path)
    if not path.is_file():
        return 0
    records = _parse_lines(path)
    keep = [r for r in records if int(r.get("step", -1)) <= step]
    dropped = len(records) - len(keep)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (the process died mid-write), so the next append
    does not glue a record onto the fragment."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)  # rfind = -1 (one torn line only) -> empty file


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt_num(x: float) -> str:
    """Human-scaled count: 1234567 -> 1.23M."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def _checked(flat: dict[str, Any]) -> dict[str, Any]:
    for key in ("step", "split"):
        if key in flat:
            raise ValueError(f"metric name {key!r} is reserved (it is the record's {key})")
    return flat


def _scalar(values: Mapping[str, Any], *keys: str) -> float | None:
    for key in keys:
        v = values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported lazily (plotting and reading need no tensorboardX) and
    without torch: tensorboardX imports torch whenever it is installed, only to accept torch
    tensors, which nothing here passes (~180 MB of resident memory and a second of start-up in the
    trainer). A torch that is already imported is left alone."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's own fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLogger:
    """Writes train/eval metrics to ``WORKDIR/metrics.jsonl``, TensorBoard and the console.

    workdir: created if missing. tensorboard / console: enable those sinks. total_steps: for
    the progress bar and the ETA. resume_step: the step the run was restored at; later records
    are dropped (see module docstring). stream: console output (default sys.stdout); whether
    it is a TTY decides between an in-place bar and plain lines.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        console: bool = True,
        total_steps: int | None = None,
        resume_step: int | None = None,
        stream: TextIO | None = None,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILE
        self.total_steps = total_steps
        if resume_step is not None:
            self.truncate_after(resume_step)
        _drop_torn_tail(self.path)
        # Line-buffered append; every record is flushed too, so `tail -f` and a crash both see
        # whole lines up to the last log call.
        self._file = open(self.path, "a", buffering=1)
        self._writer = None
        if tensorboard:
            purge = None if resume_step is None else resume_step + 1
            self._writer = _summary_writer()(str(self.workdir / TENSORBOARD_DIR), purge_step=purge)
        self._console = console
        self._stream = stream if stream is not None else sys.stdout
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._line_open = False  # a \r progress line is on screen without its newline
        # ETA from the wall-clock rate since the first log call (which includes compilation,
        # so it is the reference point, not part of the rate).
        self._t0: float | None = None
        self._step0: int | None = None

    # -- sinks -------------------------------------------------------------------------------

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _tensorboard(self, split: str, step: int, values: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        from tensorboardX.proto.summary_pb2 import Summary

        scalars = []
        for key, value in values.items():
            if split == EVAL and key.startswith("eval_"):
                key = key[len("eval_") :]
            scalars += tensorboard_scalars(f"{split}/{key}", value)
        if scalars:
            summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in scalars])
            # The writer add_scalar writes to (created on first use, with the resume's purge event).
            self._writer._get_file_writer().add_summary(summary, step)

    def _print(self, text: str, *, in_place: bool) -> None:
        if not self._console:
            return
        if self._tty and in_place:
            self._stream.write("\r\x1b[2K" + text)  # \x1b[2K: clear the longer previous line
            self._line_open = True
        else:
            if self._line_open:
                self._stream.write("\n")
            self._stream.write(text + "\n")
            self._line_open = False
        self._stream.flush()

    # -- public API --------------------------------------------------------------------------

    def log_train(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Record train metrics of ``step``; returns the JSON record written."""
        step = int(step)
        flat = _checked(flatten(values))
        record = {"step": step, "split": TRAIN, "time": time.time(), **flat}
        self._write(record)
        self._tensorboard(TRAIN, step, flat)
        self._print(self._progress(step, flat), in_place=True)
        return record

    def log_eval(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Record eval metrics of ``step`` (keys prefixed ``eval_``); returns the record."""
        step = int(step)
        flat = {
            (k if k.startswith("eval_") else f"eval_{k}"): v for k, v in _checked(flatten(values)).items()
        }
        loss = flat.get("eval_loss")
        if "eval_perplexity" not in flat and isinstance(loss, (int, float)):
            flat["eval_perplexity"] = math.exp(min(loss, 700.0))  # 700: exp overflows float64
        record = {"step": step, "split": EVAL, "time": time.time(), **flat}
        self._write(record)
        self._tensorboard(EVAL, step, flat)
        if self._writer is not None:
            self._writer.flush()  # evals are rare; make them visible in TensorBoard at once
        parts = [f"eval step {step}"]
        parts += [
            f"{k[len('eval_') :]} {v:.4g}"
            for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        self._print(" | ".join(parts), in_place=False)
        return record

    def truncate_after(self, step: int) -> int:
        """Drop records with step > ``step`` from metrics.jsonl; returns how many were dropped."""
        reopen = getattr(self, "_file", None) is not None and not self._file.closed
        if reopen:
            self._file.close()  # the rewrite replaces the file: an old handle would write nowhere
        dropped = truncate_metrics(self.path, step)
        if reopen:
            self._file = open(self.path, "a", buffering=1)
        return dropped

    def close(self) -> None:
        if self._line_open and self._console:
            self._stream.write("\n")
            self._stream.flush()
            self._line_open = False
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- console -----------------------------------------------------------------------------

    def _progress(self, step: int, values: Mapping[str, Any]) -> str:
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._step0 = now, step
        total = self.total_steps
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        loss = _scalar(values, "loss")
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        lr = _scalar(values, "lr", "learning_rate")
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        tps = _scalar(values, "tokens_per_sec", "tokens_per_second")
        if tps is not None:
            parts.append(f"{_fmt_num(tps)} tok/s")
        mfu = _scalar(values, "mfu")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        done = step - self._step0
        if total and done > 0 and now > self._t0:
            rate = done / (now - self._t0)
            parts.append(f"ETA {_fmt_duration((total - step) / rate)}")
        line = " | ".join(parts)
        if self._tty and total:
            width = 24
            frac = min(max(step / total, 0.0), 1.0)
            fill = round(frac * width)
            line = f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}% " + line
        return line
