"""Pieces every systems benchmark shares: simulated CPU devices and the JSON report."""

from __future__ import annotations

import json
import os
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
