"""The Trainer: one training run's set-up and loop (next batch, step, faults, log, evaluate, save)."""

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
from absl import logging

from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.data import mixture as mixture_lib
from zaya_jax.data.pipeline import (
    Lookahead,
)
from zaya_jax.hf.pretrained import store_tokenizer
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.parallel.sharding import shard_batch
from zaya_jax.runtime import host_memory
from zaya_jax.trainer.evaluations import downstream_tasks, evaluate, harness_tasks
from zaya_jax.trainer.startup import (
    _batch_ramp,
    _check_init_from,
    _check_memory,
    _checked_inputs,
    _checkpointer,
    _data_position,
    _init_from,
    _lock_workdir,
    _missing_root,
    _refuse_fresh_start_after_quarantine,
    _remove_created,
    _train_dataset,
)
from zaya_jax.training import fault, resume
from zaya_jax.training.events import EventLog
from zaya_jax.training.fault import Do, FaultMonitor
from zaya_jax.training.metrics import MetricsLogger, to_python
from zaya_jax.training.routing_telemetry import DEAD, DeadExperts
from zaya_jax.training.train_state import (
    SPILL_BLOCKS,
    SPILL_STEP_FRACTION,
    TrainState,
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
