"""The run's event log: WORKDIR/events.jsonl, one JSON object per line.

    {"step": 120, "kind": "rollback", "details": {...}, "time": 1763771234.5}

Kinds written by the trainer: resume, save, skipped_update, spike, rollback, sigterm, watchdog,
corrupt_checkpoint. Each line is flushed (and fsynced) as it is written, so the record survives a
crash or `kill -9` right after it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class EventLog:
    def __init__(self, workdir: str, *, enabled: bool = True):
        self.path = os.path.join(workdir, "events.jsonl")
        self.enabled = enabled
        if enabled:
            os.makedirs(workdir, exist_ok=True)

    def write(self, step: int, kind: str, **details: Any) -> dict[str, Any]:
        record = {"step": int(step), "kind": kind, "details": details, "time": time.time()}
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=_default) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return record


def _default(x: Any) -> Any:
    try:
        return x.item()
    except AttributeError:
        return str(x)


def read_events(workdir: str, kind: str | None = None) -> list[dict[str, Any]]:
    path = os.path.join(workdir, "events.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line after a crash
            if kind is None or record["kind"] == kind:
                out.append(record)
    return out
