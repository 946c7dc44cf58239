"""A training run killed with SIGKILL once a step is logged and a checkpoint committed, and the
checkpoints it leaves: the latest step, its saved state, a corrupted copy."""

import glob
import os
import subprocess
import time

import orbax.checkpoint as ocp

from support.train_runs import ROOT
from support.xla_env import xla_flags
from zaya_jax.training.checkpoint import Checkpointer
from zaya_jax.training.metrics import read_metrics


def corrupt_state(workdir, step):
    """Truncates every array data file of the checkpoint's `state` item."""
    files = [
        f
        for f in glob.glob(
            os.path.join(workdir, "checkpoints", str(step), "state", "**", "d", "*"), recursive=True
        )
        if os.path.isfile(f)
    ]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(max(os.path.getsize(f) // 3, 1))


def final_params(workdir):
    """(latest step, its saved TrainState as a pytree of arrays), read without a target structure."""
    ck = Checkpointer(str(workdir), read_only=True)
    step = ck.latest_step()
    state = ck._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    ck.close()
    return step, state


def wait_for_step(proc, workdir, step, timeout=300):
    """Waits until the run `proc` writing into `workdir` has logged `step`; fails if it ends first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if any(r["step"] >= step for r in read_metrics(str(workdir), split="train")):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError("timed out")


def kill_9_after_step(cmd, workdir, step, devices: int = 1) -> int | None:
    """Runs `cmd` (a training command into `workdir`) on `devices` simulated CPU devices, kills it
    with SIGKILL once `step` is logged and a checkpoint is committed, and returns the latest
    checkpoint step it left."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, workdir, step)
    _wait_for_a_checkpoint(proc, workdir)
    proc.kill()
    proc.wait()
    return latest_checkpoint(workdir)


def latest_checkpoint(workdir) -> int | None:
    """The newest committed checkpoint step of `workdir`, None if there is none."""
    ck = Checkpointer(str(workdir), read_only=True)
    try:
        return ck.latest_step()
    finally:
        ck.close()


def _wait_for_a_checkpoint(proc, workdir, timeout=120):
    """Waits until a checkpoint is committed: saves are asynchronous, and on a loaded machine the
    first one can still be in flight when `step` is logged (a kill then leaves nothing to resume)."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if os.path.isdir(os.path.join(workdir, "checkpoints")) and latest_checkpoint(workdir) is not None:
            return
        time.sleep(0.2)
