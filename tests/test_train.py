"""`python -m zaya_jax.train` end to end (subprocesses, as a user runs it)."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from support import cli_fork
from support.configs import tiny_config
from support.eval_models import write_harness_tasks, write_task
from support.train_runs import SMALL, run_train, summary_of, train_losses
from support.xla_env import xla_flags

from zaya_jax.evaluate import evaluate
from zaya_jax.export import export
from zaya_jax.runtime import host_memory
from zaya_jax.training.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
    a = tmp_path / "a"
    # as a user starts it, without the tunable (the trainer re-executes itself with it) and with
    # XLA_FLAGS silent on the fusion emitters (the trainer turns them off: train.lean_cpu_compile)
    user_env = {"GLIBC_TUNABLES": "", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    first = summary_of(run_train(a, "--config.train.steps=6", env=user_env, fresh=True))
    assert first["host_memory"] == ("huge_pages" if host_memory.huge_pages_possible() else "reuse")
    assert first["lean_cpu_compile"] is True
    assert first["keep_step_buffers"] is (first["host_memory"] == "huge_pages")
    records = read_metrics(str(a))
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(
        {"loss", "grad_norm", "lr", "tokens_per_second", "expert_load_max_over_mean"} <= set(r) for r in train
    )
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_loss"] > 0 for r in evals)
    assert sorted(os.listdir(a / "checkpoints")) >= ["3", "6"]

    # An existing workdir resumes from its latest checkpoint and continues the step count (a new
    # plan of 8 steps: allowed explicitly).
    # XLA_FLAGS turns the fusion emitters on (a user's value stands).
    on = {"XLA_FLAGS": xla_flags(1, fast=False)}
    out = run_train(a, "--config.train.steps=8", "--config.train.allow_schedule_change=True", env=on)
    summary = summary_of(out)
    assert summary["start_step"] == 6 and summary["final_step"] == 8
    assert summary["lean_cpu_compile"] is False
    assert sorted(train_losses(a)) == list(range(1, 9))


@pytest.mark.slow
def test_train_on_prepared_text_file(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text(
        "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(300))
    )
    data = tmp_path / "data"
    args = ["--input", text, "--out", data, "--doc-separator", "blank-line", "--eval-fraction", "0.05"]
    env = dict(os.environ)
    prepared = cli_fork.shared(env).run("data.prepare", *args, env=env, cwd=ROOT)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    task = write_task(str(tmp_path / "task.jsonl"))
    # 8 steps, one evaluation: at the last step
    run_train(
        tmp_path / "w",
        "--config.train.steps=8",
        "--config.eval.every_steps=0",
        f"--config.data.path={data}",
        f"--config.eval.tasks=('{task}', '{text}')",
        "--config.eval.task_limit=20",
    )
    assert sorted(train_losses(tmp_path / "w")) == list(range(1, 9))
    # downstream tasks at every evaluation, scored as the standalone evaluator scores the checkpoint
    last = [r for r in read_metrics(str(tmp_path / "w")) if r["split"] == "eval"][-1]
    assert last["step"] == 8
    standalone = evaluate(str(tmp_path / "w"), [task, str(text)], max_len=32, separator="none", limit=20)
    assert standalone["step"] == 8
    assert last["eval_task/acc"] == standalone["results"]["task"]["acc"]
    assert last["eval_task/acc_norm"] == standalone["results"]["task"]["acc_norm"]
    for key in ("bits_per_byte", "loss"):
        assert last[f"eval_mine/{key}"] == pytest.approx(standalone["results"]["mine"][key], rel=1e-5)


def test_bad_config_fails_with_a_clear_message(tmp_path):
    proc = run_train(tmp_path / "w", "--config.train.grad_accum=3", check=False)
    assert proc.returncode != 0
    assert "config.train.grad_accum: batch_size=8 is not divisible by grad_accum=3" in proc.stderr
    assert not (tmp_path / "w" / "checkpoints").exists()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(cmd, port, logs):
    """Runs `cmd` as 2 processes x 4 CPU devices (jax.distributed on localhost); returns their stdouts.
    Their output goes to files under `logs`: a pipe nobody reads until the other process ends would
    stall a process that writes much, and the other then times out in a collective. Without the
    persistent compilation cache: seen on this jaxlib, one process loading a program from the cache
    while the other compiled it made the first cross-process collective time out ("Gloo context
    initialization failed: DEADLINE_EXCEEDED")."""
    os.makedirs(logs, exist_ok=True)
    files = [(open(f"{logs}/out{i}", "w+"), open(f"{logs}/err{i}", "w+")) for i in range(2)]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=err,
            text=True,
            env={
                **os.environ,
                "XLA_FLAGS": xla_flags(4),
                "ZAYA_COORDINATOR": f"127.0.0.1:{port}",
                "ZAYA_NUM_PROCESSES": "2",
                "ZAYA_PROCESS_ID": str(i),
                "JAX_ENABLE_COMPILATION_CACHE": "false",
            },
        )
        for i, (out, err) in enumerate(files)
    ]
    outs = []
    for p, (out, err) in zip(procs, files):
        p.wait(timeout=600)
        out.seek(0)
        err.seek(0)
        outs.append((out.read(), err.read()))
        out.close()
        err.close()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outs]


@pytest.mark.slow
def test_two_processes_match_one_eight_device_process(tmp_path, monkeypatch):
    """2 processes x 4 CPU devices on a data=2 x expert=4 mesh train with the same losses, and score
    the same downstream task, as one process with 8 devices; every process runs the lm-eval tasks
    of eval.harness_tasks (scoring and generation) and logs the same numbers; `zaya_jax.evaluate`
    over 2 processes gives the same numbers from the exported HF directory."""
    task = write_task(str(tmp_path / "task.jsonl"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    harness = write_harness_tasks(tmp_path, ["The cat sat on the", "Once upon a time"], max_gen=8)
    mesh = [
        "--config.model.num_hidden_layers=1",  # what is compared does not depend on the depth
        "--config.mesh.data=2",
        "--config.mesh.expert=4",
        "--config.train.steps=4",
        "--config.eval.every_steps=0",
        "--config.checkpoint.every_steps=0",
        f"--config.eval.tasks=('{task}',)",
    ]
    single = tmp_path / "single"
    run_train(single, *mesh, devices=8)
    multi = tmp_path / "multi"
    cmd = [
        sys.executable,
        "-m",
        "zaya_jax.train",
        "--config",
        os.path.join(ROOT, "configs/tiny.py"),
        "--workdir",
        str(multi),
        *SMALL,
        *mesh,
        "--config.eval.harness_tasks=('zaya_mc', 'zaya_gen')",
        f"--config.eval.harness_include_path={harness}",
    ]
    outs = _two_processes(cmd, _free_port(), tmp_path / "logs_train")
    summaries = [json.loads(out.strip().splitlines()[-1])["summary"] for out in outs]
    assert all(s["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "context": 1} for s in summaries)
    ref = train_losses(single)
    got0, got1 = train_losses(multi), train_losses(multi / "process_1")
    assert sorted(ref) == sorted(got0) == sorted(got1) == [1, 2, 3, 4]
    for step in ref:
        assert abs(got0[step] - ref[step]) < 1e-5 and got0[step] == got1[step]
    evals = [[r for r in read_metrics(str(w)) if r["split"] == "eval"][-1] for w in (single, multi)]
    assert evals[0]["eval_task/acc"] == evals[1]["eval_task/acc"]
    assert evals[0]["eval_task/acc_norm"] == evals[1]["eval_task/acc_norm"]
    on_1 = [r for r in read_metrics(str(multi / "process_1")) if r["split"] == "eval"][-1]
    harness_keys = {
        "eval_harness/zaya_mc/acc",
        "eval_harness/zaya_mc/acc_norm",
        "eval_harness/zaya_gen/exact_match",
    }
    assert {k: evals[1][k] for k in harness_keys} == {k: on_1[k] for k in harness_keys}

    hf_dir = tmp_path / "hf"
    export(str(single), str(hf_dir), dtype="float32")
    results = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "zaya_jax.evaluate", "--checkpoint", str(hf_dir), "--data", task,
           "--mesh", "data=2,expert=4", "--max-len", "32", "--out", str(results), "--quiet",
           "--samples-out", str(tmp_path / "samples.jsonl")]  # fmt: skip
    _two_processes(cmd, _free_port(), tmp_path / "logs_evaluate")
    written = json.loads(results.read_text())
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    one_device = evaluate(str(hf_dir), [task], max_len=32)["samples"]["task"]
    for a, b in zip(samples, one_device, strict=True):
        assert abs(np.array(a["loglikelihoods"]) - b["loglikelihoods"]).max() < 1e-5
    assert written["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}
    assert written["results"]["task"]["acc"] == evals[0]["eval_task/acc"]
    assert written["results"]["task"]["acc_norm"] == evals[0]["eval_task/acc_norm"]


@pytest.mark.slow
def test_the_loop_reads_each_loss_one_step_late(tmp_path, monkeypatch):
    """The host dispatches step n + 1 before it reads step n's loss, except where something must see
    step n's verdict first (an evaluation, a checkpoint, the last step); a logged step is logged
    when its verdict is read. Its throughput counts the steps that had ended by then: here each
    call returns with its step ended, as where jax runs it on the calling thread
    (host_memory.run_cpu_programs_inline), and takes one second of the loop's clock."""
    from zaya_jax import train as train_lib
    from zaya_jax.trainer import loop

    order, clock = [], [0.0]

    class Recorded:  # the jitted train step, its calls recorded
        def __init__(self, step):
            self.step, self.calls = step, 0

        def __call__(self, state, batch):
            self.calls += 1
            order.append(("dispatch", self.calls))
            out = jax.block_until_ready(self.step(state, batch))
            clock[0] += 1.0
            return out

        def _cache_size(self):
            return self.step._cache_size()

        def lower(self, *args):  # the start-up memory check compiles it (not a dispatch)
            return self.step.lower(*args)

    def program(*args):
        p = real_program(*args)
        return dataclasses.replace(p, train_step=Recorded(p.train_step))

    def read(p, *rest):
        order.append(("read", p.step))
        return real_read(p, *rest)

    real_program, real_read = loop.train_program, loop._read
    monkeypatch.setattr(loop, "train_program", program)
    monkeypatch.setattr(loop, "_read", read)
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    # one layer: the host's order of dispatches and reads does not depend on the model
    layers = "--config.model.num_hidden_layers=1"
    c = tiny_config(*SMALL, layers, "--config.train.steps=6", "--config.logging.every_steps=3")
    c.eval.every_steps, c.checkpoint.every_steps = 0, 0
    summary = train_lib.train(c, str(tmp_path / "w"))
    assert summary["final_step"] == 6
    d, r = (lambda n: ("dispatch", n)), (lambda n: ("read", n))
    # steps 3 and 6 are logged; only 6 (the last: evaluated and saved) is read before the next
    # dispatch, logged step 3 is read, and logged, while step 4 runs
    assert order == [d(1), d(2), r(1), d(3), r(2), d(4), r(3), d(5), r(4), d(6), r(5), r(6)]
    assert sorted(train_losses(tmp_path / "w")) == [3, 6]
    # steps 1-3 ended at 3 s, 4-6 at 6 s: one step's tokens a second in both records (step 3's
    # verdict, read after step 4 ended, and the last step's had counted 3 steps over 4 s and 2 s)
    tokens = c.train.batch_size * c.train.seq_len
    speeds = [r["tokens_per_second"] for r in read_metrics(str(tmp_path / "w"), split="train")]
    assert speeds == [pytest.approx(tokens)] * 2
