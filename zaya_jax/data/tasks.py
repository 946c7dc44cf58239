"""Evaluation data specs: one `--data SPEC` (or `eval.tasks` entry) -> a `Task`, its kind read off
the path or forced with a "kind:" prefix (the table is in zaya_jax/evaluate/__init__.py).

Here, below both the config and the evaluator, so that validating a config never imports the
evaluator (which imports the model and the checkpoint loader).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

KINDS = ("tokens", "text", "mc")


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # "tokens" | "text" | "mc"
    path: str  # "embedded" for the embedded corpus
    name: str


def parse_data_spec(spec: str) -> Task:
    """A --data SPEC -> Task (see the module docstring); FileNotFoundError / ValueError if unusable."""
    kind, _, rest = spec.partition(":")
    if kind in KINDS and rest:
        path, forced = rest, kind
    else:
        path, forced = spec, None
    if path == "embedded":
        if forced not in (None, "tokens"):
            raise ValueError(f"--data {spec}: the embedded corpus is token data, not {forced}")
        return Task("tokens", "embedded", "embedded")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {spec}: {path} does not exist")
    name = os.path.basename(os.path.normpath(path))
    for suffix in (".gz", ".jsonl", ".txt"):
        name = name.removesuffix(suffix)
    if forced:
        return Task(forced, path, name)
    if os.path.isdir(path):
        return Task("tokens", path, name)
    base = path.removesuffix(".gz")
    if base.endswith(".txt"):
        return Task("text", path, name)
    if base.endswith(".jsonl"):
        return Task("mc" if "choices" in _first_row(path) else "text", path, name)
    raise ValueError(
        f"--data {spec}: cannot tell the kind of {path}; expected a prepared directory, .txt or .jsonl "
        "(optionally .gz), or a tokens:/text:/mc: prefix"
    )


def _first_row(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
                return row if isinstance(row, dict) else {}
    raise ValueError(f"{path} is empty")
