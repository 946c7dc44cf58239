"""Fault handling of a training run that does not depend on the model: loss-spike detection, the
step watchdog, the stop signals, cross-process agreement and the test hooks that poison a batch,
behind one `FaultMonitor` whose `after_step(...)` turns a step's (possibly one step late) loss and
skip flag into what the training loop must do: continue, or roll back.

A loss spike is judged against the last `window` accepted losses with a robust centre and spread
(median, 1.4826 * median absolute deviation), so one earlier outlier in the window neither hides a
spike nor makes the next ordinary batch look like one. A loss is *anomalous* when both
    z = (loss - median) / spread > zscore        (far outside the window's spread), and
    loss > median * (1 + min_jump)               (a real jump, not a tight window's noise).
An anomalous loss is only a *candidate*: an ordinary hard batch of a small-batch run can be both.
The trainer confirms it by the loss of the updated model on the next batch (`confirm`): a batch
that damaged the model leaves that loss anomalous too, a merely hard batch does not. Only a
confirmed spike rolls the run back; losses that are not spikes join the window.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MAD_TO_STD = 1.4826  # the MAD of a normal distribution is 0.6745 sigma


@dataclasses.dataclass
class SpikeDetector:
    """zscore: 0 turns detection off. window: losses judged against (needs a full window to judge).
    min_jump: the relative jump over the median a spike must also exceed."""

    zscore: float
    window: int
    min_jump: float = 0.2

    def __post_init__(self):
        self.history: collections.deque = collections.deque(maxlen=max(self.window, 1))

    def judge(self, loss: float) -> dict[str, float] | None:
        """Statistics of `loss` against the window if it is anomalous, else None. Records nothing."""
        if not self.zscore or len(self.history) < self.window:
            return None
        h = np.asarray(self.history, np.float64)
        median = float(np.median(h))
        # the spread is floored at 1% of the median: a flat window must not make noise infinite
        spread = max(MAD_TO_STD * float(np.median(np.abs(h - median))), 0.01 * abs(median), 1e-6)
        z = (loss - median) / spread
        if z > self.zscore and loss > median + self.min_jump * abs(median):
            return {"zscore": z, "median": median, "spread": spread, "jump": loss / median - 1.0}
        return None

    def record(self, loss: float) -> None:
        """Adds an accepted (non-spike) loss to the window."""
        self.history.append(loss)

    def check(self, loss: float, next_loss: Callable[[], float] | None = None) -> dict[str, float] | None:
        """One step: the statistics of a confirmed spike, else None after recording `loss`.
        `next_loss()` (called only for an anomalous loss) gives the loss of the updated model on the
        next batch; without it an anomalous loss is a spike."""
        stats = self.judge(loss)
        if stats is not None and next_loss is not None:
            ahead_loss = float(next_loss())
            ahead = self.judge(ahead_loss)
            if ahead is None:
                stats = None
            else:
                stats = {**stats, "next_loss": ahead_loss, "next_zscore": ahead["zscore"]}
        if stats is None:
            self.record(loss)
        return stats


def confirmed_spikes(losses: Sequence[float], detector: SpikeDetector, confirm: bool = True) -> list[int]:
    """0-based indices where `detector` acts on a recorded loss sequence, confirming with the next
    recorded loss when `confirm` (the loss of step t+1 is the loss of the model updated at step t
    on the next batch: what the trainer's look-ahead computes)."""
    out = []
    for i, loss in enumerate(losses[:-1] if confirm else losses):
        nxt = (lambda i=i: losses[i + 1]) if confirm else None
        if detector.check(loss, nxt) is not None:
            out.append(i)
    return out


class StepWatchdog:
    """A daemon thread: a step running longer than `timeout_s` dumps every thread's stack to stderr
    and ends the process with exit code 3 (`os._exit`: no cleanup can hang), so the scheduler
    restarts the job, which resumes from its last checkpoint."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[int, float], None] | None = None):
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout or self._exit
        self._lock = threading.Lock()
        self._step, self._since = None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zaya-step-watchdog", daemon=True)
        self._thread.start()

    def start(self, step: int) -> None:
        with self._lock:
            self._step, self._since = step, time.monotonic()

    def stop(self) -> None:
        with self._lock:
            self._step, self._since = None, None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        period = min(max(self.timeout_s / 10, 0.05), 1.0)
        while not self._stop.wait(period):
            with self._lock:
                step, since = self._step, self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._on_timeout(step, time.monotonic() - since)
                self.stop()

    @staticmethod
    def _exit(step: int, elapsed: float) -> None:
        sys.stderr.write(
            f"\nWATCHDOG: step {step} has run {elapsed:.1f}s > fault.step_timeout_s; "
            "thread stacks follow, then exit 3\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)


class StopSignals:
    """SIGTERM / SIGINT set a flag (`signum`); the trainer saves at the next step boundary and exits
    128 + signum.

    With `startup_message` (the CLI installs one first thing: `install_stop_signals`) a signal
    that arrives before `training()` is called ends the process at once, from a thread reading
    the signal module's wakeup fd: the `on_exit` cleanups run (the workdir lock), one line
    `interrupted by SIGINT: <startup_message>` goes to stderr, exit 128 + signum through os._exit.
    The main thread may be inside XLA's compiler then, where no Python handler runs until the
    compile ends, and an interpreter shutdown from there crashed in jax's threads."""

    def __init__(self, startup_message: str | None = None):
        self.signum: int | None = None
        self._previous = {}
        self._training = startup_message is None
        # the terminal's stderr now: the dry run points fd 2 at a file while XLA compiles
        self._stderr = os.dup(2) if startup_message is not None else 2
        self._message = startup_message
        self._cleanups: list[Callable[[], None]] = []
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        if startup_message is not None:
            self._reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._writer = writer  # kept open for as long as the process runs
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            threading.Thread(target=self._watch, name="zaya-stop-signals", daemon=True).start()

    def _handle(self, signum, frame):
        del frame
        self.signum = signum

    def _watch(self) -> None:
        while True:
            data = self._reader.recv(64)
            if not data:
                return
            for signum in data:
                if signum in (signal.SIGINT, signal.SIGTERM) and not self._training:
                    self._exit_now(signum)

    def _exit_now(self, signum: int) -> None:
        for fn in self._cleanups:
            with contextlib.suppress(Exception):  # exiting anyway
                fn()
        os.write(self._stderr, f"interrupted by {signal.Signals(signum).name}: {self._message}\n".encode())
        os._exit(128 + signum)

    def on_exit(self, fn: Callable[[], None]) -> None:
        """`fn()` runs before a start-up signal ends the process."""
        self._cleanups.append(fn)

    def training(self) -> None:
        """From now on a signal only sets the flag (the trainer saves and stops)."""
        self._training = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_INSTALLED: StopSignals | None = None


def install_stop_signals(startup_message: str) -> StopSignals:
    """The process's stop signals, installed by a CLI before it builds anything (StopSignals)."""
    global _INSTALLED
    _INSTALLED = StopSignals(startup_message)
    return _INSTALLED


def installed_stop_signals() -> StopSignals | None:
    return _INSTALLED


class StepJudge:
    """The verdict on one finished step, in step order: a skipped (non-finite) update counts toward
    `max_bad_steps` consecutive ones; an accepted one goes to the spike detector. Returns the reason
    to roll back, or None; `event(step, kind, **details)` records what it saw."""

    def __init__(self, spikes: SpikeDetector, max_bad_steps: int, event: Callable[..., None]):
        self.spikes, self.max_bad_steps, self._event = spikes, max_bad_steps, event
        self.bad_steps = 0
        self.skipped_updates = 0

    def __call__(
        self, step: int, loss: float, skipped: bool, next_loss: Callable[[], float] | None
    ) -> str | None:
        if skipped:
            self.bad_steps += 1
            self.skipped_updates += 1
            self._event(step, "skipped_update", loss=loss, consecutive=self.bad_steps)
            if self.max_bad_steps and self.bad_steps >= self.max_bad_steps:
                return f"{self.bad_steps} consecutive non-finite steps"
            return None
        self.bad_steps = 0
        spike = self.spikes.check(loss, next_loss)
        if spike is None:
            return None
        self._event(step, "spike", loss=loss, **spike, window=list(self.spikes.history))
        return f"loss spike {loss:.4f} (z={spike['zscore']:.1f}, +{spike['jump']:.0%})"

    def rolled_back(self) -> None:
        self.bad_steps = 0


def poison(batch: dict[str, np.ndarray], kind: str, vocab_size: int) -> dict[str, np.ndarray]:
    """Test hooks (fault.inject_*_at_steps): a NaN loss (loss_mask * NaN), or a large finite one
    (every target the unused last id)."""
    batch = dict(batch)
    if kind == "nan":
        batch["loss_mask"] = np.asarray(batch["loss_mask"]) * np.float32("nan")
    else:
        batch["targets"] = np.full_like(np.asarray(batch["targets"]), vocab_size - 1)
    return batch


AGREE_TIMEOUT_MS = 3_600_000  # a process waits this long for the others to reach the step boundary


def agree(flags_: list[bool], round_: int) -> list[bool]:
    """Every process takes the same decision: the OR over processes of each flag (a no-op with one
    process). `round_` numbers the calls (the same sequence on every process).

    The exchange goes through the coordination service's key-value store on the hosts, not a device
    collective: at a step boundary the step just dispatched is still running, and where the runtime
    runs two executables at once (XLA:CPU does) a device all-gather can pair with that step's
    collectives on another process (seen: "distributed collective mismatch", an abort)."""
    import jax  # deferred: the rest of this module needs no accelerator runtime

    if jax.process_count() == 1:
        return flags_
    from jax._src import distributed  # the client jax.distributed.initialize connected

    client = distributed.global_state.client
    me, n = jax.process_index(), jax.process_count()
    key = lambda r, p: f"zaya_jax/agree/{r}/{p}"
    client.key_value_set(key(round_, me), "".join("1" if f else "0" for f in flags_))
    got = [client.blocking_key_value_get(key(round_, p), AGREE_TIMEOUT_MS) for p in range(n)]
    if round_ > 0:  # every process has set round_, so all have read round_ - 1: drop ours
        client.key_value_delete(key(round_ - 1, me))
    return [any(g[i] == "1" for g in got) for i in range(len(flags_))]


def share_from_first(name: str, text: str) -> str:
    """Process 0's `text` on every process (the coordination service's key-value store, as
    `agree`); `text` itself with one process. `name` is used once per run."""
    import jax  # deferred: the rest of this module needs no accelerator runtime

    if jax.process_count() == 1:
        return text
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"zaya_jax/share/{name}"
    if jax.process_index() == 0:
        client.key_value_set(key, "=" + text)  # never empty
        return text
    return client.blocking_key_value_get(key, AGREE_TIMEOUT_MS)[1:]


class Do(enum.Enum):
    """What the training loop does after a step's verdict."""

    CONTINUE = "continue"
    ROLL_BACK = "roll_back"  # to the last checkpoint before `step`, skipping the batches since


@dataclasses.dataclass(frozen=True)
class Action:
    """after_step's answer; a stop is decided at the step boundary (`FaultMonitor.boundary`)."""

    do: Do
    step: int
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The decisions every process takes together at a step boundary."""

    stop: bool  # a stop signal arrived (on any process)
    save: bool  # the checkpoint schedule is due (on any process)


class FaultMonitor:
    """All fault handling of one run, from its `config.fault` section.

    poison(step, batch)       the test hook of that step applied (fault.inject_*_at_steps)
    after_step(step, ...)     the verdict on a finished step, in step order -> Action
    boundary(step, save_due)  stop / save, agreed over processes
    watch(step, known)        arms the watchdog for a step (not for one that compiles)
    rolled_back(), close()
    `event(step, kind, **details)` records what it saw (events.jsonl).
    """

    def __init__(self, f: Any, event: Callable[..., None], vocab_size: int, stop: StopSignals | None = None):
        self._event, self._vocab_size = event, vocab_size
        self._inject = {
            **{s: "spike" for s in f.inject_spike_at_steps},
            **{s: "nan" for s in f.inject_nan_at_steps},
        }
        self._confirm = bool(f.spike_confirm)
        self.judge = StepJudge(
            SpikeDetector(f.spike_zscore, f.spike_window, f.spike_min_jump), f.max_bad_steps, event
        )
        self._timeout_s = f.step_timeout_s
        self.watchdog = StepWatchdog(f.step_timeout_s, on_timeout=self._on_hang) if f.step_timeout_s else None
        self._owns_stop = stop is None  # a CLI's installed signals outlive the monitor
        self.stop = StopSignals() if stop is None else stop
        self._rounds = 0  # agree() calls so far

    def poison(self, step: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if step in self._inject:
            return poison(batch, self._inject[step], self._vocab_size)
        return batch

    def after_step(
        self, step: int, loss: float, skipped: bool, next_loss: Callable[[], float] | None = None
    ) -> Action:
        """Step `step`'s verdict from its loss and skip flag: ROLL_BACK (with the reason) on
        `max_bad_steps` consecutive skipped updates or a spike, which `next_loss()` (the updated
        model's loss on the next batch, asked for only for an anomalous loss) confirms when
        fault.spike_confirm; else CONTINUE."""
        self._inject.pop(step, None)  # a test hook fires once, on a step that was judged
        reason = self.judge(step, loss, skipped, next_loss if self._confirm else None)
        return Action(Do.CONTINUE if reason is None else Do.ROLL_BACK, step, reason)

    def boundary(self, step: int, save_due: bool) -> Boundary:
        stop, save = agree([self.stop.signum is not None, save_due], self._rounds)
        self._rounds += 1
        return Boundary(stop=stop, save=save)

    def watch(self, step: int, known_program: bool) -> None:
        """A step at a batch size not seen yet compiles its program (one per size): not a hang."""
        if self.watchdog is None:
            return
        if known_program:
            self.watchdog.start(step)
        else:
            self.watchdog.stop()

    def unwatch(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def rolled_back(self) -> None:
        self.judge.rolled_back()

    @property
    def skipped_updates(self) -> int:
        return self.judge.skipped_updates

    def close(self) -> None:
        if self._owns_stop:
            self.stop.restore()
        if self.watchdog is not None:
            self.watchdog.close()

    def _on_hang(self, step: int, elapsed: float) -> None:
        self._event(step, "watchdog", elapsed_s=elapsed, timeout_s=self._timeout_s)
        StepWatchdog._exit(step, elapsed)
