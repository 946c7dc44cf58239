"""Long-running commands, as a user runs them (subprocesses): sizes the model cannot hold are refused
at start-up in one `error:` line, and SIGINT / SIGTERM stop them within seconds with one line
`interrupted by SIG...`, exit 130 / 143, keeping what they finished and nothing that looks complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.cli_runs import ENV, assert_one_line_error, run_cli, tree_digest
from support.eval_models import BYTE_CASE, write_text
from support.hf_reference import random_hf_model
from support.train_runs import ROOT

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.runtime import interrupt

STOP_S = 10.0  # from the signal to the exit, at most (a few seconds; this box is shared and slow)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny byte-level HF model of 131072 positions and the same with 64."""
    d = tmp_path_factory.mktemp("models")
    for name, positions in (("long", 131072), ("short", 64)):
        random_hf_model(BYTE_CASE, eos_token_id=1, max_position_embeddings=positions).save_pretrained(
            d / name
        )
        ByteTokenizer().save(d / name)
    return d


class Running:
    """A CLI started in a subprocess; stdout and stderr collected as they come."""

    def __init__(self, module: str, *args, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"zaya_jax.{module}", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env or ENV,
            start_new_session=True,  # its own process group (the prepare test signals all of it)
        )
        self.out, self.err = [], []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _read(stream, sink):
        while chunk := stream.read(1):
            sink.append(chunk)

    def wait_for(self, ready, timeout: float = 240.0) -> None:
        """Until ready(stdout so far) holds (the command reached its long part)."""
        deadline = time.monotonic() + timeout
        while not ready("".join(self.out)):
            assert self.proc.poll() is None, ("ended early", self.proc.returncode, "".join(self.err)[-3000:])
            assert time.monotonic() < deadline, "".join(self.err)[-3000:]
            time.sleep(0.1)

    def stop(self, signum: int) -> tuple[int, float, list[str]]:
        """Sends `signum`; (exit code, seconds to the exit, stderr's non-empty lines)."""
        t0 = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running 60 s after {signal.Signals(signum).name}") from None
        seconds = time.monotonic() - t0
        time.sleep(0.2)  # the readers drain the pipes
        lines = [line for line in "".join(self.err).splitlines() if line.strip()]
        print(
            f"\nINTERRUPT {' '.join(self.proc.args[2:])}\n  -> exit {code} in {seconds:.1f} s: {lines[-1:]}"
        )
        return code, seconds, lines


def assert_interrupted(result, signum: int, kept: str = "", after: str | None = None) -> None:
    """Exit 128 + signum within STOP_S and the one line; before it only the tokenizer line a
    command prints on loading and lines starting with `after` (its progress lines), no traceback."""
    code, seconds, lines = result
    name = signal.Signals(signum).name
    assert code == 128 + signum and seconds < STOP_S, (code, seconds, lines[-20:])
    assert lines[-1:] == [f"interrupted by {name}" + (f": {kept}" if kept else "")], lines
    earlier = [line for line in lines[:-1] if not line.startswith("tokenizer ")]
    assert all(after and line.startswith(after) for line in earlier), lines


# ---------------------------------------------------------------------------------------------
# sizes checked at start-up


def test_generate_and_evaluate_refuse_what_the_model_cannot_hold(models, tmp_path):
    short, out = models / "short", tmp_path / "out" / "completions.jsonl"
    before = tree_digest(short)
    proc = run_cli(
        "generate", "--checkpoint", short, "--prompt", "Call me", "--max-new-tokens", 100000, "--out", out
    )
    assert_one_line_error(
        proc, "the prompt (8 tokens)", "--max-new-tokens 100000", "max_position_embeddings (64)"
    )
    (tmp_path / "prompts.txt").write_text("Hi\n" + "x" * 5000 + "\n")  # a 5,000-byte prompt
    proc = run_cli(
        "generate", "--checkpoint", short, "--prompts-file", tmp_path / "prompts.txt", "--out", out
    )
    assert_one_line_error(proc, "prompt 2 of 2 (5001 tokens)", "--max-new-tokens 64", "(64)")
    text = write_text(str(tmp_path / "doc.txt"))
    proc = run_cli("evaluate", "--checkpoint", short, "--data", text, "--max-len", 100000, "--out", out)
    assert_one_line_error(proc, "--max-len 100000", "max_position_embeddings (64)")
    assert not (tmp_path / "out").exists() and tree_digest(short) == before


# ---------------------------------------------------------------------------------------------
# SIGINT / SIGTERM


@pytest.mark.slow
def test_generate_stops_on_sigint_and_keeps_what_it_generated(models, tmp_path):
    """20,000 new tokens (within the model's positions): streamed; SIGINT once the completion is
    coming -> exit 130 within seconds, the tokens so far in --out marked interrupted."""
    out = tmp_path / "completions.jsonl"
    run = Running("generate", "--checkpoint", models / "long", "--prompt", "Call me",
                  "--max-new-tokens", 20000, "--out", out)  # fmt: skip
    run.wait_for(lambda text: len(text) > len("Call me"))  # the first chunk is out
    assert_interrupted(run.stop(signal.SIGINT), signal.SIGINT, f"1 of 1 completions kept in {out}")
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["interrupted"] is True and row["eos"] is False and 0 < len(row["tokens"]) < 20000
    assert row["completion"] == ByteTokenizer().decode(row["tokens"])
    assert "".join(run.out) == "Call me" + row["completion"] + "\n"  # streamed, then the line ends


@pytest.mark.slow
def test_evaluate_stops_on_sigterm_and_writes_nothing(models, tmp_path):
    """A perplexity of one token per window (--stride 1, thousands of requests): SIGTERM once it
    scores -> exit 143 within seconds; --out and --samples-out are written only for a whole run."""
    text = write_text(str(tmp_path / "long.txt"), "Call me Ishmael. " * 400)
    out, samples = tmp_path / "r" / "results.json", tmp_path / "r" / "samples.jsonl"
    run = Running("evaluate", "--checkpoint", models / "long", "--data", text, "--mesh", "none",
                  "--max-len", 64, "--stride", 1, "--out", out, "--samples-out", samples)  # fmt: skip
    run.wait_for(lambda text: "scored " in text)
    result = run.stop(signal.SIGTERM)
    kept = "nothing written (--out, --samples-out: written once every task is scored)"
    assert_interrupted(result, signal.SIGTERM, kept)
    assert "window: 64 tokens per row (--max-len)" in "".join(run.out)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_prepare_stops_on_a_signal_and_leaves_nothing(tmp_path, signum):
    """Tokenising ~60 MB: a signal once it encodes -> exit 130 / 143, one line
    after the progress lines, and the output's parent as it was (no dataset, no temporary
    directory)."""
    src = tmp_path / "big.jsonl"
    row = json.dumps({"text": "Call me Ishmael. Some years ago - never mind how long precisely. " * 8})
    src.write_text((row + "\n") * 120_000)
    parent = tmp_path / "data"
    parent.mkdir()
    run = Running("data.prepare", "--input", src, "--out", parent / "ds", "--workers", 1)
    deadline = time.monotonic() + 120
    while "prepare: " not in "".join(run.err):  # a progress line: the workers are encoding
        assert run.proc.poll() is None and time.monotonic() < deadline, "".join(run.err)[-3000:]
        time.sleep(0.05)
    assert os.listdir(parent)  # the dataset under its temporary name
    if signum == signal.SIGINT:  # the process group, as a terminal's Ctrl-C
        run.proc.send_signal = lambda s: os.killpg(os.getpgid(run.proc.pid), s)
    assert_interrupted(run.stop(signum), signum, f"nothing written to {parent / 'ds'}", after="prepare: ")
    assert os.listdir(parent) == []


@pytest.mark.slow
def test_dry_run_stops_on_sigint_during_its_compile(tmp_path):
    """The dry run spends most of its time in XLA's compile (C++, where Python's handlers do not
    run): SIGINT there still ends it within seconds, exit 130, one line, no traceback."""
    env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}  # the dry run sets its device count
    run = Running("train", "--config", os.path.join(ROOT, "configs/tiny.py"), "--dry_run", env=env)
    run.wait_for(lambda text: "dry run: compiling" in text)
    time.sleep(5)  # into the trace / compile
    code, seconds, lines = run.stop(signal.SIGINT)
    assert code == 130 and seconds < STOP_S, (code, seconds, lines[-20:])
    # at a Python line: the bare line; inside the compile: the watchdog's, which says so
    assert lines == ["interrupted by SIGINT: during the dry run; nothing written"], lines


GC_CALLBACK = """
import gc, os, signal, time
from zaya_jax.runtime import cli, interrupt

calls = []

def signal_in_gc(phase, info):  # the 5th collection gets the signal, in this callback
    calls.append(phase)
    if len(calls) == 10:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs here; Python drops what it raises

def main():
    gc.callbacks.append(signal_in_gc)
    with interrupt.handled("the loop", mode="raise"):
        while True:
            time.sleep(0.01)
            gc.collect(0)

cli.run(main)
"""


def test_a_signal_caught_in_a_gc_callback_still_stops_the_command():
    """Raised inside a gc callback (as jax's XLA one), an Interrupted is dropped by Python: it is
    raised again in the command's own code, at once, and nothing else is printed."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", GC_CALLBACK], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=60
    )
    assert proc.returncode == 143 and proc.stderr == "interrupted by SIGTERM\n", proc.stderr[-3000:]
    assert time.monotonic() - t0 < interrupt.GRACE_S + 5  # not the watchdog's forced exit
