"""A GPU's figures for the step-time model (zaya_jax/analysis/timeline.py), as data: one JSON file per target
in zaya_jax/gpu_targets/ (`mi300x.json`, `h100.json`, `h200.json`), every number with its source in
the file's `sources` object.

Keys (per device; bandwidths in bytes per second):

  name                              the device, for reports
  peak_flops_per_second             dense peak by dtype: {"bfloat16": ..., "float32": ..., ...}
  hbm_bytes_per_second              memory bandwidth a memory-bound kernel reaches
  memory_bytes                      device memory a step must fit in
  gpus_per_node                     devices that share the intra-node links
  intra_node_bus_bytes_per_second   collective bus bandwidth of a group inside one node
  inter_node_bus_bytes_per_second   collective bus bandwidth of a group spanning nodes
  collective_latency_seconds        added to every collective
optional:
  intra_node_links                  "switch" (every group gets the full bandwidth, NVSwitch) or
                                    "fully_connected" (point to point, xGMI: a group of n gets
                                    (n-1) / (gpus_per_node-1) of it)
  max_achievable_flops_per_second   by dtype: a measured ceiling, reported beside the peak MFU
  kernel_overhead_seconds           launch and ramp time added to every kernel
  gemm_efficiency                   [[GEMM FLOPs, fraction of peak], ...] by increasing FLOPs,
                                    interpolated in log FLOPs, clamped at both ends
  kernel_efficiency                 {kernel name or "default": fraction of peak} for our Triton
                                    kernels (their FLOPs and bytes over the peak times it)
  sources                           {key: where its number comes from}

A user's file (`--dry_run_hardware=FILE`) holds any of these keys and overrides the target's; a
by-dtype or by-name object is merged key by key. The merged dict (the report's `hardware` object)
is itself a valid file.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from importlib import resources
from typing import Any

REQUIRED = (
    "name",
    "peak_flops_per_second",
    "hbm_bytes_per_second",
    "memory_bytes",
    "gpus_per_node",
    "intra_node_bus_bytes_per_second",
    "inter_node_bus_bytes_per_second",
    "collective_latency_seconds",
)
OPTIONAL = (
    "intra_node_links",
    "max_achievable_flops_per_second",
    "kernel_overhead_seconds",
    "gemm_efficiency",
    "kernel_efficiency",
    "sources",
)
_POSITIVE = (
    "hbm_bytes_per_second",
    "memory_bytes",
    "intra_node_bus_bytes_per_second",
    "inter_node_bus_bytes_per_second",
)
_BY_KEY = ("peak_flops_per_second", "max_achievable_flops_per_second", "kernel_efficiency", "sources")
LINKS = ("switch", "fully_connected")
# Targets with a hardware file: the names of zaya_jax.runtime.gpu_target.TARGETS.
FILES = {"mi300x": "mi300x.json", "h100": "h100.json", "h200": "h200.json"}
# A target config file's arch picks the figures it starts from (its name and memory are the file's).
BY_ARCH = {"gfx942": "mi300x", "sm_90": "h100"}


def _number(x: Any, key: str, low: float = 0.0, open_low: bool = True, high: float = math.inf) -> float:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not ok or x < low or (open_low and x == low) or x > high:
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        raise ValueError(
            f"{key}: must be a number {bound}"
            + (f" and <= {high:g}" if high < math.inf else "")
            + f", got {x!r}"
        )
    return float(x)


def _check_by_key(d: dict, key: str, high: float = math.inf) -> None:
    value = d[key]
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{key}: must be an object of numbers, got {value!r}")
    for k, v in value.items():
        _number(v, f"{key}.{k}", high=high)


def _check_table(table: Any) -> None:
    rows = table if isinstance(table, list) else None
    if not rows or any(not isinstance(r, list) or len(r) != 2 for r in rows):
        raise ValueError(
            f"gemm_efficiency: must be a list of [GEMM FLOPs, fraction of peak] pairs, got {table!r}"
        )
    for flops, eff in rows:
        _number(flops, "gemm_efficiency FLOPs")
        _number(eff, "gemm_efficiency fraction", high=1.0)
    if any(a[0] >= b[0] for a, b in itertools.pairwise(rows)):
        raise ValueError("gemm_efficiency: the GEMM FLOPs must increase row by row")


def check(d: dict, complete: bool = True) -> dict:
    """`d` if its keys and values are valid (all REQUIRED present when `complete`), else ValueError
    naming the first bad key."""
    unknown = sorted(set(d) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(REQUIRED + OPTIONAL)})")
    missing = [k for k in REQUIRED if k not in d] if complete else []
    if missing:
        raise ValueError(f"missing key {missing[0]!r}")
    if "name" in d and not isinstance(d["name"], str):
        raise ValueError(f"name: must be a string, got {d['name']!r}")
    for key in _POSITIVE:
        if key in d:
            _number(d[key], key)
    if "gpus_per_node" in d and (not isinstance(d["gpus_per_node"], int) or d["gpus_per_node"] < 1):
        raise ValueError(f"gpus_per_node: must be an int >= 1, got {d['gpus_per_node']!r}")
    for key in ("collective_latency_seconds", "kernel_overhead_seconds"):
        if key in d:
            _number(d[key], key, open_low=False)
    for key in ("peak_flops_per_second", "max_achievable_flops_per_second"):
        if key in d:
            _check_by_key(d, key)
    if complete and "bfloat16" not in d["peak_flops_per_second"]:
        raise ValueError("peak_flops_per_second: needs a 'bfloat16' entry (MFU is against it)")
    if "kernel_efficiency" in d:
        _check_by_key(d, "kernel_efficiency", high=1.0)
    if "gemm_efficiency" in d:
        _check_table(d["gemm_efficiency"])
    if "intra_node_links" in d and d["intra_node_links"] not in LINKS:
        raise ValueError(
            f"intra_node_links: must be one of {', '.join(LINKS)}, got {d['intra_node_links']!r}"
        )
    if "sources" in d and not all(isinstance(v, str) for v in (d["sources"] or {}).values()):
        raise ValueError("sources: must be an object of strings")
    return d


def builtin(target: str) -> dict:
    """The figures shipped for `target` (a key of FILES)."""
    text = resources.files("zaya_jax").joinpath("gpu_targets", FILES[target]).read_text()
    return check(json.loads(text))


def read_file(path: str) -> dict:
    """A user's hardware file: a JSON object of any of the keys (ValueError / OSError, one line)."""
    if not os.path.isfile(path):
        raise ValueError("no such file")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object of hardware keys")
    return check(d, complete=False)


def merged(base: dict | None, override: dict | None) -> dict:
    """`base` with `override`'s keys replacing its own (by-dtype / by-name objects merged key by
    key); ValueError when the result lacks a required key."""
    out = dict(base or {})
    for key, value in (override or {}).items():
        out[key] = {**out[key], **value} if key in _BY_KEY and isinstance(out.get(key), dict) else value
    return check(out)


def for_target(target: str, arch: str, name: str, memory_bytes: int, override: dict | None) -> dict | None:
    """The figures a prediction uses: the target's file (or, for a target config file, the file of
    its arch with its name and memory), then the user's `override` (which must complete them for
    an arch without a file; None when there is neither)."""
    if target in FILES:
        base = builtin(target)
    elif arch in BY_ARCH:
        base = {**builtin(BY_ARCH[arch]), "name": name, "memory_bytes": memory_bytes}
    elif not override:
        return None  # no figures for this GPU: no prediction
    else:
        base = None
    return merged(base, override)


def gemm_efficiency(hw: dict, flops: float) -> float:
    """The fraction of peak a GEMM of `flops` reaches: the table interpolated in log FLOPs (1 without
    a table)."""
    rows = hw.get("gemm_efficiency")
    if not rows:
        return 1.0
    if flops <= rows[0][0]:
        return rows[0][1]
    for (f0, e0), (f1, e1) in itertools.pairwise(rows):
        if flops <= f1:
            w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return e0 + w * (e1 - e0)
    return rows[-1][1]


def kernel_efficiency(hw: dict, kernel: str) -> float:
    """The fraction of peak our Triton kernel `kernel` reaches (its entry, else "default", else 1)."""
    table = hw.get("kernel_efficiency") or {}
    return table.get(kernel, table.get("default", 1.0))


def intra_node_bandwidth(hw: dict, group_size: int) -> float:
    """Bus bandwidth of a group of `group_size` devices inside one node."""
    bw = hw["intra_node_bus_bytes_per_second"]
    per_node = hw["gpus_per_node"]
    if hw.get("intra_node_links") == "fully_connected" and 1 < group_size < per_node:
        return bw * (group_size - 1) / (per_node - 1)  # one link per peer
    return bw
