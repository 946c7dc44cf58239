"""Train-step throughput, side by side: our trainer and train step vs transformers' ZayaForCausalLM.

    python -m benchmarks.train_step [--config configs/tiny.py] [--config.train.batch_size=4 ...]
        [--steps 10] [--warmup 2] [--repeats 3] [--loop-steps 10] [--dtype float32|bfloat16]
        [--out results/train_step.json] [--skip-torch] [--optimizer both|all|config|adamw|sgd]
        [--host-memory reuse|default] [--omp-wait-policy default|passive|active] [--threads N]

(`python benchmarks/train_step.py ...` works too.) Every side runs in a process of its own
(driven over a pipe: benchmarks/isolated.py `IsolatedSide`; torch's imports no jax), one at a time,
so each is alone on the machine and its peak RSS (VmHWM) is its own. Torch runs as a user runs it:
its default thread count (unless `--threads`) and OMP_WAIT_POLICY unset (`--omp-wait-policy
passive` is for a machine shared with busy processes; it made torch ~15% slower alone).

The headline (unless `--loop-steps 0`): what a user sees. The real trainer, `zaya_jax.train.train`,
runs the config on the embedded corpus in a temporary workdir for 2 x `--loop-steps` steps, logging
every `--loop-steps` (data pipeline, host loop, metrics.jsonl + TensorBoard, the final eval and
checkpoint after the timed window; console off), in a fresh process per repeat: its second logged
`tokens_per_second` (compile excluded) is its throughput. It alternates (order flipped every
repeat, ABBA) with torch running the same optimizer (`torch_muon` below): `--warmup` untimed steps,
then `--steps` timed. After its loop, each trainer process also times the bare step (below)
for `--warmup` + `--steps` steps: 1 - bare step time / loop step time, within that one process,
is our share of time outside the step (the median over the repeats). Where the step runs on the
calling thread (one CPU device, zaya_jax/runtime/host_memory.py `keep_step_buffers`) each `train_step` call
of the loop is timed too, and 1 - the window's mean call / its step time is that share measured in
the loop's own window (`outside_step_fraction_in_window`).

Then the bare steps: the same random token batch [B, S] (train.batch_size x train.seq_len) on
every side, alternated ABBA `--repeats` times, each time `--warmup` untimed steps then `--steps`
timed ones; a side's step time is the median over its repeats of (timed wall time / steps):

  zaya_jax  `make_train_step` under `jax.jit` with the state donated: forward + backward (chunked
            cross-entropy) + clipping + Muon/AdamW + the router-balancing bias step; compile time
            is measured separately (lower + compile) and excluded from the step time.
  torch     `ZayaForCausalLM(input_ids, labels=input_ids)` (its own shifted loss) + backward +
            `torch.optim.AdamW` step, train mode. bfloat16 means fp32 parameters under
            `torch.autocast` (like our fp32 params + bf16 matmuls), or pure bf16 parameters with
            `--torch-precision pure`.

Each side runs twice by default (`--optimizer both`), all four interleaved: `zaya_jax` with the
config's optimizer (Muon + AdamW, what training runs) and `zaya_jax_adamw` with every parameter on
AdamW (the optim.adamw settings, the config's lr schedule and clipping); `torch` with
`torch.optim.AdamW` (the baseline every ratio "x torch" is taken against) and `torch_muon` with our
chain's Muon / AdamW split in PyTorch (benchmarks/torch_muon.py: the same tensors on Muon, the same
Newton-Schulz). "x same opt" compares each of ours with the torch side running its optimizer
(zaya_jax / torch_muon, zaya_jax_adamw / torch: the AdamW-only pair). `--optimizer config` / `adamw`
runs one pair only (`config` keeps the AdamW torch baseline too). `--optimizer sgd` runs the
`zaya_jax_sgd` / `torch_sgd` pair (plain SGD at optim.lr on every parameter, no momentum or clipping,
beside the AdamW baseline): the model's forward + backward, so that a pair's difference from it is
what its optimizer costs; `--optimizer all` runs the three pairs, all six rows interleaved. The
trainer loop always uses the config's optimizer, so there is no headline with `adamw` or `sgd` alone.

"floor ms" is the fastest a side's step could be on this device: the model's training FLOPs
(`sizing.flops_per_token` x tokens) plus its optimizer's Newton-Schulz FLOPs
(`sizing.newton_schulz_flops`, 0 for AdamW), at the speed of one large jit-compiled matmul measured
at start-up (`device.jax_matmul_flops_per_s`). `max_ratio_to_torch` = torch's step time / floor: the
ratio no implementation of that side could beat here. At a small batch Muon's floor alone can
exceed torch's whole AdamW step (configs/mid.py on a CPU).

`--host-memory reuse` (the default) sets glibc's malloc as `python -m zaya_jax.train` does
(`train.reuse_host_memory`, zaya_jax/runtime/host_memory.py) in every side's process before its framework
starts: huge pages where the kernel has them (every side's process starts with the tunable), else
the "reuse" settings; each record's `host_memory` says which. `default` leaves the C library's
settings, for comparison.
"""

from __future__ import annotations

import os

# Both frameworks may share one GPU: do not let XLA grab 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import datetime
import functools
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/train_step.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections
import numpy as np

from benchmarks.common import (
    add_out_arg,
    in_own_process,
    print_and_write,
)
from benchmarks.isolated import IsolatedSide
from benchmarks.reference import add_torch_args, hf_config, resolve_torch_device
from benchmarks.torch_muon import model_muon_names
from benchmarks.torch_side import TORCH, TORCH_MUON, TorchSide, side_name
from benchmarks.train_config import (
    DTYPES,
    add_config_args,
    build_config,
    checked_config,
    parse_with_overrides,
)
from benchmarks.train_step_report import (
    config_report,
    device_report,
    format_table,
    method_report,
    summary_line,
    torch_device_report,
)
from benchmarks.train_step_sides import (
    LOOP,
    OMP_WAIT_POLICIES,
    OPTIMIZERS,
    OUR_SIDES,
    OURS,
    SAME_OPTIMIZER,
    SIDE_OF_OPTIMIZER,
    JaxSide,
    random_tokens,
    selected_optimizers,
    timed_window,
    trainer_loop_alone,
)
from zaya_jax import sizing
from zaya_jax.model import ZayaConfig
from zaya_jax.runtime import cli, host_memory


# --------------------------------------------------------------------------------------- benchmark
def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def alternate(runners: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Every runner once per repeat, one at a time, the order flipped every repeat (ABBA), so that
    drifting machine load falls on all alike; each call's result (seconds per step, or a trainer
    loop's record) by name."""
    out: dict[str, list[Any]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(runners[name]())
            last = out[name][-1]
            step_s = last["step_time_s"] if isinstance(last, dict) else last
            print(
                f"  repeat {r + 1}/{repeats} {name}: {1e3 * step_s:.2f} ms/step", file=sys.stderr, flush=True
            )
    return out


def torch_muon_names(cfg: ZayaConfig) -> set[str]:
    """The transformers tensors our chain puts on Muon (from our registry), for the torch_muon side's
    jax-free process: read off transformers' model built on torch's meta device (no memory)."""
    import torch
    from transformers import ZayaForCausalLM as HFZayaForCausalLM

    with torch.device("meta"):
        model = HFZayaForCausalLM(hf_config(cfg))
    return model_muon_names(model, cfg)


def side_maker(args: argparse.Namespace, c: ml_collections.ConfigDict, cfg: ZayaConfig, ids: np.ndarray):
    """`make(JaxSide | TorchSide, **kwargs)`: an IsolatedSide over the shared batch and config; torch
    sides get the torch flags, transformers' config and OMP_WAIT_POLICY as --omp-wait-policy says."""
    reuse = args.host_memory == "reuse"
    torch_kwargs: dict[str, Any] = {}
    if not args.skip_torch:
        torch_kwargs = dict(
            hf_config=hf_config(cfg),
            optim=c.optim,
            ids=ids,
            seed=args.seed,
            device=resolve_torch_device(args.torch_device),
            dtype=cfg.dtype,
            precision=args.torch_precision,
            threads=args.threads,
            grad_accum=c.train.grad_accum,
        )

    def make(factory: Any, **kwargs: Any) -> IsolatedSide:
        is_torch = factory is TorchSide
        if is_torch:
            muon, sgd = kwargs.pop("muon", False), kwargs.pop("sgd", False)
            what = side_name(muon, sgd)
            kwargs = {**torch_kwargs, "muon_names": torch_muon_names(cfg) if muon else None, "sgd": sgd}
        else:
            what = f"{SIDE_OF_OPTIMIZER[kwargs['optimizer']]} (compiling the train step)"
            kwargs = dict(c=c, cfg=cfg, ids=ids, seed=args.seed, **kwargs)
        print(f"building {what}...", file=sys.stderr, flush=True)
        env = {"OMP_WAIT_POLICY": OMP_WAIT_POLICIES[args.omp_wait_policy]} if is_torch else {}
        return IsolatedSide(factory, env, reuse, **kwargs)

    return make


def run_headline(
    args: argparse.Namespace,
    c: ml_collections.ConfigDict,
    cfg: ZayaConfig,
    ids: np.ndarray,
    torch_muon: IsolatedSide | None,
) -> dict[str, Any]:
    """The trainer loop (a fresh process per repeat) alternated with torch running the same optimizer
    (`torch_muon`, its own process): what a user of each sees, each alone on the machine."""
    tokens_per_step = c.train.batch_size * c.train.seq_len
    reuse = args.host_memory == "reuse"
    bare = functools.partial(JaxSide, c, cfg, ids, args.seed)  # the bare zaya_jax row's step
    loop = functools.partial(
        in_own_process, trainer_loop_alone, c, args.loop_steps, reuse, bare, args.warmup, args.steps
    )
    runners: dict[str, Callable[[], Any]] = {LOOP: loop}
    if torch_muon is not None:
        runners[TORCH_MUON] = functools.partial(timed_window, torch_muon, args.warmup, args.steps)
    print(f"trainer loop ({2 * args.loop_steps} steps a run) vs {TORCH_MUON}...", file=sys.stderr, flush=True)
    runs = alternate(runners, args.repeats)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in runs[LOOP])
    ours = {
        "side": LOOP,
        "steps": args.loop_steps,
        "tokens_per_s": tokens_per_s,
        "step_time_s": tokens_per_step / tokens_per_s,
        "model_tflops_per_s": tokens_per_s * sizing.flops_per_token(cfg, c.train.seq_len) / 1e12,
        "tokens_per_s_repeats": [r["tokens_per_s"] for r in runs[LOOP]],
        "wall_s_repeats": [r["wall_s"] for r in runs[LOOP]],
        "bare_step_time_s_repeats": [r["bare_step_time_s"] for r in runs[LOOP]],
        "step_call_s_repeats": [r["step_call_s"] for r in runs[LOOP]],
        "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in runs[LOOP]) or None,
        "host_memory": runs[LOOP][0]["host_memory"],
    }
    theirs = None
    if torch_muon is not None:
        step_s = statistics.median(runs[TORCH_MUON])
        theirs = {
            "side": TORCH_MUON,
            "step_time_s": step_s,
            "step_times_s": runs[TORCH_MUON],
            "tokens_per_s": tokens_per_step / step_s,
            "peak_rss_bytes": None,  # its process' peak, read when it stops
        }
    return {
        "ours": ours,
        "torch": theirs,
        "ratio_same_optimizer": None if theirs is None else tokens_per_s / theirs["tokens_per_s"],
        # each repeat's bare step against its own loop window, in its process; the median
        "outside_step_fraction": statistics.median(
            1.0 - r["bare_step_time_s"] * r["tokens_per_s"] / tokens_per_step for r in runs[LOOP]
        ),
        "outside_step_fraction_across_processes": None,  # against the bare rows' median, next
        # the loop's own window: 1 - its step calls / its step time (None unless the step runs inline)
        "outside_step_fraction_in_window": _in_window(runs[LOOP], tokens_per_step),
        "peak_rss_ratio": None,
    }


def _in_window(loops: list[dict[str, Any]], tokens_per_step: int) -> float | None:
    """The median over repeats of 1 - the window's mean step call / its step time; None if a
    repeat's step did not run inline (its calls return before the step ends)."""
    if any(r["step_call_s"] is None for r in loops):
        return None
    return statistics.median(1.0 - r["step_call_s"] * r["tokens_per_s"] / tokens_per_step for r in loops)


def side_results(
    sides: list[IsolatedSide],
    times: dict[str, list[float]],
    c: ml_collections.ConfigDict,
    cfg: ZayaConfig,
    device: dict[str, Any],
) -> dict[str, Any]:
    """One record per bare side (their processes stopped: peak RSS known)."""
    tokens_per_step, seq_len = c.train.batch_size * c.train.seq_len, c.train.seq_len
    results = {}
    for side in sides:
        step_s = statistics.median(times[side.name])
        tokens_per_s = tokens_per_step / step_s
        ours = side.name in OUR_SIDES
        peak = device["jax_peak_bf16_flops"] if ours else device.get("torch_peak_bf16_flops")
        results[side.name] = {
            "step_time_s": step_s,
            "step_times_s": times[side.name],
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "model_tflops_per_s": tokens_per_s * sizing.flops_per_token(cfg, seq_len) / 1e12,
            "mfu": sizing.mfu(tokens_per_s, cfg, seq_len, side.devices, peak),
            "init_s": side.init_s,
            "compile_s": side.compile_s,
            "first_step_s": side.first_step_s,
            "final_loss": _finite_or_none(side.loss()),
            "precision": side.precision,
            "host_memory": side.host_memory,
            "imports_jax": side.imports_jax,  # torch's process must not (benchmarks/isolated.py)
        }
    for side in sides:
        side.close()
        results[side.name]["peak_rss_bytes"] = side.peak_rss_bytes
    return results


def add_ratios(
    results: dict[str, Any], c: ml_collections.ConfigDict, cfg: ZayaConfig, matmul_peak: float
) -> None:
    """Our rows' ratios to torch (AdamW) and to the torch row with the same optimizer, and the floor:
    model + Newton-Schulz FLOPs at the measured matmul speed (Muon's NS is paid once per step)."""
    tokens_per_step = c.train.batch_size * c.train.seq_len
    model_flops = tokens_per_step * sizing.flops_per_token(cfg, c.train.seq_len)
    optimizer_flops = dict.fromkeys(OUR_SIDES, 0.0)
    optimizer_flops[OURS] = sizing.newton_schulz_flops(cfg, c.optim.muon.ns_steps)
    torch_r = results.get(TORCH)
    for name in OUR_SIDES:
        if name not in results:
            continue
        r, same = results[name], results.get(SAME_OPTIMIZER[name])
        r["ratio_to_torch"] = None if torch_r is None else r["tokens_per_s"] / torch_r["tokens_per_s"]
        r["ratio_same_optimizer"] = None if same is None else r["tokens_per_s"] / same["tokens_per_s"]
        r["optimizer_flops_per_step"] = optimizer_flops[name]
        r["floor_step_s"] = (model_flops + optimizer_flops[name]) / matmul_peak
        r["max_ratio_to_torch"] = None if torch_r is None else torch_r["step_time_s"] / r["floor_step_s"]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    c, cfg = build_config(args)
    # every side's process starts with glibc's huge-page tunable, as the trainer re-executes with it,
    # and with XLA_FLAGS for the trainer's CPU compile (train.lean_cpu_compile)
    host_memory.huge_pages_for_children(args.host_memory == "reuse")
    host_memory.lean_compile(c.train.lean_cpu_compile)
    load = os.getloadavg()
    device = device_report(cfg)
    ids = random_tokens(cfg.vocab_size, c.train.batch_size, c.train.seq_len, args.seed)
    optimizers = selected_optimizers(args.optimizer)
    make = side_maker(args, c, cfg, ids)
    # torch with our Muon / AdamW split: the like-for-like partner of the headline and of zaya_jax
    torch_muon = make(TorchSide, muon=True) if not args.skip_torch and "config" in optimizers else None
    headline = None
    if args.loop_steps and "config" not in optimizers:
        print("trainer loop skipped: it always runs the config's optimizer", file=sys.stderr, flush=True)
    elif args.loop_steps:
        headline = run_headline(args, c, cfg, ids, torch_muon)

    sides = [make(JaxSide, optimizer=o) for o in optimizers]
    if not args.skip_torch:
        sides.append(make(TorchSide))  # the AdamW baseline of every "x torch" (sides[len(optimizers)])
        if "sgd" in optimizers:
            sides.append(make(TorchSide, sgd=True))
    if torch_muon is not None:
        sides.append(torch_muon)
    runners = {s.name: functools.partial(timed_window, s, args.warmup, args.steps) for s in sides}
    times = alternate(runners, args.repeats)
    torch_side = None if args.skip_torch else sides[len(optimizers)]
    if torch_side is not None:
        device.update(torch_device_report(torch_side))
    method = method_report(args, torch_side, load)
    results = side_results(sides, times, c, cfg, device)
    add_ratios(results, c, cfg, device["jax_matmul_flops_per_s"])
    if headline is not None:
        finish_headline(headline, results, torch_muon)
    return {
        "config": config_report(args, c, cfg),
        "device": device,
        "method": method,
        "headline": headline,
        "results": results,
        "ratio_tokens_per_s": results[sides[0].name].get("ratio_to_torch"),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def finish_headline(
    headline: dict[str, Any], results: dict[str, Any], torch_muon: IsolatedSide | None
) -> None:
    """What needs the bare step and the stopped torch process: time outside the step, peak RSS."""
    ours = headline["ours"]
    across = 1.0 - results[OURS]["step_time_s"] / ours["step_time_s"]
    headline["outside_step_fraction_across_processes"] = across
    if torch_muon is not None and headline["torch"] is not None:
        headline["torch"]["peak_rss_bytes"] = torch_muon.peak_rss_bytes
        if ours["peak_rss_bytes"] and torch_muon.peak_rss_bytes:
            headline["peak_rss_ratio"] = ours["peak_rss_bytes"] / torch_muon.peak_rss_bytes


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m benchmarks.train_step",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--steps", type=cli.Int(min=1), default=10, help="timed steps per repeat (default 10)")
    p.add_argument(
        "--warmup", type=cli.Int(min=0), default=2, help="untimed steps before each repeat (default 2)"
    )
    p.add_argument(
        "--repeats",
        type=cli.Int(min=1),
        default=3,
        help="alternating ours/torch repeats, median taken (default 3)",
    )
    p.add_argument(
        "--loop-steps",
        type=cli.Int(min=0),
        default=10,
        help="timed steps of the real trainer loop (it runs 2x this many; 0 = skip; default 10)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="matmul compute dtype (sets model.dtype; default: the config's)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="both",
        help="our side's optimizer: both (default: two rows, interleaved), all (three: both and "
        "sgd), config (the config's Muon/AdamW chain), adamw (every parameter on AdamW, like torch's "
        "side) or sgd (plain SGD on both sides: the model's forward + backward); no trainer loop "
        "without config",
    )
    p.add_argument(
        "--host-memory",
        choices=("reuse", "default"),
        default="reuse",
        help="reuse (default): glibc malloc set as zaya_jax.train sets it (zaya_jax/runtime/host_memory.py), "
        "for both sides; default: the C library's defaults",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=tuple(OMP_WAIT_POLICIES),
        default="default",
        help="OMP_WAIT_POLICY in torch's processes: default (unset, even if exported: torch as a user "
        "runs it), passive (for a machine shared with busy processes) or active",
    )
    add_out_arg(p, "train_step")
    add_torch_args(p, threads_default="torch's own default")
    p.add_argument(
        "--torch-precision",
        choices=("autocast", "pure"),
        default="autocast",
        help="bfloat16 on the torch side: fp32 params + autocast (default) or bf16 params",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_with_overrides(arg_parser(), argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    checked_config(args)  # fail fast, in one line
    report = run_benchmark(args)
    print_and_write(report, format_table(report), summary_line(report), args.out, "train_step")
    return report


if __name__ == "__main__":
    cli.run(main)
