"""The dry run's predicted step (`train --dry_run --dry_run_target=GPU`): the compiled step's
timeline (zaya_jax/analysis/timeline.py) on the target's figures (zaya_jax/analysis/hardware.py),
with the model's FLOPs for MFU, as report rows and as the `--dry_run_json` report.

MFU is model FLOPs per device per step over step time x the bf16 peak; model FLOPs are
`zaya_jax.sizing.flops_per_token` (6 x active parameters per token, causal attention counted once
as MaxText does, no remat) x the step's tokens per device.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from zaya_jax import sizing
from zaya_jax.analysis import report, timeline


def predict(
    hlo: str, c: ml_collections.ConfigDict, cfg: Any, devices: int, hw: dict, mesh: Any = None
) -> dict:
    """The `prediction` object of the report: per device, per optimizer step. With the step's
    `mesh`, its ZeRO-1 collectives too (`data_parallel`: report.data_parallel_timing)."""
    cost = timeline.step_cost(hlo, hw)
    tokens = c.train.batch_size * c.train.seq_len / devices
    model_flops = sizing.flops_per_token(cfg, c.train.seq_len) * tokens
    step = cost.seconds
    out = {
        "step_seconds": step,
        "compute_seconds": cost.compute,
        "communication_seconds": cost.communication,
        "exposed_communication_seconds": cost.exposed,
        "compute_seconds_by_kind": dict(cost.kinds),
        "kernels_per_step": cost.kernels,
        "tokens_per_device": tokens,
        "tokens_per_second_per_device": tokens / step if step else None,
        "model_flops_per_device": model_flops,
        "mfu": model_flops / (step * hw["peak_flops_per_second"]["bfloat16"]) if step else None,
    }
    best = (hw.get("max_achievable_flops_per_second") or {}).get("bfloat16")
    if best:
        out["mfu_of_max_achievable"] = model_flops / (step * best) if step else None
    out["collectives"] = {
        op: {"runs_per_step": runs, "seconds": s, "exposed_seconds": e}
        for op, (s, e, runs) in sorted(cost.collectives.items())
    }
    if mesh is not None and mesh.shape.get("data", 1) > 1:
        out["data_parallel"] = report.data_parallel_timing(hlo, mesh, cost.by_name)
    return out


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x < 1 else f"{x:.3f} s"


def rows(p: dict, hw: dict) -> list[str]:
    """The report's "Predicted step" section."""
    kinds = p["compute_seconds_by_kind"]
    peak = hw["peak_flops_per_second"]["bfloat16"]
    out = [
        (f"Predicted step per device (zaya_jax/analysis/timeline.py on {hw['name']}'s figures; "
        "--dry_run_hardware overrides them)"),
        (f"  step {_seconds(p['step_seconds'])} = compute {_seconds(p['compute_seconds'])} + exposed "
        f"communication {_seconds(p['exposed_communication_seconds'])} (of "
        f"{_seconds(p['communication_seconds'])} communication)"),
        (f"  compute: GEMMs {_seconds(kinds['gemm'])}, Triton kernels {_seconds(kinds['triton'])}, "
        f"memory-bound {_seconds(kinds['memory'])} ({p['kernels_per_step']:,} kernels)"),
    ]
    if p["step_seconds"]:
        mfu = f"MFU {100 * p['mfu']:.3g}% of the bf16 peak ({peak / 1e12:,.1f} TFLOP/s)"
        if "mfu_of_max_achievable" in p:
            best = hw["max_achievable_flops_per_second"]["bfloat16"]
            mfu += f", {100 * p['mfu_of_max_achievable']:.3g}% of the max achievable ({best / 1e12:,.1f})"
        out.append(f"  tokens/s per device {p['tokens_per_second_per_device']:,.0f}; {mfu}")
    out.append(
        f"  model FLOPs per device per step {p['model_flops_per_device']:.4g} "
        "(6 x active params x tokens + causal attention once)"
    )
    if p["collectives"]:
        out.append(
            f"  {'collective':<22}{'runs/step':>10}{'seconds':>12}{'exposed':>12}   (exposed: the compute"
        )
        out.append(f"  {'':<56}   stream's wait at it, for it and the collectives queued before it)")
        for op, r in p["collectives"].items():
            out.append(
                f"  {op:<22}{r['runs_per_step']:>10}{r['seconds']:>12.4g}{r['exposed_seconds']:>12.4g}"
            )
    dp = p.get("data_parallel")
    if dp and dp["wire_bytes"]:
        out.append(
            f"  ZeRO-1 (data axis): {dp['wire_bytes'] / 2**30:.2f} GiB on the wire, {_seconds(dp['seconds'])}, "
            f"{_seconds(dp['exposed_seconds'])} exposed: {dp['hidden_share']:.0%} of the bytes hidden behind compute"
        )
    return out


def memory_json(stats: Any, total: int, device_bytes: int | None) -> dict:
    """The report's `memory` object: XLA's buffers per device and the verdict against the device."""
    return {
        "arguments_bytes": stats.argument_size_in_bytes,
        "outputs_bytes": stats.output_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "temporaries_bytes": stats.temp_size_in_bytes,
        "total_bytes": total,
        "device_bytes": device_bytes,
        "fits": None if device_bytes is None else total <= device_bytes,
    }


def write_json(path: str, report: dict) -> None:
    """Writes the report (via a temporary file beside it: a reader never sees half of one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
