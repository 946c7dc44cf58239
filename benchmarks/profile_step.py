"""Where our train step's time goes: XLA's ops, named by the model code that made them.

    python -m benchmarks.profile_step [--config configs/tiny.py] [--config.KEY=VALUE ...]
        [--steps 3] [--timed 10] [--warmup 3] [--top 25] [--out results/profile_step.json]

The bare step of `benchmarks.train_step` (`JaxSide`: our train step with the config's optimizer,
jit-compiled, the state donated, one random batch): `--warmup` untimed steps, `--timed` timed ones,
then `--steps` under `jax.profiler.trace`. The trace is read back: each op's self time (its span
less the spans of ops nested in it, e.g. a while loop less its body's ops, per thread), named by the
`op_name` metadata the compiled HLO gives its instruction (`zaya_jax.analysis.hlo.op_names`), and grouped by

  phase   forward, backward (autodiff's transpose), recompute (rematerialised forward), optimizer
  site    the module path under `layers/` (self_attn/self_attn.qkv, mlp/experts, ...) or the last
          two path components elsewhere (the loss, the embedding, the optimizer's matmuls)

so a change can be aimed at the sites that hold the time and checked by the same command before and
after. Times are ms per step of wall time on the thread that ran the op (XLA:CPU runs most of a
step's ops one after another; a multi-threaded op counts its span once). The profiled steps run
slower than the timed ones (`trace_overhead` is their ratio), and the tracer's cost is per op call:
a loop of many tiny ops looks bigger profiled than it runs. Under `train.lean_cpu_compile` (the
trainer's default) XLA expands each scatter into a while loop over its rows, so the experts'
backward and the embedding's gradient show up as thousands of `(no op_name)` calls a step; on tiny
they run ~0.4 ms a layer unprofiled, not the tens of ms the trace gives them (`op_calls` counts the
calls per step).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from benchmarks.common import add_out_arg, fmt, format_rows, host_info, print_and_write
from benchmarks.train_config import add_config_args, build_config, checked_config, parse_with_overrides
from benchmarks.train_step_sides import JaxSide, random_tokens
from zaya_jax.analysis import hlo
from zaya_jax.runtime import cli, host_memory

PHASES = ("forward", "backward", "recompute", "optimizer")
NO_SOURCE = "(no op_name)"  # instructions XLA made itself: copies, layout changes, loop plumbing


def self_times(events: Iterable[dict[str, Any]], ops: set[str]) -> dict[str, list[float]]:
    """{op: [self microseconds, calls]} from a trace's complete events ("ph": "X") named like an
    instruction in `ops`: per thread, each op's span less the spans of the ops nested inside it."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_spans: list[tuple[float, float, str]] = []
        for start, end, name in spans:
            while open_spans and open_spans[-1][1] <= start:
                open_spans.pop()
            if open_spans:  # nested: its time is not its parent's own
                out[open_spans[-1][2]][0] -= end - start
            out[name][0] += end - start
            out[name][1] += 1
            open_spans.append((start, end, name))
    return dict(out)


def phase_of(op_name: str) -> str:
    """The step phase an op's jax source path belongs to (PHASES)."""
    if "optimizer_update" in op_name:
        return "optimizer"
    if "rematted_computation" in op_name:
        return "recompute"
    return "backward" if "transpose(" in op_name else "forward"


def site_of(op_name: str) -> str:
    """Where in the model an op comes from: `self_attn/self_attn.qkv`, `mlp/experts`, `input_layernorm`
    (under layers/), else the path's last two components (e.g. `lm_head/dot_general`)."""
    if not op_name:
        return NO_SOURCE
    if "layers/" in op_name:
        parts = op_name.split("layers/", 1)[1].split("/")
        depth = 2 if parts[0] in ("self_attn", "mlp") and len(parts) > 2 else 1
        return "/".join(parts[:depth])
    return "/".join(op_name.split("/")[-2:])


def trace_events(trace_dir: str) -> list[dict[str, Any]]:
    """The events of the perfetto trace jax.profiler wrote under `trace_dir`."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}")
    with gzip.open(paths[0]) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def check_complete(times: dict[str, list[float]], text: str, steps: int) -> None:
    """Every op of the step's top level is in the trace at least `steps` times (more where XLA split
    it over threads: each part is a span), else the profiler dropped events (its buffer holds a few
    hundred thousand: a step of many tiny ops fills it in a few steps) and the per-step figures would
    be short: a user error naming the fix."""
    comps, entry = hlo.computations(text)
    calls = [times[op][1] for op in hlo.op_names("\n".join(comps[entry])) if op in times]
    if not calls or min(calls) < steps:
        raise cli.UserError(
            f"the trace holds {min(calls, default=0)} of the {steps} profiled steps' runs of some "
            "top-level op (the profiler's event buffer filled): profile fewer --steps"
        )


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Times `args.timed` steps, profiles `args.steps`; per-op self times and the HLO's op names."""
    import jax

    c, cfg = build_config(args)
    ids = random_tokens(cfg.vocab_size, c.train.batch_size, c.train.seq_len, args.seed)
    side = JaxSide(c, cfg, ids, args.seed)
    side.run(args.warmup)
    t0 = time.perf_counter()
    side.run(args.timed)
    step_s = (time.perf_counter() - t0) / args.timed
    with tempfile.TemporaryDirectory(prefix="profile_step_") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            side.run(args.steps)
            profiled_s = (time.perf_counter() - t0) / args.steps  # the trace's export after it is not
        events = trace_events(trace_dir)
    text = side.step.as_text()
    names = hlo.op_names(text)
    times = self_times(events, set(names))
    check_complete(times, text, args.steps)
    return {"c": c, "step_s": step_s, "profiled_s": profiled_s, "times": times, "names": names}


def grouped(times: dict[str, list[float]], names: dict[str, str], steps: int) -> dict[str, Any]:
    """ms per step by phase, by site (split by phase) and by op."""
    ms = lambda us: us / steps / 1e3
    phases = dict.fromkeys(PHASES, 0.0)
    sites: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    ops = []
    for op, (us, calls) in times.items():
        source = names.get(op, "")
        phase = phase_of(source)
        phases[phase] += ms(us)
        sites[site_of(source)][phase] += ms(us)
        ops.append({"op": op, "ms": ms(us), "calls": calls / steps, "site": site_of(source), "phase": phase,
                    "op_name": source})
    site_rows = [{"site": s, **v, "ms": sum(v.values())} for s, v in sites.items()]
    return {
        "op_ms": sum(phases.values()),
        "op_calls": sum(calls for _, calls in times.values()) / steps,
        "phases_ms": phases,
        "sites": sorted(site_rows, key=lambda r: -r["ms"]),
        "ops": sorted(ops, key=lambda r: -r["ms"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = profile(args)
    c = p["c"]
    return {
        "config": {
            "config_file": args.config,
            "set": args.set or [],
            "batch": [c.train.batch_size, c.train.seq_len],
            "steps": args.steps,
            "timed": args.timed,
            "warmup": args.warmup,
        },
        "device": host_info(),
        "step_ms": p["step_s"] * 1e3,
        "profiled_step_ms": p["profiled_s"] * 1e3,
        "trace_overhead": p["profiled_s"] / p["step_s"],
        **grouped(p["times"], p["names"], args.steps),
    }


def report_text(report: dict[str, Any], top: int) -> tuple[str, str]:
    total = report["op_ms"] or 1.0
    share = lambda x: fmt(100 * x / total, ".1f")
    rows = [["phase", "ms/step", "%"]]
    rows += [[k, fmt(v, ".2f"), share(v)] for k, v in report["phases_ms"].items()]
    sites = [["site", *PHASES, "ms/step", "%"]]
    for r in report["sites"][:top]:
        sites.append([r["site"], *(fmt(r[k], ".2f") for k in PHASES), fmt(r["ms"], ".2f"), share(r["ms"])])
    ops = [["op", "phase", "ms/step", "calls/step", "op_name (tail)"]]
    for r in report["ops"][:top]:
        ops.append([r["op"], r["phase"], fmt(r["ms"], ".2f"), fmt(r["calls"], ".0f"), r["op_name"][-70:]])
    table = "\n\n".join(format_rows(t) for t in (rows, sites, ops))
    summary = (
        f"profile_step: {report['step_ms']:.1f} ms a step ({report['profiled_step_ms']:.1f} ms profiled), "
        f"{report['op_ms']:.1f} ms of ops in {report['op_calls']:.0f} calls; "
        f"top site {report['sites'][0]['site']} ({share(report['sites'][0]['ms'])}%)"
    )
    return table, summary


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n")[0])
    add_config_args(p)
    p.add_argument("--steps", type=cli.Int(min=1), default=3, help="profiled steps (default 3)")
    p.add_argument("--timed", type=cli.Int(min=1), default=10, help="timed steps, untraced (default 10)")
    p.add_argument("--warmup", type=cli.Int(min=0), default=3, help="untimed steps first (default 3)")
    p.add_argument("--top", type=cli.Int(min=1), default=25, help="sites and ops printed (default 25)")
    p.add_argument("--seed", type=cli.Int(min=0), default=0, help="init and batch seed (default 0)")
    add_out_arg(p, "profile_step")
    p.set_defaults(dtype=None)  # build_config's --dtype: the config's
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_with_overrides(arg_parser(), argv)
    c, _ = checked_config(args)  # fail fast, in one line
    # glibc's malloc and XLA's compile flags as the trainer sets them (re-executing this process for
    # huge pages where it must): without them the step runs ~1.5x slower here (page faults).
    mode = host_memory.configure(c.train.reuse_host_memory, lean=c.train.lean_cpu_compile)
    report = {**run(args), "host_memory": mode}
    print_and_write(report, *report_text(report, args.top), args.out, "profile_step")
    return report


if __name__ == "__main__":
    cli.run(main)
