"""Pieces every benchmark shares: simulated CPU devices, the printed table and the JSON report."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any


def simulate_cpu_devices(n: int | None) -> None:
    """Before jax is imported: run on `n` simulated CPU devices (unless XLA_FLAGS already sets a count)."""
    if not n:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def write_report(result: dict[str, Any], out_dir: str, name: str) -> str:
    """Writes `result` to OUT_DIR/NAME.json and says where."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path


def fmt(x: float | None, spec: str) -> str:
    """`format(x, spec)`, or "-" for a missing value (a side that was skipped)."""
    return "-" if x is None else format(x, spec)


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """rows[0] is the header: first column left-aligned, the others right-aligned, a rule under it."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
