"""Train-step throughput, side by side: our trainer and train step vs transformers' ZayaForCausalLM.

    python -m benchmarks.train_step [--config configs/tiny.py] [--set train.batch_size=4 ...]
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
import ast
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/train_step.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import ml_collections
import numpy as np
import optax

from benchmarks.common import (
    add_out_arg,
    fmt,
    format_rows,
    host_info,
    in_own_process,
    peak_rss_bytes,
    print_and_write,
)
from benchmarks.gemm import time_gemm
from benchmarks.isolated import IsolatedSide
from benchmarks.reference import add_torch_args, hf_config, model_report, resolve_torch_device
from benchmarks.torch_muon import model_muon_names
from benchmarks.torch_side import TORCH, TORCH_MUON, TORCH_SGD, TorchSide, side_name
from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.model import ZayaConfig
from zaya_jax.model.moe import resolve_moe_impl
from zaya_jax.model.transformer import resolve_scan_layers
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import adamw, gradient_clipping, lr_schedule, make_optimizer
from zaya_jax.parallel.mesh import (
    mesh_from_config,
    mesh_platform,
)
from zaya_jax.parallel.sharding import shard_batch
from zaya_jax.runtime import cli, host_memory
from zaya_jax.training.train_state import (
    balancing_config,
    create_train_state,
    make_train_step,
    run_once,
    state_shardings,
)

OURS, OURS_ADAMW, OURS_SGD = "zaya_jax", "zaya_jax_adamw", "zaya_jax_sgd"
OUR_SIDES = (OURS, OURS_ADAMW, OURS_SGD)
LOOP = "zaya_jax trainer loop"
# --omp-wait-policy -> OMP_WAIT_POLICY in torch's processes (None: unset, torch's own default). PASSIVE
# is for a machine shared with other busy processes: there GOMP's spin-waiting made a tiny torch step
# 5-20x slower and wildly noisy; alone, it made torch ~15% slower than a user's default run.
OMP_WAIT_POLICIES = {"default": None, "passive": "PASSIVE", "active": "ACTIVE"}
DTYPES = ("float32", "bfloat16")


# ------------------------------------------------------------------------------------------ config
def load_config(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of a config file; `file.py:arg` passes `arg` as for zaya_jax.train."""
    path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location(f"_benchmark_config_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--config {path!r}: not a python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _parse_value(raw: str, typ: Any) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    if typ is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a bool, got {raw!r}")
    if typ is int:
        return int(raw)
    if typ is float:
        return float(raw)
    if typ is str:
        return raw
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def apply_override(c: ml_collections.ConfigDict, assignment: str) -> None:
    """`section.key=value` (value parsed as the field's type) into `c`; KeyError for unknown keys."""
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set {assignment!r}: expected key=value")
    *parents, name = key.strip().split(".")
    node = c
    for part in parents:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise KeyError(f"--set {key}: no config section {part!r}")
        node = node[part]
    if name not in node:
        raise KeyError(f"--set {key}: unknown key (known here: {sorted(node.keys())})")
    try:
        node[name] = _parse_value(raw.strip(), node.get_type(name))
    except (TypeError, ValueError) as e:
        raise ValueError(f"--set {key}={raw}: {e}") from None


def matmul_flops_per_s(dtype: str, n: int = 1024, repeats: int = 30) -> float:
    """The best of `repeats` jit-compiled [n, n] x [n, n] matmuls in `dtype` on jax's first device:
    the speed no step can beat, the divisor of each side's `floor_step_s` (timed by
    benchmarks/gemm.py). The first few calls of a fresh process ran at half speed on the CPU: best
    of 5 was sometimes one of them."""
    return 2.0 * n**3 / min(time_gemm(n, n, n, dtype, warmup=1, iters=repeats))


def random_tokens(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch_size, seq_len), dtype=np.int32)


def peak_flops_for_name(name: str) -> float | None:
    """Vendor bf16 peak (sizing.PEAK_BF16_FLOPS) of a device named `name`, None when unknown."""
    key = name.upper().replace(" ", "")
    for vendor_name, peak in sizing.PEAK_BF16_FLOPS.items():
        if vendor_name in key:
            return peak
    return None


# ------------------------------------------------------------------------------------------- sides
OPTIMIZERS = ("both", "all", "config", "adamw", "sgd")
SIDE_OF_OPTIMIZER = {"config": OURS, "adamw": OURS_ADAMW, "sgd": OURS_SGD}
# The torch side that runs the same optimizer as each of ours (the like-for-like ratio).
SAME_OPTIMIZER = {OURS: TORCH_MUON, OURS_ADAMW: TORCH, OURS_SGD: TORCH_SGD}


def selected_optimizers(optimizer: str) -> tuple[str, ...]:
    """The optimizers our side runs with for --optimizer ("both" = the config's, then AdamW; "all"
    = those and SGD)."""
    return {"both": ("config", "adamw"), "all": ("config", "adamw", "sgd")}.get(optimizer, (optimizer,))


def make_benchmark_optimizer(c: ml_collections.ConfigDict, optimizer: str) -> optax.GradientTransformation:
    """ "config": the trainer's optimizer (zaya_jax.optim.chain: Muon on the matrices, AdamW on the
    rest). "adamw": every parameter on AdamW with optim.adamw's settings, the same lr schedule, weight
    decay mask and clipping: what torch's side runs, for a like-for-like row. "sgd": plain SGD at
    optim.lr (no momentum, no clipping, as torch.optim.SGD): the cheapest update, so that the pair
    times the model's forward + backward, and what an optimizer adds is the difference."""
    if optimizer == "config":
        return make_optimizer(c, total_steps=c.train.steps)
    if optimizer == "sgd":
        return optax.sgd(c.optim.lr)
    return optax.chain(gradient_clipping(c), adamw(c, lr_schedule(c, c.train.steps)))


class JaxSide:
    """Our full train step, jit-compiled with the state donated; named after its optimizer."""

    def __init__(
        self,
        c: ml_collections.ConfigDict,
        cfg: ZayaConfig,
        ids: np.ndarray,
        seed: int,
        optimizer: str = "config",
    ):
        steps = c.train.steps
        self.name = SIDE_OF_OPTIMIZER[optimizer]
        tx = make_benchmark_optimizer(c, optimizer)
        bal_cfg = balancing_config(c)
        t0 = time.perf_counter()
        # jit: one compilation instead of many small eager ones (the same values either way).
        # The config's mesh (mesh.data/fsdp/expert over every visible device) places the state and the
        # batch exactly as the trainer does: ZeRO-1, FSDP and expert parallelism are measured too.
        self.mesh = mesh_from_config(c)
        host_memory.keep_step_buffers(list(self.mesh.devices.flat))  # as the trainer does
        create = lambda: create_train_state(cfg, tx, bal_cfg or bal.BalancingConfig(), jax.random.key(seed))
        shardings = state_shardings(jax.eval_shape(create), self.mesh, zero1=c.mesh.zero1)
        self.state = run_once(create, shardings)
        self.init_s = time.perf_counter() - t0
        targets = np.roll(ids, -1, axis=1)  # next token; the last position has none (as HF's shift)
        mask = np.ones(ids.shape, np.float32)
        mask[:, -1] = 0.0
        self.batch = shard_batch({"input_ids": ids, "targets": targets, "loss_mask": mask}, self.mesh)
        step = jax.jit(
            make_train_step(cfg, tx, bal_cfg, lr_schedule(c, steps), c.train.grad_accum, self.mesh),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        jax.block_until_ready((self.state, self.batch))
        t0 = time.perf_counter()
        self.step = step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        host_memory.release_freed_memory()  # as the trainer does after a compile
        self.metrics: dict[str, Any] | None = None
        self.devices, self.device = self.mesh.size, jax.default_backend()
        self.precision = f"params {cfg.param_dtype}, matmuls {cfg.dtype}"
        self.threads = self.attn_implementation = None  # XLA:CPU sizes its own thread pool

    def run(self, n: int) -> None:
        for _ in range(n):
            self.state, self.metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, self.metrics))

    def loss(self) -> float | None:
        return None if self.metrics is None else float(self.metrics["loss"])


def run_trainer_loop(c: ml_collections.ConfigDict, loop_steps: int) -> dict[str, Any]:
    """`zaya_jax.train.train` for 2 x loop_steps steps in a temporary workdir, logging every
    loop_steps: the second train record's tokens/s covers steps loop_steps+1..2 loop_steps (the
    first window holds the compilation). Evaluation and checkpointing happen after that window."""
    from zaya_jax.trainer.loop import Trainer  # the trainer pulls in absl, grain and orbax: only when used

    c = ml_collections.ConfigDict(c.to_dict())
    c.train.steps = 2 * loop_steps
    # A schedule that fits the short run (the learning rate does not move the step time).
    c.optim.warmup_steps = min(c.optim.warmup_steps, loop_steps)
    c.optim.decay_fraction = min(c.optim.decay_fraction, 0.5)
    c.logging.every_steps = loop_steps
    c.logging.console = False
    c.eval.every_steps = 0  # the final evaluation (one batch) still runs, after the timed window
    c.eval.batches = 1
    c.checkpoint.every_steps = 0
    c.checkpoint.every_minutes = 0.0
    with tempfile.TemporaryDirectory(prefix="train_step_loop_") as workdir:
        t0 = time.perf_counter()
        trainer = Trainer(c, workdir)
        step_calls = TimedStep(trainer.program.train_step)
        trainer.program = dataclasses.replace(trainer.program, train_step=step_calls)
        trainer.run()
        wall_s = time.perf_counter() - t0
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    timed = [r for r in records if "tokens_per_second" in r and r.get("step") == 2 * loop_steps]
    if not timed:
        raise RuntimeError(f"trainer loop: no train record at step {2 * loop_steps} in metrics.jsonl")
    tokens_per_s = timed[-1]["tokens_per_second"]
    step_time_s = c.train.batch_size * c.train.seq_len / tokens_per_s
    # steps loop_steps+1..2 loop_steps: the window's own step calls, whole steps where they run inline
    calls = step_calls.calls[loop_steps : 2 * loop_steps] if host_memory.keeps_step_buffers() else None
    return {
        "steps": loop_steps,
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time_s,
        "wall_s": wall_s,
        "step_call_s": statistics.mean(calls) if calls else None,
    }


class TimedStep:
    """The trainer's jitted step, each call timed: where jax runs the step on the calling thread
    (host_memory.run_cpu_programs_inline, one CPU device) a call lasts the whole step, so the loop's
    time outside the step is measured in the loop's own window."""

    def __init__(self, step: Callable[..., Any]):
        self.step, self.calls = step, []

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = self.step(*args)
        self.calls.append(time.perf_counter() - t0)
        return out

    def _cache_size(self) -> int:  # the trainer's summary counts its compiled programs
        return self.step._cache_size()


def trainer_loop_alone(
    c: ml_collections.ConfigDict,
    loop_steps: int,
    reuse_host_memory: bool,
    bare_side: Callable[[], JaxSide] | None = None,
    warmup: int = 0,
    steps: int = 0,
) -> dict[str, Any]:
    """`run_trainer_loop` in this process (a fresh spawned one), as `python -m zaya_jax.train` runs:
    glibc's malloc set first when asked; with the process' own peak RSS, read before anything else.

    With `bare_side` (the bare rows' `JaxSide`: the same config, batch and seed), the bare step is
    then built and timed in this same process, `warmup` untimed steps and `steps` timed: the time
    outside the step compares two windows of one process, not two processes (here a process' step
    time moves by up to +-15% from the next one's)."""
    mode = host_memory.configure(reuse_host_memory, reexec=False)
    out = {**run_trainer_loop(c, loop_steps), "peak_rss_bytes": peak_rss_bytes(), "host_memory": mode}
    if bare_side is not None:
        out["bare_step_time_s"] = timed_window(bare_side(), warmup, steps)
    return out


# --------------------------------------------------------------------------------------- benchmark
def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def build_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """The config file + `--set` overrides + `--dtype`, validated (ValueError / KeyError names the key)."""
    c = load_config(args.config)
    for assignment in args.set or []:
        apply_override(c, assignment)
    if args.dtype:
        c.model.dtype = args.dtype
    cfg = config_lib.validate(c)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype={cfg.dtype!r}: this benchmark supports {DTYPES}")
    return c, cfg


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--config and --set, as build_config reads them (the benchmarks that build a training config)."""
    p.add_argument(
        "--config", default="configs/tiny.py", help="training config file (default configs/tiny.py)"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config override, repeatable: --set train.batch_size=4 --set model.num_hidden_layers=2",
    )


def checked_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """build_config at start-up: a bad config file or override ends in one `error:` line."""
    try:
        return build_config(args)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")


def timed_window(side: Any, warmup: int, steps: int) -> float:
    """`warmup` untimed steps, then seconds per step over `steps` timed ones."""
    side.run(warmup)
    t0 = time.perf_counter()
    side.run(steps)
    return (time.perf_counter() - t0) / steps


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
    return arg_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    checked_config(args)  # fail fast, in one line
    report = run_benchmark(args)
    print_and_write(report, format_table(report), summary_line(report), args.out, "train_step")
    return report


if __name__ == "__main__":
    cli.run(main)
