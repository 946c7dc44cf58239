"""`python -m zaya_jax.train` as a user starts, stops and resumes it: the start-up lines, one run
per workdir (a second trainer, reshard into it), Ctrl-C / SIGTERM during start-up and mid-run, and
the resume checks (nothing to do, another learning-rate plan, other data)."""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
from support.cli_runs import assert_one_line_error, prepare_text, run_cli, tree_digest
from support.configs import load
from support.train_runs import ROOT, SMALL, run_train, summary_of, train_cmd, train_losses
from support.workdir_locks import dead_pid, own_lock, write_lock
from support.xla_env import xla_flags

from zaya_jax import config as config_lib
from zaya_jax.runtime import workdir_lock as wl

TINY = os.path.join(ROOT, "configs", "tiny.py")


class Background:
    """A trainer started in the background; its output lines are read as they come."""

    def __init__(self, workdir, *extra, env=None):
        env = {**os.environ, "XLA_FLAGS": xla_flags(1), **(env or {})}
        self.proc = subprocess.Popen(
            train_cmd(workdir, *extra),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines, self.out, self.err = queue.Queue(), [], []
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream, is_out):
        for line in stream:
            (self.lines.put if is_out else self.err.append)(line.rstrip("\n"))
        if is_out:
            self.lines.put(None)

    def wait_for(self, text, timeout=400):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.out.append(line)
            if text in line:
                return line
        self.proc.kill()
        raise AssertionError(f"no {text!r} in the output: {self.out[-20:]} {self.err[-20:]}")

    def stop(self, sig, timeout=300):
        """Sends `sig`; (exit code, seconds until it ended, stdout lines, stderr text)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        seconds = time.monotonic() - t0
        time.sleep(0.2)  # the reader threads drain the pipes
        while True:
            line = self.lines.get()
            if line is None:
                break
            self.out.append(line)
        return rc, seconds, self.out, "\n".join(self.err)


def _saved_steps(workdir):
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(s) for s in os.listdir(d) if s.isdigit()) if os.path.isdir(d) else []


# The plan of the interrupted trainers below (50 steps).
INTERRUPTED = "--config.train.steps=50"


@pytest.fixture(scope="module")
def start_cache(tmp_path_factory):
    """A compilation cache of this file's own: empty when the start-up signals test starts it (its
    compiles run), then read by the mid-run Ctrl-C test, whose plan is the same."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("start_xla_cache"))}


@pytest.mark.slow
def test_second_trainer_is_refused_and_a_signal_during_start_up_stops_at_once(tmp_path, start_cache):
    w = tmp_path / "w"
    env = start_cache  # a fresh cache: compiles run
    assert not os.listdir(env["JAX_COMPILATION_CACHE_DIR"])
    a = Background(w, INTERRUPTED, env=env)
    start = a.wait_for("train: ")
    assert str(w) in start and "cpu device" in start
    a.wait_for("initialising a new model")  # the initializer compiles now
    holder = json.loads((w / wl.LOCK_FILE).read_text())
    assert holder["pid"] == a.proc.pid
    # the first trainer stopped (alive, holding the lock) while the second runs: what changes in
    # the workdir meanwhile is the second's doing, and the first is still starting up after it
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        before = tree_digest(w)
        # forked from a process that imported the CLIs (tests/support/cli_fork.py), as the other refused
        # runs of this file: a process of its own, refused by the lock
        second = _train(w, INTERRUPTED)
        assert tree_digest(w) == before
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    assert_one_line_error(second, str(w), f"pid {a.proc.pid}", f"host {socket.gethostname()}", "since")

    rc, seconds, _, err = a.stop(signal.SIGINT)
    print(f"SIGINT while compiling the initializer: exit {rc} after {seconds:.2f} s; {err!r}")
    assert rc == 130 and seconds < 10, (rc, seconds, err)
    assert err.strip() == "interrupted by SIGINT: before the first step; nothing saved"
    assert not (w / wl.LOCK_FILE).exists() and _saved_steps(w) == []

    a = Background(w, INTERRUPTED, env=env)
    a.wait_for("compiling the train step")
    rc, seconds, _, err = a.stop(signal.SIGTERM)
    print(f"SIGTERM while compiling the train step: exit {rc} after {seconds:.2f} s; {err!r}")
    assert rc == 143 and seconds < 10, (rc, seconds, err)
    assert err.strip() == "interrupted by SIGTERM: before the first step; nothing saved"
    assert not (w / wl.LOCK_FILE).exists() and _saved_steps(w) == []


@pytest.mark.slow
def test_ctrl_c_mid_run_saves_and_exits_130(tmp_path, start_cache):
    w = tmp_path / "w"
    # the plan of the start-up test, whose trainers left its compiled programs in start_cache
    ckpt_eval = ["--config.checkpoint.every_steps=0", "--config.eval.every_steps=0"]
    a = Background(w, INTERRUPTED, *ckpt_eval, env=start_cache)
    a.wait_for("step 2/50")
    rc, _, out, err = a.stop(signal.SIGINT)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "Fatal" not in err
    (saved,) = _saved_steps(w)
    assert f"interrupted by SIGINT: saved step {saved}" in "\n".join(out)
    assert json.loads(out[-1])["summary"]["stopped_by_signal"] == signal.SIGINT
    assert not (w / wl.LOCK_FILE).exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run (checkpoint 3), copied by each test."""
    w = tmp_path_factory.mktemp("start") / "run"
    run_train(w, "--config.train.steps=3")
    return w


def _copy(finished, tmp_path):
    dst = tmp_path / "w"
    shutil.copytree(finished, dst)
    return dst


def _train(workdir, *extra):
    return run_cli("train", "--config", TINY, "--workdir", workdir, *SMALL, *extra)


@pytest.mark.slow
def test_resume_says_what_it_does_and_refuses_another_plan_or_data(finished, tmp_path):
    w = _copy(finished, tmp_path)
    # a lock left by a killed run (its pid is gone) does not block the next run
    write_lock(w, host=socket.gethostname(), pid=dead_pid(), pid_start=None, boot_id=wl.boot_id())
    done = _train(w, "--config.train.steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("removed a stale lock of train (pid ") for line in lines), lines
    assert f"resumed from step 3 ({w}/checkpoints/3)" in lines
    assert "already at step 3 of 3; nothing to do" in lines
    assert summary_of(done)["final_step"] == 3 and not (w / wl.LOCK_FILE).exists()

    before = tree_digest(w)
    # the plan of `replanned` below: the refused run compiles (start-up's memory check) what that
    # one then reads from the cache
    more = _train(w, "--config.train.steps=6")
    assert_one_line_error(
        more,
        "train.steps: checkpoint 3, config 6",
        "--config.train.steps=3",
        "--config.train.allow_schedule_change=True",
    )
    data = prepare_text(tmp_path)
    other = _train(w, "--config.train.steps=4", f"--config.data.path={data}")
    assert_one_line_error(other, f"config.data.path='{data}'", "--config.data.allow_path_change=True")
    assert tree_digest(w) == before

    # another command writing into the workdir while a run holds it
    own_lock(w)
    reshard = run_cli("reshard", "--src", w, "--dst", w, "--config.mesh.data=1")
    assert_one_line_error(reshard, str(w), f"pid {os.getpid()}")
    os.remove(w / wl.LOCK_FILE)
    assert tree_digest(w) == before

    # 3 -> 4 steps leaves the last step's lr at 0 (nothing re-planned); 4 -> 6 warms up again
    same = _train(w, "--config.train.steps=4")
    assert same.returncode == 0, same.stderr[-3000:]
    assert "re-planned" not in same.stdout
    replanned = _train(w, "--config.train.steps=6", "--config.train.allow_schedule_change=True")
    assert replanned.returncode == 0, replanned.stderr[-3000:]
    assert any(
        line.startswith("re-planned the learning-rate schedule (train.steps: checkpoint 4, config 6")
        for line in replanned.stdout.splitlines()
    ), replanned.stdout
    assert sorted(train_losses(w)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_init_from_says_where_it_read(finished, tmp_path):
    w = tmp_path / "phase2"
    proc = _train(w, "--config.train.steps=3", f"--config.train.init_from={finished}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"initialised from {finished}/checkpoints/3 (params and balancing biases; step 0)" in proc.stdout
    assert "compiling the train step..." in proc.stdout


def test_a_short_run_of_tiny_names_the_warmup_fix(tmp_path):
    """`make train ARGS="--config.train.steps=20"`: tiny warms up for 50 steps."""
    proc = run_cli("train", "--config", TINY, "--workdir", tmp_path / "w", "--config.train.steps=20")
    line = assert_one_line_error(proc, "config.optim.warmup_steps", "--config.optim.warmup_steps=2")
    assert not (tmp_path / "w").exists(), line
    # the named fix is a valid config
    c = load("tiny")
    c.train.steps, c.optim.warmup_steps = 20, 2
    config_lib.validate(c)


def test_config_keys_of_the_overrides_are_validated():
    c = config_lib.base_config()
    c.train.allow_schedule_change = None
    with pytest.raises(ValueError, match="train.allow_schedule_change"):
        config_lib.validate(c)
    c = config_lib.base_config()
    c.data.allow_path_change = None
    with pytest.raises(ValueError, match="data.allow_path_change"):
        config_lib.validate(c)
