"""Muon's Newton-Schulz alone: ours against torch_muon's, on every Muon matrix of one config.

    python -m benchmarks.newton_schulz [--config configs/tiny.py] [--config.KEY=VALUE ...]
        [--iters 7] [--repeats 2] [--out results/newton_schulz.json]

ours   the iteration the train step runs on this machine (zaya_jax/optim/chain.py
       `_orthogonalize_fn`: on CPU slice by slice), jitted over the model's Muon parameters
       ([l, ...] and [l, e, ...] stacks), fp32 inputs
torch  `benchmarks/torch_muon.py`'s `orthogonalize` (the torch side of `benchmarks.train_step`'s
       like-for-like row) over the Muon tensors of transformers' ZayaForCausalLM (per layer)

Both sides orthogonalise the same matrices (the report checks their FLOPs agree). Each side runs in
its own spawned process, torch with its own defaults (threads, OMP_WAIT_POLICY unset), one at a time,
the order flipped every repeat; a side's time is the median of `--iters` timed calls after one
untimed call; the report takes the median over repeats. It tells how much of a train step is the
optimizer on each side (benchmarks/README.md; numbers: docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import (
    add_out_arg,
    fmt,
    format_rows,
    host_info,
    in_own_process,
    print_and_write,
    set_env,
)
from benchmarks.train_config import add_config_args, build_config, checked_config, parse_with_overrides
from zaya_jax import sizing
from zaya_jax.runtime import cli

OURS, TORCH = "zaya_jax", "torch_muon"


def _call_times(call: Any, iters: int) -> list[float]:
    """Seconds of each of `iters` timed calls, after one untimed call (ours compiles there)."""
    call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def time_ours(args: argparse.Namespace) -> dict[str, Any]:
    """In its own process: our Newton-Schulz over the model's Muon parameters (sizing.param_leaves)."""
    import jax
    import jax.numpy as jnp

    from zaya_jax import kernels
    from zaya_jax.optim.chain import _orthogonalize_fn

    c, cfg = build_config(args)
    m = c.optim.muon
    shapes = [shape for _, shape, label in sizing.param_leaves(cfg) if label == "muon"]
    platform = jax.devices()[0].platform
    ns = _orthogonalize_fn(m.ns_impl, platform)
    kw = dict(ns_coeffs=tuple(m.ns_coeffs), ns_steps=m.ns_steps, eps=m.eps)
    fn = jax.jit(lambda xs: [ns(x, **kw) for x in xs])
    rng = np.random.default_rng(args.seed)
    xs = [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]
    times = _call_times(lambda: jax.block_until_ready(fn(xs)), args.iters)
    flops = sizing.newton_schulz_flops_of(shapes, m.ns_steps)
    impl = kernels.ns_choice(m.ns_impl, platform)
    return {"times_s": times, "shapes": shapes, "flops": flops, "impl": impl}


def time_torch(args: argparse.Namespace) -> dict[str, Any]:
    """In its own process, torch's defaults: torch_muon's Newton-Schulz over transformers' Muon tensors."""
    set_env({"OMP_WAIT_POLICY": None})  # before torch (libgomp) loads: torch as a user runs it
    import torch
    from transformers import ZayaForCausalLM

    from benchmarks.reference import hf_config
    from benchmarks.torch_muon import TorchMuonAdamW, model_muon_names, orthogonalize

    c, cfg = build_config(args)
    m = c.optim.muon
    torch.manual_seed(args.seed)
    model = ZayaForCausalLM(hf_config(cfg))
    shapes = [tuple(p.shape) for p in TorchMuonAdamW(model, c.optim, model_muon_names(model, cfg)).muon]
    xs = [torch.randn(s) for s in shapes]

    def call():
        with torch.no_grad():
            for x in xs:
                orthogonalize(x, tuple(m.ns_coeffs), m.ns_steps, m.eps)

    times = _call_times(call, args.iters)
    flops = sizing.newton_schulz_flops_of(shapes, m.ns_steps)
    return {"times_s": times, "shapes": shapes, "flops": flops, "threads": torch.get_num_threads()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Alternated repeats of both sides, each in its own process; the report."""
    sides = {OURS: time_ours, TORCH: time_torch}
    runs: dict[str, list[dict[str, Any]]] = {OURS: [], TORCH: []}
    for r in range(args.repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            print(f"repeat {r + 1}/{args.repeats}: {name}...", file=sys.stderr, flush=True)
            runs[name].append(in_own_process(sides[name], args))
    results = {}
    for name, rs in runs.items():
        medians = [statistics.median(x["times_s"]) for x in rs]
        t = statistics.median(medians)
        results[name] = {
            "time_s": t,
            "repeat_medians_s": medians,
            "min_s": min(min(x["times_s"]) for x in rs),
            "flops": rs[0]["flops"],
            "gflop_per_s": rs[0]["flops"] / t / 1e9,
            "matrices": len(rs[0]["shapes"]),
            **{k: rs[0][k] for k in ("impl", "threads") if k in rs[0]},  # what each side ran with
        }
    ours, theirs = results[OURS], results[TORCH]
    return {
        "config": {
            "config_file": args.config,
            "set": args.set or [],
            "iters": args.iters,
            "repeats": args.repeats,
        },
        "device": host_info(),
        "method": {
            "processes": "each side in its own spawned process, one at a time, order flipped every repeat",
            "torch": "its defaults: threads, OMP_WAIT_POLICY unset",
        },
        "results": results,
        "same_flops": ours["flops"] == theirs["flops"],
        "ratio": theirs["time_s"] / ours["time_s"],
    }


def report_text(report: dict[str, Any]) -> tuple[str, str]:
    rows = [["side", "median ms", "min ms", "GFLOP", "GFLOP/s", "matrices", "x torch_muon"]]
    for name, r in report["results"].items():
        ratio = report["results"][TORCH]["time_s"] / r["time_s"]
        ms = [fmt(r["time_s"] * 1e3, ".1f"), fmt(r["min_s"] * 1e3, ".1f")]
        flops = [fmt(r["flops"] / 1e9, ".2f"), fmt(r["gflop_per_s"], ".1f")]
        rows.append([name, *ms, *flops, str(r["matrices"]), fmt(ratio, ".2f")])
    same = "the same FLOPs" if report["same_flops"] else "DIFFERENT FLOPs (not the same matrices)"
    summary = f"newton_schulz: zaya_jax/torch_muon speed = {report['ratio']:.2f}x ({same})"
    return format_rows(rows), summary


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m benchmarks.newton_schulz", description=__doc__.split("\n")[0])
    add_config_args(p)
    p.add_argument("--iters", type=cli.Int(min=1), default=7, help="timed calls a side a repeat (default 7)")
    p.add_argument("--repeats", type=cli.Int(min=1), default=2, help="alternated repeats (default 2)")
    p.add_argument("--seed", type=cli.Int(min=0), default=0, help="random matrices' seed (default 0)")
    add_out_arg(p, "newton_schulz")
    p.set_defaults(dtype=None)  # build_config's --dtype: the config's
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_with_overrides(arg_parser(), argv)
    checked_config(args)  # fail fast, in one line
    report = run(args)
    print_and_write(report, *report_text(report), args.out, "newton_schulz")
    return report


if __name__ == "__main__":
    cli.run(main)
