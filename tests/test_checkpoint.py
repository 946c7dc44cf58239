"""Checkpoints: retention, time-based saves, corrupted checkpoints, exact resume after kill -9,
SIGTERM, the step watchdog, NaN / spike handling (events.jsonl)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import corrupt_state, final_params, kill_9_after_step, wait_for_step
from support.configs import tiny_config
from support.train_runs import ROOT, SMALL, run_train, train_cmd, train_losses
from support.xla_env import xla_flags

from zaya_jax.training.checkpoint import Checkpointer, CheckpointError, abstract_like, checkpoint_workdir
from zaya_jax.training.events import EventLog, read_events
from zaya_jax.training.fault import StepWatchdog


def _state(step):
    return {"w": jnp.arange(64, dtype=jnp.float32) * step, "b": jnp.full((4, 4), float(step))}


def _save_steps(workdir, steps, **kw):
    ck = Checkpointer(str(workdir), **kw)
    for s in steps:
        ck.save(s, _state(s), {"pos": s}, {"seed": 0})
    ck.wait()
    return ck


def test_replicated_arrays_are_sliced_per_replica_only_when_large(tmp_path, caplog):
    """On 8 devices a replicated array whose per-replica slice is under MIN_REPLICA_SLICE_BYTES is
    saved whole by one replica: the save compiles no per-device slice program. A larger one is still
    written in 8 slices (one `slice` program per device). Both restore to the saved values."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from zaya_jax.parallel import make_mesh
    from zaya_jax.training.checkpoint import MIN_REPLICA_SLICE_BYTES

    replicated = NamedSharding(make_mesh(data=8), P())
    small = jax.device_put(jnp.arange(8 * 1024, dtype=jnp.float32), replicated)  # 4 KiB a replica
    large = jax.device_put(jnp.ones((8, MIN_REPLICA_SLICE_BYTES // 4), jnp.float32), replicated)
    slices = {}
    for name, state in (("small", {"w": small}), ("large", {"w": large * 2.0})):
        caplog.clear()
        with jax.log_compiles(), caplog.at_level("WARNING"):
            ck = Checkpointer(str(tmp_path / name))
            ck.save(1, state, {}, {})
            ck.wait()
        slices[name] = sum("Compiling jit(slice)" in r.getMessage() for r in caplog.records)
        restored, _, _ = ck.restore(1, abstract_like(state))
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
        ck.close()
    assert slices == {"small": 0, "large": 8}, slices


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, capsys):
    ck = _save_steps(tmp_path, [1, 2, 3])
    corrupt_state(tmp_path, 3)
    seen = []
    step, state, data, config = ck.restore_latest(
        abstract_like(_state(0)), on_corrupt=lambda s, m: seen.append(s)
    )
    assert step == 2 and data == {"pos": 2} and config == {"seed": 0}
    np.testing.assert_array_equal(state["w"], _state(2)["w"])
    assert seen == [3]
    assert "WARNING: checkpoint" in capsys.readouterr().out
    # The unreadable one is moved aside, so the run can save step 3 again.
    assert ck.all_steps() == [1, 2] and os.listdir(tmp_path / "checkpoints.corrupt")
    ck.save(3, _state(3), {"pos": 3}, {"seed": 0})
    ck.wait()
    assert ck.restore_latest(abstract_like(_state(0)))[0] == 3
    ck.close()


def test_all_checkpoints_corrupt_is_a_clear_error(tmp_path):
    ck = _save_steps(tmp_path, [1, 2])
    for s in (1, 2):
        corrupt_state(tmp_path, s)
    with pytest.raises(CheckpointError, match="no readable checkpoint in .*checkpoints"):
        ck.restore_latest(abstract_like(_state(0)))
    ck.close()
    empty = Checkpointer(str(tmp_path / "empty"))
    assert empty.restore_latest(abstract_like(_state(0))) is None
    empty.close()  # an unclosed manager is collected in a later test: "Event loop is closed"


def test_retention_keep_and_keep_period(tmp_path):
    ck = _save_steps(tmp_path, range(1, 11), keep=2, keep_period=4)
    assert ck.all_steps() == [4, 8, 9, 10]
    ck.close()


def test_time_based_saves():
    ck = Checkpointer.__new__(Checkpointer)
    ck.every_steps, ck.every_minutes, ck._last_save_time = 0, 0.5, 100.0
    assert not ck.due(7, now=120.0) and ck.due(7, now=131.0)
    ck.every_steps = 5
    assert ck.due(10, now=101.0)
    ck.every_minutes = 0
    assert not ck.due(7, now=1e9)


def test_checkpoint_workdir():
    assert checkpoint_workdir("/a/run") == ("/a/run", None)
    assert checkpoint_workdir("/a/run/checkpoints/") == ("/a/run", None)
    assert checkpoint_workdir("/a/run/checkpoints/12") == ("/a/run", 12)


def test_events(tmp_path):
    log = EventLog(str(tmp_path))
    log.write(3, "spike", loss=float("nan"))
    (e,) = read_events(str(tmp_path))
    assert e["step"] == 3 and e["kind"] == "spike" and np.isnan(e["details"]["loss"])


def test_watchdog_fires_only_on_a_slow_step():
    fired = []
    wd = StepWatchdog(0.2, on_timeout=lambda step, elapsed: fired.append((step, elapsed)))
    wd.start(1)
    time.sleep(0.05)
    wd.stop()
    time.sleep(0.3)
    assert not fired
    wd.start(2)
    time.sleep(0.6)
    wd.close()
    assert fired and fired[0][0] == 2 and fired[0][1] > 0.2


def test_watchdog_dumps_stacks_and_exits_3(tmp_path):
    code = (
        "import time; from zaya_jax.training.fault import StepWatchdog\n"
        "wd = StepWatchdog(0.3); wd.start(7); time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 3
    assert "WATCHDOG: step 7" in proc.stderr and "Thread" in proc.stderr


# One plan for the fault tests' runs (fault.inject_* poisons batches on the host, the program is
# the same): the first run compiles the train and eval steps, the others read them from the cache.
FAULT_STEPS = 12
FAULT_ARGS = [f"--config.train.steps={FAULT_STEPS}", "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0"]


def _cmd(workdir, *extra):
    return train_cmd(workdir, *FAULT_ARGS, *extra)


def _env():
    return {**os.environ, "XLA_FLAGS": xla_flags(1)}


@pytest.mark.slow
def test_kill_9_and_restart_matches_an_uninterrupted_run(tmp_path):
    ref = tmp_path / "ref"
    killed = tmp_path / "killed"
    resumed_from = kill_9_after_step(_cmd(killed, "--config.fault.spike_zscore=0"), killed, 5)
    assert resumed_from is not None and resumed_from < FAULT_STEPS
    # the restart and the uninterrupted run: both read the killed run's programs from the cache
    run_train(killed, *FAULT_ARGS)
    run_train(ref, *FAULT_ARGS)
    resume = [e for e in read_events(str(killed), "resume")]
    assert resume and resume[-1]["step"] == resumed_from
    ref_losses, got = train_losses(ref), train_losses(killed)
    assert sorted(got) == list(range(1, FAULT_STEPS + 1))
    for s in range(resumed_from + 1, FAULT_STEPS + 1):
        assert got[s] == ref_losses[s], (s, got[s], ref_losses[s])
    (sa, a), (sb, b) = final_params(ref), final_params(killed)
    assert sa == sb == FAULT_STEPS
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_143(tmp_path):
    w = tmp_path / "w"
    proc = subprocess.Popen(
        _cmd(w, "--config.train.steps=200", "--config.checkpoint.every_steps=0"),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(proc, w, 3)
    proc.send_signal(signal.SIGTERM)
    sent_at = max(train_losses(w))
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    (ev,) = read_events(str(w), "sigterm")
    assert sent_at <= ev["step"] <= sent_at + 2  # the step in flight (+ the one the signal raced)
    ck = Checkpointer(str(w), read_only=True)
    assert ck.latest_step() == ev["step"]
    ck.close()
    # a shorter plan than the checkpoint's: FAULT_ARGS' (at least 2 steps more than saved)
    end = max(FAULT_STEPS, ev["step"] + 2)
    proc = run_train(
        w,
        *FAULT_ARGS,
        "--config.checkpoint.every_steps=0",
        f"--config.train.steps={end}",
        "--config.train.allow_schedule_change=True",
    )
    assert read_events(str(w), "resume")[-1]["step"] == ev["step"]
    assert sorted(train_losses(w)) == list(range(1, end + 1))


@pytest.mark.slow
def test_nan_is_skipped_and_a_spike_rolls_back(tmp_path):
    w = tmp_path / "w"
    proc = run_train(
        w,
        *FAULT_ARGS,
        "--config.train.steps=12",
        "--config.fault.inject_nan_at_steps=(3,)",
        "--config.fault.inject_spike_at_steps=(9,)",
        "--config.fault.spike_window=4",
        "--config.fault.spike_zscore=3.0",
        # one poisoned batch does not damage the model (Muon's update is bounded): only the
        # unconfirmed detector acts on it; tests/test_fault.py rolls back a confirmed one
        "--config.fault.spike_confirm=False",
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert summary["final_step"] == 12 and summary["rollbacks"] == 1 and summary["skipped_updates"] == 1
    (skip,) = read_events(str(w), "skipped_update")
    assert skip["step"] == 3 and np.isnan(skip["details"]["loss"])
    (spike,) = read_events(str(w), "spike")
    (rb,) = read_events(str(w), "rollback")
    assert spike["step"] == rb["step"] == 9
    assert rb["details"]["to_step"] == 8 and rb["details"]["skipped_batches"] == [9]
    losses = train_losses(w)
    assert sorted(losses) == list(range(1, 13)) and np.isnan(losses[3])
    assert all(np.isfinite(losses[s]) and losses[s] < losses[2] for s in range(9, 13))


def _device_bytes(arrays):
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards)


@pytest.mark.slow
def test_resume_holds_one_train_state(tmp_path, monkeypatch):
    """A resume restores straight into abstract sharded arrays: while it restores, the process holds
    one train state, not a fresh one plus the restored one (8 devices, ZeRO-1 sharding)."""
    import gc

    from zaya_jax import train as train_lib

    c = tiny_config(*SMALL, *FAULT_ARGS)
    c.train.steps = 3
    w = str(tmp_path / "w")
    train_lib.train(c, w)

    seen = {}
    original = Checkpointer.restore

    def measured(self, step, abstract_state):
        gc.collect()
        seen["before"] = _device_bytes(jax.live_arrays())
        out = original(self, step, abstract_state)
        seen["after"] = _device_bytes(jax.live_arrays())
        seen["state"] = _device_bytes(jax.tree.leaves(out[0]))
        return out

    monkeypatch.setattr(Checkpointer, "restore", measured)
    gc.collect()
    baseline = _device_bytes(jax.live_arrays())
    c.train.steps, c.train.allow_schedule_change = 4, True
    summary = train_lib.train(c, w)
    assert summary["start_step"] == 3 and summary["final_step"] == 4
    print(
        f"resume: live device bytes {baseline} before train(), {seen['before']} entering the restore, "
        f"{seen['after']} after it; one train state = {seen['state']} bytes"
    )
    assert seen["before"] - baseline < 0.05 * seen["state"]  # no fresh state built first
    assert seen["after"] - baseline < 1.05 * seen["state"]
