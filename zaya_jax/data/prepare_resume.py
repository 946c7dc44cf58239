"""`prepare --resume`: the shards a run has written outlive an interrupt (Ctrl-C, SIGTERM, kill -9,
a lost machine), and the same command continues from them without tokenizing their documents again.

With --resume the shards are written into STATE, a directory `.NAME.prepare-resume` beside
`--out NAME` (its name starts with a dot and it never holds meta.json, so it never looks like a
dataset). After each shard, STATE/progress.json records, in one atomic rename: the options and
inputs of the run (`run_options`), where in the inputs the written documents end, the shards, and
the documents not yet in a shard (STATE/pending_N.npz). A resumed run checks its options against
the recorded ones (any difference is refused), skips the inputs' documents already written
(reading, not tokenizing them) and goes on; its output is byte for byte what one uninterrupted
run writes. The finished dataset is moved to --out as without --resume, and STATE removed.

A run without --resume refuses to start while STATE holds shards (continue it with --resume, or
delete STATE to start over), so that a forgotten flag never throws away the work done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

PROGRESS = "progress.json"
_SUFFIX = ".prepare-resume"


def state_dir(out_dir: str | os.PathLike) -> Path:
    """STATE of `--out out_dir`: beside it, named after it."""
    out = Path(os.path.abspath(out_dir))
    return out.parent / f".{out.name}{_SUFFIX}"


def input_stamps(paths: list[Path]) -> list[dict]:
    """Each input's real path and its files' (name, size, mtime): a changed input is a different run."""
    stamps = []
    for p in paths:
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        names = [str(f.relative_to(p)) if f != p else "" for f in files]
        sizes = [[name, f.stat().st_size, f.stat().st_mtime_ns] for name, f in zip(names, files)]
        stamps.append({"path": os.path.realpath(p), "files": sizes})
    return stamps


def refuse_leftover(out_dir: str | os.PathLike) -> None:
    """ValueError when an interrupted `prepare --resume` of `out_dir` left shards behind."""
    state = state_dir(out_dir)
    if (state / PROGRESS).is_file():
        raise ValueError(
            f"an interrupted `prepare --resume` of --out {out_dir} left its shards in {state}: pass "
            "--resume to continue it, or delete that directory to start over"
        )


class ResumeState:
    """STATE of one run: `checkpoint` (the last progress.json, None when starting) and
    `pending` (its unwritten documents by split, "last" for the train document held back)."""

    def __init__(self, root: Path, options: dict):
        self.root, self.options = root, options
        self.checkpoint: dict | None = None
        self.pending: dict[str, list[np.ndarray]] = {}

    @classmethod
    def open(cls, out_dir: str | os.PathLike, options: dict) -> ResumeState:
        """The state of `out_dir`: the recorded one when there is one (ValueError if it was made
        with other options), else a new empty one."""
        state = cls(state_dir(out_dir), json.loads(json.dumps(options)))
        progress = state.root / PROGRESS
        if not progress.is_file():  # nothing was finished: start afresh
            shutil.rmtree(state.root, ignore_errors=True)
            state.root.mkdir(parents=True)
            return state
        try:
            checkpoint = json.loads(progress.read_text())
            recorded = checkpoint["options"]
            with np.load(state.root / checkpoint["pending"]) as npz:
                state.pending = {
                    k: _split_docs(npz[k], npz[k + "_lengths"]) for k in ("train", "eval", "last")
                }
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{progress}: unreadable ({e}); delete {state.root} to start over") from None
        changed = sorted(k for k in recorded.keys() | state.options.keys()
                         if recorded.get(k) != state.options.get(k))  # fmt: skip
        if changed:
            raise ValueError(
                f"--resume: the interrupted run in {state.root} had other {', '.join(changed)}: run "
                "the same command as it did, or delete that directory to start over"
            )
        state.checkpoint = checkpoint
        return state

    def save(self, position: dict, writers: dict, pending: dict[str, list[np.ndarray]]) -> None:
        """Records a checkpoint: the unwritten documents first, then progress.json in one rename."""
        number = 0 if self.checkpoint is None else int(self.checkpoint["pending"][8:-4]) + 1
        name = f"pending_{number:06d}.npz"
        arrays = {}
        for key, docs in pending.items():
            arrays[key] = np.concatenate(docs) if docs else np.zeros(0, np.int64)
            arrays[key + "_lengths"] = np.asarray([len(d) for d in docs], np.int64)
        with open(self.root / name, "wb") as f:
            np.savez(f, **arrays)
        checkpoint = {"options": self.options, "pending": name, **position,
                      "writers": {s: w.summary() for s, w in writers.items()}}  # fmt: skip
        tmp = self.root / (PROGRESS + ".tmp")
        tmp.write_text(json.dumps(checkpoint, indent=1) + "\n")
        os.replace(tmp, self.root / PROGRESS)
        if self.checkpoint is not None:
            (self.root / self.checkpoint["pending"]).unlink(missing_ok=True)
        self.checkpoint = checkpoint

    def forget(self) -> None:
        """No checkpoint any more (the shards are being moved out)."""
        (self.root / PROGRESS).unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _split_docs(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    ends = np.cumsum(lengths)
    return [tokens[e - n : e] for e, n in zip(ends, lengths)]


__all__ = ["PROGRESS", "ResumeState", "input_stamps", "refuse_leftover", "state_dir"]
