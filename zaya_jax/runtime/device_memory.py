"""What a compiled step needs per device against what the devices have: the start-up check that
refuses a step too large for the machine instead of an out-of-memory failure at its first run.

Needed: XLA's buffer assignment of the compiled per-device program (`compiled.memory_analysis()`),
arguments + outputs - alias (the donated state reused for the new state) + temporaries.

Available (`budget`):
  GPU   the allocator's pool of the smallest device, `device.memory_stats()['bytes_limit']`
  CPU   this machine's available RAM: /proc/meminfo's MemAvailable, or the cgroup's limit less its
        usage where that is lower; the process' CPU devices share it, so a step needs its
        per-device bytes times the CPU devices it runs on
  ZAYA_JAX_MEMORY_LIMIT_BYTES (environment) replaces either figure (bytes per GPU, or the RAM on
        CPU): a smaller budget on a shared machine, or a test's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

LIMIT_ENV = "ZAYA_JAX_MEMORY_LIMIT_BYTES"
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def step_bytes(stats: Any) -> int:
    """Bytes a compiled step needs per device: arguments + outputs - alias + temporaries."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def size(nbytes: float) -> str:
    """Bytes in GiB (MiB below a GiB), two decimals."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_available(root: Path) -> int | None:
    """The cgroup's limit less its usage (cgroup v2, else v1), None without a limit."""
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_int(root / limit), _read_int(root / usage)
        if cap is not None and used is not None and cap < 2**60:  # v1's "no limit" is ~2**63
            return max(cap - used, 0)
    return None


def host_available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """This machine's RAM available to the process: MemAvailable, or the cgroup's room if lower."""
    found = [x for x in (_meminfo_available(meminfo), _cgroup_available(cgroup)) if x is not None]
    return min(found) if found else None


@dataclasses.dataclass(frozen=True)
class Budget:
    """Bytes the step may use, where they come from (`what`), and how many of the step's devices
    share them (CPU devices share the machine's RAM)."""

    bytes: int
    what: str
    sharing: int = 1


def budget(devices: list) -> Budget | None:
    """The memory the step's (local) devices have; None when it cannot be read."""
    if all(d.platform == "cpu" for d in devices):
        return host_budget(len(devices))
    override = limit_override()
    if override is not None:
        return Budget(override, f"the {LIMIT_ENV} limit")
    limits = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            limits.append(int(stats["bytes_limit"]))
    if not limits:
        return None
    return Budget(min(limits), f"the {devices[0].device_kind}'s memory (bytes_limit)")


def limit_override() -> int | None:
    """ZAYA_JAX_MEMORY_LIMIT_BYTES, when set."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{LIMIT_ENV}={text!r}: must be a whole number of bytes")
    return int(text)


def host_budget(sharing: int) -> Budget | None:
    """This machine's RAM for `sharing` CPU devices of one process (or the override)."""
    override = limit_override()
    if override is not None:
        return Budget(override, f"the {LIMIT_ENV} limit", sharing)
    available = host_available_bytes()
    return None if available is None else Budget(available, "this machine's available RAM", sharing)


def shortfall(stats: Any, devices: list, what: str, remedies: str) -> str | None:
    """The one-line refusal of a compiled program (`what`: "the train step") that does not fit
    `devices`, naming what it needs, what there is and `remedies`; None when it fits (or the
    budget cannot be read)."""
    have = budget(devices)
    need = step_bytes(stats) * (have.sharing if have else 1)
    if have is None or need <= have.bytes:
        return None
    cpu = all(d.platform == "cpu" for d in devices)
    per = f" ({size(step_bytes(stats))} per device x {have.sharing} CPU devices)" if have.sharing > 1 else ""
    per = per if cpu else " per device"
    return (
        f"{what} needs {size(need)}{per} (XLA's buffers: arguments + outputs - alias + temporaries) "
        f"but {have.what} is {size(have.bytes)}: {remedies}"
    )
