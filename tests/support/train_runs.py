"""`python -m zaya_jax.train` on the small tiny config, as the CLI tests run it, and what such a
run leaves: its train losses and its summary line."""

import json
import os
import subprocess
import sys

from support import cli_fork
from support.xla_env import xla_flags
from zaya_jax.training.metrics import read_metrics

# the repository root: the CLI runs start there
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = [
    "--config.model.hidden_size=64",
    "--config.model.num_hidden_layers=2",
    "--config.model.num_experts=4",
    "--config.model.moe_intermediate_size=64",
    "--config.train.batch_size=8",
    "--config.train.seq_len=32",
    "--config.optim.warmup_steps=2",
    "--config.eval.every_steps=3",
    "--config.eval.batches=2",
    "--config.eval.batch_size=8",
    "--config.checkpoint.every_steps=3",
    "--config.logging.every_steps=1",
    "--config.logging.tensorboard=False",
]


def train_cmd(workdir, *extra) -> list[str]:
    """`python -m zaya_jax.train` of the small tiny config into `workdir`, then `extra` flags."""
    tiny = os.path.join(ROOT, "configs/tiny.py")
    return [
        sys.executable,
        "-m",
        "zaya_jax.train",
        "--config",
        tiny,
        "--workdir",
        str(workdir),
        *SMALL,
        *extra,
    ]


def run_train(workdir, *extra, check=True, devices=1, env=None, fresh=False):
    """Runs the CLI on `devices` simulated CPU devices (the default mesh takes them all): forked from
    a process that imported the CLIs (tests/support/cli_fork.py), or `fresh`, a new Python process (a run
    whose start-up is checked)."""
    cmd = train_cmd(workdir, *extra)
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), **(env or {})}
    if fresh:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    else:
        proc = cli_fork.shared(env).run("train", *cmd[3:], env=env, cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def train_losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(str(workdir), split="train")}


def summary_of(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
