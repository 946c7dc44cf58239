"""Our sides of benchmarks.train_step: the jitted train step with each optimizer, the real
trainer loop, the matmul peak they are measured against."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from benchmarks.common import (
    peak_rss_bytes,
)
from benchmarks.gemm import time_gemm
from benchmarks.torch_side import TORCH, TORCH_MUON, TORCH_SGD
from zaya_jax import sizing
from zaya_jax.model import ZayaConfig
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import adamw, gradient_clipping, lr_schedule, make_optimizer
from zaya_jax.parallel.mesh import (
    mesh_from_config,
)
from zaya_jax.parallel.sharding import shard_batch
from zaya_jax.runtime import host_memory
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


def timed_window(side: Any, warmup: int, steps: int) -> float:
    """`warmup` untimed steps, then seconds per step over `steps` timed ones."""
    side.run(warmup)
    t0 = time.perf_counter()
    side.run(steps)
    return (time.perf_counter() - t0) / steps
