"""The report of benchmarks.train_step: devices, method and config, the headline, the table and
the summary line."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

import jax
import ml_collections

from benchmarks.common import (
    fmt,
    format_rows,
    host_info,
)
from benchmarks.isolated import IsolatedSide
from benchmarks.reference import model_report
from benchmarks.torch_side import TORCH
from benchmarks.train_step_sides import (
    OMP_WAIT_POLICIES,
    OUR_SIDES,
    OURS_ADAMW,
    OURS_SGD,
    SAME_OPTIMIZER,
    matmul_flops_per_s,
    peak_flops_for_name,
)
from zaya_jax import sizing
from zaya_jax.model import ZayaConfig
from zaya_jax.model.moe import resolve_moe_impl
from zaya_jax.model.transformer import resolve_scan_layers
from zaya_jax.parallel.mesh import (
    mesh_platform,
)
from zaya_jax.runtime import host_memory


def device_report(cfg: ZayaConfig) -> dict[str, Any]:
    """The report's "device" section: the host and jax's matmul peak (measured before any side
    starts, on an idle machine)."""
    return {
        **host_info(),
        "jax_peak_bf16_flops": sizing.peak_flops_per_device(jax.devices()[0]),
        "jax_matmul_flops_per_s": matmul_flops_per_s(cfg.dtype),
    }


def torch_device_report(torch_side: IsolatedSide) -> dict[str, Any]:
    """torch's device, versions and attention implementation, for the "device" section."""
    import torch
    import transformers

    cuda = torch_side.device.startswith("cuda")
    name = torch.cuda.get_device_name(torch_side.device) if cuda else platform.processor() or "cpu"
    if (jax.default_backend() in ("gpu", "cuda", "rocm")) != cuda:
        print(
            f"WARNING: jax runs on {jax.default_backend()} but torch on {torch_side.device}: the ratio "
            "compares different devices",
            file=sys.stderr,
        )
    return {
        "torch_device": torch_side.device,
        "torch_device_name": name,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_peak_bf16_flops": peak_flops_for_name(name) if cuda else None,
        "torch_attn_implementation": torch_side.attn_implementation,
    }


def method_report(args: argparse.Namespace, torch_side: IsolatedSide | None, load: tuple) -> dict[str, Any]:
    """How the numbers were taken: threads, OpenMP wait policy, processes, machine load."""
    return {
        "torch_threads": None if torch_side is None else torch_side.threads,
        "torch_threads_set_by": "--threads" if args.threads else "torch's default",
        "jax_threads": "XLA's own pool (all cores)",
        "cores": len(os.sched_getaffinity(0)),
        "omp_wait_policy": args.omp_wait_policy,
        "omp_wait_policy_env": OMP_WAIT_POLICIES[args.omp_wait_policy],
        "processes": "every side in its own spawned process (the trainer loop a fresh one per repeat), "
        "one running at a time, the order flipped every repeat",
        "trainer_loop": "zaya_jax.train.train: metrics.jsonl tokens_per_second over steps "
        f"{args.loop_steps + 1}..{2 * args.loop_steps} (compilation excluded); then the bare step "
        "timed in the same process: outside_step_fraction = 1 - bare / loop step time per repeat; "
        "where the step runs inline (one CPU device, host_memory.keep_step_buffers), "
        "outside_step_fraction_in_window = 1 - the window's mean train_step call / its step time",
        "peak_rss": "VmHWM of each side's own process",
        "host_memory": args.host_memory,
        "lean_cpu_compile": host_memory.compiles_lean(),
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
    }


def config_report(args: argparse.Namespace, c: ml_collections.ConfigDict, cfg: ZayaConfig) -> dict[str, Any]:
    return {
        "config_file": args.config,
        "batch_size": c.train.batch_size,
        "seq_len": c.train.seq_len,
        "grad_accum": c.train.grad_accum,
        "dtype": cfg.dtype,
        "param_dtype": cfg.param_dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "loop_steps": args.loop_steps,
        "seed": args.seed,
        "moe_impl": cfg.moe_impl,
        "moe_impl_resolved": resolve_moe_impl(cfg.moe_impl, mesh_platform(None)),
        "scan_layers": cfg.scan_layers,
        "scan_layers_resolved": resolve_scan_layers(
            cfg.scan_layers, cfg.num_hidden_layers, mesh_platform(None)
        ),
        "optimizer": args.optimizer,
        "host_memory": args.host_memory,
        "flops_per_token": sizing.flops_per_token(cfg, c.train.seq_len),
        **model_report(cfg, args.set),
    }


# ------------------------------------------------------------------------------------------ report
def _mb(x: int | None) -> str:
    return fmt(None if x is None else x / 1e6, ",.0f")


def _outside_text(h: dict[str, Any]) -> str:
    """Time outside the step, against the bare step and (where measured) in the loop's window."""
    bare, window = h["outside_step_fraction"], h.get("outside_step_fraction_in_window")
    text = "-" if bare is None else f"{100 * bare:.1f}% outside the step (vs bare)"
    return text if window is None else f"{text}, {100 * window:.1f}% in its window"


def format_headline(report: dict[str, Any]) -> str:
    """The trainer loop against torch with the same optimizer, each alone, alternated."""
    h, m = report["headline"], report["method"]
    rows = [("headline: as a user runs it", "step ms", "tokens/s", "x torch_muon", "peak RSS MB", "")]
    ours, theirs = h["ours"], h["torch"]
    outside = _outside_text(h)
    rows.append(
        (
            ours["side"],
            fmt(1e3 * ours["step_time_s"], ".2f"),
            fmt(ours["tokens_per_s"], ",.0f"),
            fmt(h["ratio_same_optimizer"], ".2f"),
            _mb(ours["peak_rss_bytes"]),
            outside,
        )
    )
    if theirs is not None:
        threads, policy = m["torch_threads"], m["omp_wait_policy"]
        rows.append(
            (
                theirs["side"],
                fmt(1e3 * theirs["step_time_s"], ".2f"),
                fmt(theirs["tokens_per_s"], ",.0f"),
                "1.00",
                _mb(theirs["peak_rss_bytes"]),
                f"{threads} threads ({m['torch_threads_set_by']}), OMP_WAIT_POLICY {policy}",
            )
        )
    return format_rows(rows)


def format_table(report: dict[str, Any]) -> str:
    """The headline (when the trainer loop ran), then the bare steps, one row per side."""
    header = ("bare step", "step ms", "floor ms", "tokens/s", "x torch", "x same opt", "TFLOP/s")
    rows = [header + ("MFU", "compile s", "1st step s", "peak RSS MB", "loss")]
    for name, r in report["results"].items():
        rows.append(
            (
                name,
                fmt(1e3 * r["step_time_s"], ".2f"),
                fmt(None if r.get("floor_step_s") is None else 1e3 * r["floor_step_s"], ".2f"),
                fmt(r["tokens_per_s"], ",.0f"),
                fmt(r.get("ratio_to_torch"), ".2f"),
                fmt(r.get("ratio_same_optimizer"), ".2f"),
                fmt(r["model_tflops_per_s"], ".4f"),
                fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f")
                + ("%" if r["mfu"] is not None else ""),
                fmt(r["compile_s"], ".2f"),
                fmt(r["first_step_s"], ".2f"),
                _mb(r["peak_rss_bytes"]),
                fmt(r["final_loss"], ".4f"),
            )
        )
    bare = format_rows(rows)
    return bare if report["headline"] is None else format_headline(report) + "\n\n" + bare


def summary_line(report: dict[str, Any]) -> str:
    cfgd, res, m = report["config"], report["results"], report["method"]
    where = (
        f"{os.path.basename(cfgd['config_file'])} B={cfgd['batch_size']} S={cfgd['seq_len']} "
        f"{cfgd['dtype']}, {report['device']['jax_backend']}"
    )
    where += f", moe_impl={cfgd['moe_impl']} ({cfgd['moe_impl_resolved']})"
    where += f", scan_layers={cfgd['scan_layers']} ({cfgd['scan_layers_resolved']})"
    h = report["headline"]
    line = "train_step: "
    if h is not None:
        line += f"trainer loop {h['ours']['tokens_per_s']:,.0f} tok/s"
        if h["torch"] is not None:
            line += (
                f", trainer loop/torch_muon = {h['ratio_same_optimizer']:.2f}x (torch {m['torch_threads']} "
                f"threads, OMP_WAIT_POLICY {m['omp_wait_policy']})"
            )
        line += f", {_outside_text(h)}; bare steps: "
    ours = [name for name in OUR_SIDES if name in res]
    if OURS_ADAMW in res:
        where += f"; {OURS_ADAMW}: every parameter on AdamW, like torch"
    if OURS_SGD in res:
        where += f"; {OURS_SGD}: plain SGD, the model's forward + backward"
    if TORCH not in res:
        sides = ", ".join(f"{name} {res[name]['tokens_per_s']:,.0f} tok/s" for name in ours)
        return line + f"{sides} ({where}; torch skipped)"
    ratios = "; ".join(
        f"{name}/torch tokens/s = {res[name]['ratio_to_torch']:.2f}x ({res[name]['tokens_per_s']:,.0f} tok/s"
        + (
            f", {res[name]['ratio_same_optimizer']:.2f}x {SAME_OPTIMIZER[name]}"
            if SAME_OPTIMIZER[name] != TORCH
            else ""
        )
        + f"; at most {res[name]['max_ratio_to_torch']:.2f}x at the matmul peak)"
        for name in ours
    )
    return line + f"{ratios}; torch {res[TORCH]['tokens_per_s']:,.0f} tok/s ({where})"
