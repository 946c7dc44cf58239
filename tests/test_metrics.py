"""Tests for zaya_jax.training.metrics: the JSONL record format, resume truncation, TensorBoard scalars and
the console progress line."""

import io
import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from support.events import event_tags, tensorboard_events

from zaya_jax.training.metrics import MetricsLogger, read_metrics, to_python, truncate_metrics


def test_to_python():
    assert to_python(np.float32(1.5)) == 1.5 and type(to_python(np.float32(1.5))) is float
    assert type(to_python(jnp.asarray(2.5, jnp.bfloat16))) is float
    assert type(to_python(np.int32(7))) is int and type(to_python(jnp.asarray(True))) is bool
    assert to_python(jnp.arange(3, dtype=jnp.float32)) == [0.0, 1.0, 2.0]
    # float32: the shortest decimal that reads back as the same float32 (not its float64 digits)
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    short = to_python(x)
    np.testing.assert_array_equal(np.asarray(short, np.float32), x)
    assert to_python(np.float32(0.1)) == 0.1 and len(json.dumps(short)) < len(json.dumps(x.tolist())) * 0.7
    assert to_python(np.float64(0.1 + 1e-12)) == 0.1 + 1e-12  # float64 keeps its digits
    assert to_python(np.ones((2, 2), np.int8)) == [[1, 1], [1, 1]]
    assert to_python("x") == "x" and to_python(None) is None


def test_jsonl_records(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        log.log_train(
            np.int64(10),
            {
                "loss": jnp.asarray(3.25),
                "lr": np.float32(1e-3),
                "expert_load_max_over_mean": jnp.asarray([1.5, 2.0]),
                "grad": {"norm": 0.5},
            },
        )
        # Flushed on every write: readable while the logger is open.
        assert len(read_metrics(tmp_path)) == 1
        log.log_eval(10, {"loss": 2.0})
        log.log_eval(20, {"eval_loss": float("nan"), "eval_accuracy": 0.1})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    train = json.loads(lines[0])
    assert list(train)[:2] == ["step", "split"]
    assert train["step"] == 10 and train["split"] == "train" and train["loss"] == 3.25
    assert train["lr"] == pytest.approx(1e-3)
    assert train["expert_load_max_over_mean"] == [1.5, 2.0] and train["grad/norm"] == 0.5
    evals = read_metrics(tmp_path, split="eval")
    assert [r["step"] for r in evals] == [10, 20]
    assert evals[0]["eval_loss"] == 2.0
    assert evals[0]["eval_perplexity"] == pytest.approx(np.exp(2.0))
    assert np.isnan(evals[1]["eval_loss"]) and evals[1]["eval_accuracy"] == 0.1
    with (
        pytest.raises(ValueError, match="reserved"),
        MetricsLogger(tmp_path, tensorboard=False, console=False) as log,
    ):
        log.log_train(1, {"step": 3})


def test_resume_drops_later_steps(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        for step in range(1, 11):
            log.log_train(step, {"loss": 10.0 - step})
        log.log_eval(10, {"loss": 1.0})
        assert log.truncate_after(8) == 3  # steps 9, 10 and the eval at 10
        log.log_train(9, {"loss": 0.5})  # still appends to the (rewritten) file
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 10))
    assert truncate_metrics(tmp_path / "metrics.jsonl", 8) == 1
    # A run restored from step 5 re-runs 6, 7: no duplicate steps, the file is appended to.
    with MetricsLogger(tmp_path, console=False, resume_step=5) as log:
        log.log_train(6, {"loss": 4.5})
        log.log_train(7, {"loss": 3.5})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7]
    assert recs[5]["loss"] == 4.5
    # TensorBoard is told to discard the old run's events from step 6 on.
    from tensorboardX.proto.event_pb2 import SessionLog

    starts = [
        e.step
        for e in tensorboard_events(tmp_path / "tensorboard")
        if e.HasField("session_log") and e.session_log.status == SessionLog.START
    ]
    assert starts == [6]


def test_torn_last_line(tmp_path):
    good = json.dumps({"step": 1, "split": "train", "loss": 2.0})
    (tmp_path / "metrics.jsonl").write_text(good + "\n" + '{"step": 2, "split": "tr')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        log.log_train(2, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text("garbage\n" + good + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nowhere")


def test_tensorboard_scalars(tmp_path):
    with MetricsLogger(tmp_path, console=False) as log:
        for step in (1, 2, 3):
            log.log_train(
                step,
                {
                    "loss": 1.0 / step,
                    "expert_load_max_over_mean": [1.0, step],
                    "note": "text is not a scalar",
                },
            )
        log.log_eval(3, {"loss": 0.25})
    tags = event_tags(tmp_path / "tensorboard")
    assert [s for s, _ in tags["train/loss"]] == [1, 2, 3]
    assert tags["train/loss"][1][1] == pytest.approx(0.5)
    assert tags["train/expert_load_max_over_mean/layer_1"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert "train/expert_load_max_over_mean/layer_0" in tags
    assert tags["eval/loss"] == [(3, 0.25)] and "eval/perplexity" in tags
    assert not any("note" in t for t in tags)


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    # tensorboardX imports torch whenever it is installed; the trainer never passes torch tensors,
    # so a user's run should not pay for torch (~180 MB resident). A fresh process: pytest's has torch.
    code = (
        "import sys; from zaya_jax.training.metrics import MetricsLogger\n"
        f"with MetricsLogger({str(tmp_path)!r}, console=False) as log: log.log_train(1, {{'loss': 1.0}})\n"
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "False"
    assert event_tags(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0)]


class _Tty(io.StringIO):
    def isatty(self):
        return True


TRAIN_VALUES = {"loss": 2.5, "lr": 3e-4, "tokens_per_sec": 123456.0, "mfu": 0.412}


def test_console_plain_lines_when_not_a_tty(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=100, stream=out) as log:
        log.log_train(10, TRAIN_VALUES)
        log.log_train(20, {**TRAIN_VALUES, "tokens_per_sec": None, "tokens_per_second": 2e6})
        log.log_eval(20, {"loss": 2.0})
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 3
    assert lines[0].startswith("step 10/100 | loss 2.5000 | lr 0.0003 | 123.46k tok/s | MFU 41.2%")
    assert "ETA" not in lines[0]
    assert "2.00M tok/s" in lines[1] and "ETA" in lines[1]  # ETA needs a rate: from call 2 on
    assert lines[2].startswith("eval step 20 | loss 2 | perplexity 7.389")


def test_console_progress_bar_on_a_tty(tmp_path):
    out = _Tty()
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=100, stream=out) as log:
        log.log_train(50, TRAIN_VALUES)
        assert out.getvalue().count("\n") == 0  # redrawn in place, no newline yet
        log.log_train(60, TRAIN_VALUES)
        log.log_eval(60, {"loss": 2.0})
    text = out.getvalue()
    assert text.count("\r") == 2 and "[############............]  50.0% step 50/100" in text
    assert " 60.0% step 60/100" in text and text.endswith("\n")
    assert "\neval step 60" in text  # the eval line starts on a fresh line
