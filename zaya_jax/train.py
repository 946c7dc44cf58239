"""`python -m zaya_jax.train --config configs/<name>.py --workdir DIR [--config.train.steps=100 ...]`

Trains a ZAYA1 model: validated config -> data (grain) -> jit-compiled train step with our Muon /
AdamW chain and aux-loss-free router balancing -> metrics (console, WORKDIR/metrics.jsonl,
TensorBoard) -> periodic held-out evaluation -> Orbax checkpoints. An existing WORKDIR resumes from
its latest checkpoint, data position included, read straight into the sharded arrays (a checkpoint
of another model or optimizer is an error that moves nothing; an unreadable newest checkpoint is
skipped with a warning; if none is readable the run stops with an error).

One run per workdir: the run holds WORKDIR/zaya_jax.lock (zaya_jax/runtime/workdir_lock.py). A resume
says which checkpoint it read and refuses other data or another learning-rate plan unless
allowed (zaya_jax/training/resume.py). Before the first step the train and eval steps are compiled and
their memory compared with the devices' (zaya_jax/runtime/device_memory.py): a step that cannot fit is one
`error:` line, the workdir left as it was. Fault handling, the one-step-late loss read, and where each part
lives: docs/design/trainer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.analysis import dry_run, fit, hardware, prediction
from zaya_jax.data import mixture as mixture_lib
from zaya_jax.data.megatron import MegatronOptions
from zaya_jax.data.megatron_format import check_token_ids, megatron_prefix, stderr_progress
from zaya_jax.data.pipeline import (
    Lookahead,
    batch_sequences,
    load_documents,
    make_dataset,
    source_tokenizer,
)
from zaya_jax.data.ramp import BatchRamp, parse_batch_ramp
from zaya_jax.hf.pretrained import check_stored_tokenizer, store_tokenizer
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.distributed import initialize_from_env
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.parallel.sharding import shard_batch
from zaya_jax.runtime import cli, device_memory, gpu_target, host_memory, workdir_lock
from zaya_jax.runtime.cli import UserError
from zaya_jax.trainer.evaluations import downstream_tasks, eval_rows, evaluate, harness_tasks
from zaya_jax.training import fault, resume
from zaya_jax.training.checkpoint import Checkpointer, CheckpointError, abstract_like, checkpoint_workdir
from zaya_jax.training.events import EventLog
from zaya_jax.training.fault import Do, FaultMonitor
from zaya_jax.training.metrics import MetricsLogger, to_python
from zaya_jax.training.routing_telemetry import DEAD, DeadExperts
from zaya_jax.training.train_state import (
    SPILL_BLOCKS,
    SPILL_STEP_FRACTION,
    TrainState,
    abstract_batch,
    check_batch_divides,
    make_eval_step,
    train_program,
)


@dataclasses.dataclass(frozen=True)
class _Batch:
    """Step `step`'s batch on the devices, and its global size (sequences)."""

    step: int
    batch: dict[str, jax.Array]
    global_batch: int


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched train step: its metrics are device arrays until read; `drawn` is how many
    batches the data iterator had given out once this step took its own (for the step's log; None
    when no log is due at this step)."""

    step: int
    metrics: dict[str, jax.Array]
    global_batch: int
    drawn: int | None
    done_at: float | None  # perf_counter() when the step had ended, if it had when its dispatch returned


class _Verdict(NamedTuple):
    """What the loop reads of every step: its loss, whether its update was skipped, how many MoE
    blocks took the expert exchange's spill round (None without a spill round), and when the step
    was seen to have ended (the throughput's clock)."""

    loss: float
    skipped: bool
    spill_blocks: int | None
    done_at: float


def _read(p: _InFlight, dead: DeadExperts) -> _Verdict:
    """A dispatched step's verdict: waits for the step to finish (one device_get). Its expert load
    [L, E] comes in the same transfer and goes to the dead-expert window."""
    keys = ("loss", "update_skipped", SPILL_BLOCKS, "expert_load")
    loss, skipped, spills, load = jax.device_get(tuple(p.metrics.get(k) for k in keys))
    done_at = time.perf_counter() if p.done_at is None else p.done_at
    dead.observe(p.step, load)
    return _Verdict(float(loss), bool(skipped), None if spills is None else int(spills), done_at)


@dataclasses.dataclass
class _SpillTally:
    """Spill rounds of the steps since the last train record, from every step's verdict (read with
    its loss: no host sync of its own) -> the record's `expert_exchange/` metrics."""

    steps: int = 0
    spilled_steps: int = 0
    blocks: int = 0

    def add(self, spill_blocks: int | None) -> None:
        if spill_blocks is not None:
            self.steps += 1
            self.spilled_steps += spill_blocks > 0
            self.blocks += spill_blocks

    def record(self) -> dict[str, float]:
        """Mean spill blocks per step and the fraction of steps with any, since the last record."""
        if not self.steps:
            return {}
        return {SPILL_BLOCKS: self.blocks / self.steps, SPILL_STEP_FRACTION: self.spilled_steps / self.steps}


def _lookahead_loss(eval_step, state: TrainState, batch: dict[str, jax.Array]) -> float:
    """The loss of the just-updated model on the next step's batch (as that step will see it)."""
    out = jax.device_get(eval_step(state.variables, batch))
    return float(out["loss_sum"]) / max(float(out["weight"]), 1.0)


def _train_loss(p: _InFlight) -> float:
    """A dispatched step's train loss (computed before its update): the previous update's model on
    this step's batch, which confirms or clears a spike of the previous step."""
    return float(jax.device_get(p.metrics["loss"]))


def train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the training described by `c` in `workdir`. Returns a summary dict."""
    return Trainer(c, workdir).run()


class Trainer:
    """One training run (module docstring): the set-up in __init__ (validated inputs, mesh, train
    program, data, checkpoints, the state restored or created), the loop in `run`.

    Loop state: `step` (the last step dispatched and kept), `state` (the train state after it),
    `ahead` (the next step's batch, put on the devices while a step runs), `pending` (a dispatched
    step whose loss is not read yet), `tokens_since` / `t_last` (throughput since the last log),
    `dead` (every read step's expert load, for the dead-expert count of the logs).
    """

    def __init__(self, c: ml_collections.ConfigDict, workdir: str):
        self.c, self.workdir = c, workdir
        created = _missing_root(workdir)  # what making the workdir creates (removed on a refusal)
        self.cfg, self.sources, self.tokenizer = _checked_inputs(c, workdir)
        tokenizer = self.tokenizer
        self.seq_len, self.steps = c.train.seq_len, c.train.steps
        self.primary = jax.process_index() == 0
        # Before anything is written into the workdir; the start-up signal exit releases it too.
        self.lock = _lock_workdir(workdir)
        self.stop = fault.installed_stop_signals()
        if self.stop is not None and self.lock is not None:
            self.stop.on_exit(self.lock.release)
        try:
            self._set_up(tokenizer)
        except BaseException:  # a refused start leaves no directory it created behind
            self._release()
            _remove_created(workdir, created)
            raise

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _set_up(self, tokenizer) -> None:
        """Mesh, train program, data, checkpoints, the state restored or created."""
        c, workdir = self.c, self.workdir
        self.seq_len, self.steps = c.train.seq_len, c.train.steps
        self.events = EventLog(workdir, enabled=self.primary)
        self.mesh = mesh_from_config(c)
        check_batch_divides(c, self.mesh.size)
        host_memory.keep_step_buffers(list(self.mesh.devices.flat))
        self.harness = harness_tasks(c, self.cfg, tokenizer, self.mesh)  # lm-eval's tasks: checked now
        # context ranks hold chunks of the same rows: the batch divides over the other axes only
        self.ramp = _batch_ramp(c, row_devices(self.mesh))
        self.program = train_program(c, self.cfg, self.mesh)
        # The restore target: a resume reads straight into the sharded arrays, and the fresh state is
        # built only when there is nothing to restore (one train state in memory, not two).
        self.abstract_state = self.program.abstract_state()
        train_ds, self.mixture = _train_dataset(c, self.sources, self.ramp)
        if self.mixture is not None and self.primary:
            print(
                mixture_lib.epochs_report(self.sources, self.mixture, self.ramp.consumed(self.steps)),
                flush=True,
            )
        self.data = Lookahead(iter(train_ds))
        self.eval_step = jax.jit(make_eval_step(self.cfg, self.mesh, c.mesh.context_layout))
        _check_memory(c, self.program, self.abstract_state, self.eval_step)
        self.downstream = downstream_tasks(c, self.cfg, tokenizer, self.mesh)
        self.ckpt = _checkpointer(c, workdir)
        # saved with every checkpoint: data paths absolute, so the workdir's commands run from anywhere
        self.config_json = config_lib.with_absolute_paths(json.loads(c.to_json_best_effort()))
        self.state = self._restore_or_create()
        if self.primary:  # the workdir holds the tokenizer its commands read (zaya_jax/hf/pretrained.py)
            store_tokenizer(self.tokenizer, workdir)
        self.step = start = int(self.state.step)
        self.peak = sizing.peak_flops_per_device()
        self.summary: dict[str, Any] = {
            "start_step": start,
            "mesh": dict(self.mesh.shape),
            "rollbacks": 0,
            "skipped_updates": 0,
            "batch_sizes": [],
        }
        self.ahead: _Batch | None = None
        self.pending: _InFlight | None = None
        self.dead = DeadExperts(c.logging.dead_expert_window)
        self.t_last, self.tokens_since = time.perf_counter(), 0
        self.spills = _SpillTally()

    def run(self) -> dict[str, Any]:
        self.faults = FaultMonitor(self.c.fault, self.events.write, self.cfg.vocab_size, stop=self.stop)
        # Process 0 owns WORKDIR/metrics.jsonl and TensorBoard; the others keep their own record.
        log_dir = (
            self.workdir if self.primary else os.path.join(self.workdir, f"process_{jax.process_index()}")
        )
        try:
            with MetricsLogger(
                log_dir,
                total_steps=self.steps,
                tensorboard=self.c.logging.tensorboard and self.primary,
                console=self.c.logging.console,
                resume_step=self.step,
            ) as self.logger:
                self.t_last, self.tokens_since = time.perf_counter(), 0
                self._loop()
        finally:
            self.faults.close()
            self.ckpt.close()  # waits for the last save; on an error too (no "Event loop is closed")
            self._release()
        self.summary["skipped_updates"] = self.faults.skipped_updates
        self.summary["final_step"] = int(self.state.step)
        self.summary["train_programs"] = self.program.train_step._cache_size()
        self.summary["host_memory"] = host_memory.mode()
        self.summary["lean_cpu_compile"] = host_memory.compiles_lean()
        self.summary["keep_step_buffers"] = host_memory.keeps_step_buffers()
        return self.summary

    def _loop(self) -> None:
        """Next batch, step, faults, log, evaluate, save; see the module docstring for the order."""
        c, steps = self.c, self.steps
        while self.step < steps:
            done = self.step + 1
            current = self._dispatch(done)  # returns before the step ends (unless run inline: docstring)
            if self.pending is not None:  # the previous step's verdict, read while this one runs
                pending, self.pending = self.pending, None
                verdict = _read(pending, self.dead)
                if self._judge(pending, verdict, functools.partial(_train_loss, current)):
                    continue  # step `done` ran on a discarded state: its result is dropped
                self._log(pending, verdict)
            self.pending, self.step = current, done
            at = self.faults.boundary(done, self.ckpt.due(done))
            eval_due = bool(c.eval.every_steps and done % c.eval.every_steps == 0) or done == steps
            if not (c.train.sync_every_step or at.stop or at.save or eval_due):
                continue  # step `done` is judged (and logged) after step done + 1 is dispatched
            # What follows must see this step's verdict (a checkpoint is never written for a step
            # whose loss was not checked): read it now.
            self.pending = None
            verdict = _read(current, self.dead)
            self.faults.unwatch()
            next_loss = functools.partial(self._eval_next_loss, done + 1, self.state)
            if self._judge(current, verdict, next_loss):
                continue
            self._log(current, verdict)
            if eval_due:
                self._evaluate(done)
            if at.save or at.stop or done == steps:
                self._save(done, "signal" if at.stop else ("final" if done == steps else "periodic"))
            if at.stop:
                self._stop(done)
                break

    def _fetch(self, n: int) -> _Batch:
        """Step n's batch on the devices: the iterator's next element, peeked (a checkpoint saved
        meanwhile resumes at it), with step n's test hook applied."""
        host = self.faults.poison(n, self.data.peek())
        return _Batch(n, shard_batch(host, self.mesh), host["input_ids"].shape[0] * jax.process_count())

    def _dispatch(self, n: int) -> _InFlight:
        """Dispatches step n on its batch, and fetches step n + 1's while it runs."""
        if self.ahead is None or self.ahead.step != n:
            self.ahead = self._fetch(n)
        batch, self.ahead = self.ahead, None
        next(self.data)  # the peeked batch, now this step's
        seen = self.summary["batch_sizes"]
        new_program = batch.global_batch not in seen
        self.faults.watch(n, known_program=not new_program)
        if new_program:
            if not seen and self.primary:
                print("compiling the train step...", flush=True)
            seen.append(batch.global_batch)
        self.state, metrics = self.program.train_step(self.state, batch.batch)
        self.faults.stop.training()  # compiled: a signal now saves at the next step boundary
        # Where jax runs the step on this thread (host_memory.run_cpu_programs_inline) it has ended:
        # its throughput window closes now, not when its verdict is read after the next step.
        done_at = time.perf_counter() if metrics["loss"].is_ready() else None
        if new_program:  # compiled just now: hand the compiler's freed memory back
            host_memory.release_freed_memory()
        # Batches given out, this step's included: read now, as the log may come after the next step.
        drawn = int(self.data.get_state()["next_index"]) if self._log_due(n) else None
        if n < self.steps:
            self.ahead = self._fetch(n + 1)
        return _InFlight(n, metrics, batch.global_batch, drawn, done_at)

    def _judge(self, p: _InFlight, verdict: _Verdict, next_loss: Callable[[], float]) -> bool:
        """Step p's verdict; True if it rolled the run back."""
        self.tokens_since += p.global_batch * self.seq_len
        action = self.faults.after_step(p.step, verdict.loss, verdict.skipped, next_loss)
        return action.do is Do.ROLL_BACK and self._roll_back(action.step, action.reason)

    def _eval_next_loss(self, n: int, updated: TrainState) -> float:
        """No step n in flight: an eval step measures the updated model's loss on its batch."""
        if self.ahead is None:
            self.ahead = self._fetch(n)
        return _lookahead_loss(self.eval_step, updated, self.ahead.batch)

    def _roll_back(self, k: int, reason: str) -> bool:
        """Restores the last checkpoint before step k and skips the batches of the steps since, k's
        included; False if there is none."""
        self.ckpt.wait()
        back = self.ckpt.restore_latest(self.abstract_state, max_step=k - 1, on_corrupt=self._on_corrupt)
        if back is None:
            self.events.write(k, "rollback_impossible", reason=reason)
            logging.warning("%s at step %d but no checkpoint to roll back to; continuing", reason, k)
            return False
        to, self.state, data_state, _ = back
        self.data.set_state(data_state)  # drops a prefetched batch
        self.ahead = None
        for _ in range(k - to):  # the batches of steps to+1..k, the offending one included
            next(self.data)
        skipped = list(range(to + 1, k + 1))
        self.events.write(k, "rollback", reason=reason, to_step=to, skipped_batches=skipped)
        print(
            f"ROLLBACK at step {k}: {reason}; restored step {to}, skipped the batches of steps {to + 1}..{k}",
            flush=True,
        )
        self.summary["rollbacks"] += 1
        self.logger.truncate_after(to)
        self.faults.rolled_back()
        self.dead.reset()  # the steps since `to` are re-run
        self.step = to
        self.t_last, self.tokens_since = time.perf_counter(), 0
        self.spills = _SpillTally()
        return True

    def _log_due(self, step: int) -> bool:
        return step % self.c.logging.every_steps == 0 or step == self.steps

    def _log(self, p: _InFlight, verdict: _Verdict) -> None:
        """Step p's train record, if one is due; p's verdict has been read (p is finished). Whatever
        was dispatched since does not show: the record holds p's metrics and data position, and
        the spill rounds of the steps since the last record (p's included)."""
        self.spills.add(verdict.spill_blocks)
        if not self._log_due(p.step):
            return
        m = {k: to_python(v) for k, v in jax.device_get(p.metrics).items()}
        m.update(self.spills.record())
        self.spills = _SpillTally()
        now = verdict.done_at  # the tokens are those of the steps up to p, which had ended then
        m["tokens_per_second"] = self.tokens_since / max(now - self.t_last, 1e-9)
        util = sizing.mfu(m["tokens_per_second"], self.cfg, self.seq_len, self.mesh.size, self.peak)
        if util is not None:
            m["mfu"] = util
        m.update(_data_position(p.drawn, self.ramp, self.mixture, self.sources, self.seq_len))
        m[DEAD] = self.dead.count(p.step)
        self.logger.log_train(p.step, m)
        self.t_last, self.tokens_since = now, 0
        self.summary["loss"] = m["loss"]

    def _evaluate(self, step: int) -> None:
        ev = evaluate(self.eval_step, self.state.variables, self.c, self.mesh)
        if self.downstream is not None:
            ev.update(self.downstream(self.state.variables))
        if self.harness is not None:
            ev.update(self.harness(self.state.variables))
        self.logger.log_eval(step, ev)
        self.summary.update(ev)
        host_memory.release_freed_memory()  # an evaluation may have compiled programs (the first does)
        self.t_last = time.perf_counter()  # evaluation time is not training throughput

    def _save(self, step: int, reason: str) -> None:
        self.ckpt.save(step, self.state, self.data.get_state(), self.config_json)
        self.events.write(step, "save", reason=reason)

    def _stop(self, step: int) -> None:
        self.ckpt.wait()
        signum = self.faults.stop.signum
        self.events.write(step, "sigterm", signal=signum)
        name = signal.Signals(signum).name
        print(f"interrupted by {name}: saved step {step}; exit {128 + signum}", flush=True)
        self.summary["stopped_by_signal"] = signum

    def _say(self, *lines: str) -> None:
        if self.primary:
            for line in lines:
                print(line, flush=True)

    def _on_corrupt(self, step: int, msg: str) -> None:
        self.events.write(step, "corrupt_checkpoint", error=msg)

    def _restore_or_create(self) -> TrainState:
        """The latest readable checkpoint (data position included), else a fresh state (from
        train.init_from when set)."""
        try:
            restored = self.ckpt.restore_latest(
                self.abstract_state, on_corrupt=self._on_corrupt, config=self.config_json
            )
            if restored is not None:
                step, state, data_state, saved_config = restored
                path = os.path.join(self.ckpt.directory, str(step))
                lines = resume.check(saved_config, self.c, step, path)  # nothing written before
                self._say(f"resumed from step {step} ({path})", *lines)
                self.data.set_state(data_state)
                self.events.write(int(state.step), "resume", checkpoint=path)
                return state
            _refuse_fresh_start_after_quarantine(self.ckpt, self.c)
            if self.c.train.init_from:  # before the fresh state is built
                _check_init_from(self.c.train.init_from, self.abstract_state, self.config_json)
            self._say(f"initialising a new model in {self.ckpt.directory}")
            state = self.program.initial_state()
            host_memory.release_freed_memory()  # what compiling the initializer left
            if self.c.train.init_from:
                state, source = _init_from(state, self.c.train.init_from)
                self._say(f"initialised from {source} (params and balancing biases; step 0)")
            return state
        except BaseException:
            self.ckpt.close()  # a clean shutdown of Orbax's threads, whatever the error
            raise


def _checked_inputs(c: ml_collections.ConfigDict, workdir: str):
    """(validated ZayaConfig, data.mixture sources or None, the data's tokenizer), every input
    checked before anything is built; then creates `workdir` (every process: each writes into it)."""
    cfg = config_lib.validate(c)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UserError(f"--workdir {workdir} is a file, not a directory")
    sources = mixture_lib.parse_mixture(c.data.mixture) if c.data.mixture else None
    tokenizer = source_tokenizer(sources[0].path if sources else c.data.path, MegatronOptions.of(c.data))
    data_key = (
        f"config.data.mixture source {sources[0].path}"
        if sources
        else f"config.data.path={c.data.path or 'embedded'}"
    )
    check_stored_tokenizer(tokenizer, workdir, data_key)  # a resume on data of another tokenizer
    check_eval_data(c, sources)  # before step 1, not at the first evaluation
    if c.train.init_from:
        _init_from_checkpoint(c.train.init_from)[0].close()  # it exists, checked before anything is built
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer "
            f"vocabulary ({tokenizer.vocab_size}, {tokenizer.name})"
        )
    _check_megatron_tokens(c, sources, tokenizer.vocab_size)
    os.makedirs(workdir, exist_ok=True)
    return cfg, sources, tokenizer


def _check_megatron_tokens(c: ml_collections.ConfigDict, sources, vocab_size: int) -> None:
    """Every token id of every Megatron source below the tokenizer's vocabulary (itself within the
    model's): one scan of each .bin at start-up, with progress lines on stderr."""
    paths = [s.path for s in sources] if sources else [c.data.path]
    progress = stderr_progress if jax.process_index() == 0 else None
    for path in paths:
        prefix = megatron_prefix(path)
        if prefix is not None:
            check_token_ids(prefix, vocab_size, progress)


def _lock_workdir(workdir: str) -> workdir_lock.WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole run (zaya_jax/runtime/workdir_lock.py); the other
    processes of the run (one run, several processes) learn its outcome and stop with it."""
    lock, refused = None, ""
    if jax.process_index() == 0:
        try:
            lock = workdir_lock.acquire(workdir, "train")
        except UserError as e:
            refused = str(e)
    refused = fault.share_from_first("workdir_lock", refused)
    if refused:
        if lock is not None:
            lock.release()
        raise workdir_lock.WorkdirLocked(refused)
    return lock


def _check_memory(c: ml_collections.ConfigDict, program, abstract_state, eval_step) -> None:
    """Refuses, before anything is allocated or saved, a train step at the full batch, or the held-out
    evaluation's step (every run evaluates at its last step), that needs more memory than this
    process' devices have (zaya_jax/runtime/device_memory.py). Both are compiled here from abstract shapes;
    the run's first calls reuse the compiles."""
    mesh = program.mesh
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    eval_remedies = f"lower eval.batch_size (now {c.eval.batch_size}), or add devices"
    programs = (
        ("the train step", program.train_step, abstract_state, c.train.batch_size),
        ("the evaluation step", eval_step, abstract_state.variables, eval_rows(c, mesh)),
    )
    for what, jitted, state, rows in programs:
        batch = abstract_batch(rows, c.train.seq_len, mesh)
        remedies = fit.memory_remedies(c, mesh) if jitted is program.train_step else eval_remedies
        try:
            stats = jitted.lower(state, batch).compile().memory_analysis()
        except jax.errors.JaxRuntimeError as e:  # a compiler that refuses what cannot fit
            reason = str(e).strip().splitlines()[0][:300]
            if "RESOURCE_EXHAUSTED" not in reason and "out of memory" not in reason.lower():
                raise
            raise UserError(
                f"{what} does not fit this machine's memory (XLA: {reason}): {remedies}"
            ) from None
        error = None if stats is None else device_memory.shortfall(stats, local, what, remedies)
        if error is not None:
            raise UserError(error)


def _missing_root(path: str) -> str | None:
    """The outermost directory of `path` that does not exist yet; None when `path` exists."""
    path, root = os.path.abspath(path), None
    while not os.path.exists(path):
        path, root = os.path.dirname(path), path
    return root


def _remove_created(workdir: str, root: str | None) -> None:
    """Removes the empty directories from `workdir` up to `root` (those this run created)."""
    path = os.path.abspath(workdir)
    while root is not None and path.startswith(root):
        try:
            os.rmdir(path)
        except OSError:
            return  # something was written there meanwhile: leave it
        path = os.path.dirname(path)


def _batch_ramp(c: ml_collections.ConfigDict, devices: int) -> BatchRamp:
    ramp = parse_batch_ramp(c.train.batch_ramp, c.train.batch_size)
    try:
        ramp.check_divisible(devices, c.train.grad_accum)
    except ValueError as e:
        raise ValueError(f"config.train.batch_ramp={c.train.batch_ramp!r}: {e}") from None
    return ramp


def _checkpointer(c: ml_collections.ConfigDict, workdir: str) -> Checkpointer:
    k = c.checkpoint
    return Checkpointer(
        workdir,
        keep=k.keep,
        keep_period=k.keep_period,
        every_steps=k.every_steps,
        every_minutes=k.every_minutes,
    )


def _train_dataset(c: ml_collections.ConfigDict, sources, ramp: BatchRamp):
    """(this process' training batches, the MixedSequences of data.mixture or None)."""
    kwargs = dict(
        global_batch_size=c.train.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        ramp=ramp if c.train.batch_ramp else None,
        num_threads=c.data.num_threads,
        prefetch_buffer_size=c.data.prefetch,
    )
    kwargs["megatron"] = MegatronOptions.of(c.data)
    if sources is None:
        return make_dataset(c.data.path, seq_len=c.train.seq_len, seed=c.seed, **kwargs), None
    megatron = kwargs.pop("megatron")
    mixture = mixture_lib.mixed_sequences(sources, seq_len=c.train.seq_len, seed=c.seed, megatron=megatron)
    return batch_sequences(mixture, **kwargs), mixture


def _data_position(drawn: int, ramp: BatchRamp, mixture, sources, seq_len: int) -> dict[str, int]:
    """batch_size, tokens_seen and mixture/<name> (tokens drawn per source) after `drawn` batches (a
    step's own included): pure functions of the data position, so a resume continues them exactly."""
    consumed = ramp.consumed(drawn)
    out = {"batch_size": ramp.size(drawn - 1), "tokens_seen": consumed * seq_len}
    if mixture is not None:
        for source, n in zip(sources, mixture.counts(consumed)):
            out[f"mixture/{source.name}"] = n * seq_len
    return out


def check_eval_data(c: ml_collections.ConfigDict, sources) -> None:
    """The held-out split every evaluation (and the last step) reads exists and is not empty: that of
    data.path, or of every data.mixture source."""
    keyed = [("data.mixture", s.path) for s in sources] if sources else [("data.path", c.data.path)]
    for key, path in keyed:
        if load_documents(path, "eval", MegatronOptions.of(c.data)).num_docs == 0:
            raise UserError(
                f"config.{key}={path}: the 'eval' split has no documents, and the run evaluates "
                "at its last step; prepare the data again with a held-out split (--eval-fraction > 0)"
            )


def _refuse_fresh_start_after_quarantine(ckpt: Checkpointer, c: ml_collections.ConfigDict) -> None:
    """A workdir whose checkpoints were all moved aside as unreadable does not silently restart."""
    if ckpt.quarantined() and not c.checkpoint.allow_fresh_start:
        raise CheckpointError(
            f"{ckpt.workdir} has no checkpoint left, but {ckpt.corrupt_directory}/ holds "
            f"{len(ckpt.quarantined())} unreadable one(s); refusing to start from step 0 over it "
            "(pass --config.checkpoint.allow_fresh_start=True to start afresh)"
        )


def _init_from(state: TrainState, directory: str) -> tuple[TrainState, str]:
    """Phase chaining: params and balancing biases from another run's latest checkpoint; optimizer
    state and step start fresh (a new phase has its own schedule). Only those two fields are read,
    so the source run may have used a different optimizer. Returns the state and the checkpoint
    directory read."""
    src, step = _init_from_checkpoint(directory)
    try:
        part = src.restore_params(step, abstract_like({"params": state.params, "balancing": state.balancing}))
    finally:
        src.close()
    source = os.path.join(src.directory, str(step))
    return dataclasses.replace(state, params=part["params"], balancing=part["balancing"]), source


def _check_init_from(directory: str, abstract_state: TrainState, config_json: dict) -> None:
    """train.init_from holds this model's params and balancing biases (metadata only): another
    model is named by its differing config.model keys, as a resume names them."""
    src, step = _init_from_checkpoint(directory)
    try:
        part = {"params": abstract_state.params, "balancing": abstract_state.balancing}
        diffs = src.mismatch(step, part, config_json, sections=("model",))
    finally:
        src.close()
    if diffs:
        raise UserError(
            f"config.train.init_from={directory!r}: checkpoint {step} was saved with another model: "
            f"{diffs}. Nothing was changed; give this run the checkpoint's model keys"
        )


def _init_from_checkpoint(directory: str) -> tuple[Checkpointer, int]:
    """(read-only Checkpointer, step) of config.train.init_from; UserError if there is none."""
    workdir, step = checkpoint_workdir(directory)
    try:
        src = Checkpointer(workdir, read_only=True)
    except FileNotFoundError as e:
        raise UserError(f"config.train.init_from={directory!r}: {e}") from None
    step = src.latest_step() if step is None else step
    if step is None or step not in src.all_steps():
        src.close()
        raise UserError(f"config.train.init_from={directory!r}: no complete checkpoint there")
    return src, step


FLAGS = flags.FLAGS


def _define_flags(fv=None) -> None:
    """CLI flags, defined only when run as a program: importing this module defines none. On absl's
    FLAGS, or the FlagValues `fv`; numeric and enumerated ones declare their values (zaya_jax/runtime/cli.py)."""
    fv = FLAGS if fv is None else fv
    config_flags.DEFINE_config_file(
        "config", None, "Training config file (configs/<name>.py[:arg]).", lock_config=True, flag_values=fv
    )
    flags.DEFINE_string(
        "workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard.", flag_values=fv
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Compile the full-size train step (for --dry_run_target), print memory per device, "
        "collectives and compile time, and exit; needs no --workdir (zaya_jax/analysis/dry_run.py).",
        flag_values=fv,
    )
    cli.define_flag(
        "dry_run_devices",
        None,
        "Devices --dry_run simulates (default: the mesh size; 8 if an axis is -1).",
        cli.Int(min=1),
        fv,
    )
    cli.define_flag(
        "dry_run_target",
        "cpu",
        "What --dry_run compiles for: cpu (simulated CPU devices), mi300x, h100 or h200 (deviceless GPUs, "
        "XLA's GPU compiler; pip install -e '.[gpu_compile]'), or a GpuTargetConfig text file.",
        gpu_target.TARGET_FLAG,
        fv,
    )
    flags.DEFINE_bool(
        "dry_run_fit",
        False,
        "With a GPU --dry_run_target: also find the largest microbatch (sequences per device) that fits.",
        flag_values=fv,
    )
    cli.define_flag(
        "dry_run_hardware",
        None,
        "A JSON file of hardware figures (any keys of zaya_jax/analysis/hardware.py) overriding the "
        "--dry_run_target's in the predicted step, e.g. a cluster's measured bandwidths.",
        cli.Parsed(hardware.read_file, "a JSON file of hardware keys", invalid=("/nonexistent/hw.json",)),
        fv,
    )
    cli.define_flag(
        "dry_run_json",
        None,
        "Also write the --dry_run report as JSON to this file (also when the step does not fit).",
        cli.Parsed(
            _new_file, "a file path in an existing directory", invalid=("/nonexistent/dir/report.json",)
        ),
        fv,
    )


def _new_file(path: str) -> str:
    """A path a report can be written to: its directory exists and it is not a directory."""
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError("no such directory" if not os.path.isdir(path) else "a directory")
    return path


def main(argv):
    if FLAGS.config is not None:
        # before jax creates a backend (XLA reads XLA_FLAGS then) and starts its threads; may
        # re-execute this command once (zaya_jax/runtime/host_memory.py). Checked as booleans later.
        t = FLAGS.config.train
        host_memory.configure(reuse=t.reuse_host_memory is True, lean=t.lean_cpu_compile is True)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if (FLAGS.dry_run_json or FLAGS.dry_run_hardware) and not FLAGS.dry_run:
        raise app.UsageError("--dry_run_json and --dry_run_hardware go with --dry_run")
    if FLAGS.dry_run and FLAGS.config is not None:  # before jax starts: it picks the simulated devices
        fault.install_stop_signals("during the dry run; nothing written")
        name = config_flags.get_config_filename(FLAGS["config"])
        report = dry_run.dry_run(
            FLAGS.config,
            FLAGS.dry_run_devices,
            name,
            target=FLAGS.dry_run_target,
            fit=FLAGS.dry_run_fit,
            hardware_override=FLAGS.dry_run_hardware,
        )
        print(report.text, flush=True)
        if FLAGS.dry_run_json:
            prediction.write_json(FLAGS.dry_run_json, report.data)
        if report.error:
            raise UserError(report.error)
        return
    if FLAGS.config is None or not FLAGS.workdir:
        raise app.UsageError("--config and --workdir are required")
    fault.install_stop_signals("before the first step; nothing saved")
    initialize_from_env()
    if jax.process_index() == 0:
        devices = jax.devices()
        print(
            f"train: {config_flags.get_config_filename(FLAGS['config'])} in {os.path.abspath(FLAGS.workdir)}, "
            f"{len(devices)} {devices[0].platform} device(s) in {jax.process_count()} process(es)",
            flush=True,
        )
    summary = train(FLAGS.config, FLAGS.workdir)
    print(json.dumps({"summary": summary}))
    signum = summary.get("stopped_by_signal")
    return None if signum is None else 128 + signum  # saved, but the run did not finish


if __name__ == "__main__":
    cli.run_absl(main, _define_flags)
