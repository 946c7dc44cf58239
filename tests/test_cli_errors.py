"""Every CLI turns user errors into one `error: ...` line naming the key / file, a non-zero exit and
no traceback; a wrong command leaves the workdir it names byte-identical (subprocesses, as a user
runs them). The bad inputs stop at validation, before anything compiles; the cases that need a
trained run share one tiny workdir."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from test_train import ROOT, SMALL, run_train, train_losses

from xla_env import xla_flags
from zaya_jax import device_memory

TINY = os.path.join(ROOT, "configs/tiny.py")
ENV = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
ENV.pop("ZAYA_DEBUG", None)


def run_cli(module, *args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", f"zaya_jax.{module}", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**ENV, **(env or {})},
    )
    return proc


def assert_one_line_error(proc, *names):
    """Exit 2, stderr is exactly one line `error: ...` containing each of `names`, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    print(f"\nCLI-ERROR {' '.join(proc.args[2:])}\n  -> {lines[0]}")  # the table of bad inputs (pytest -s)
    return lines[0]


def tree_digest(path):
    """{relative path: sha256 of the file, or 'dir'} of everything under `path`."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "dir"
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


STEPS = ["--config.train.steps=6", "--config.checkpoint.every_steps=3", "--config.eval.every_steps=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step tiny run (checkpoints 3 and 6), shared read-only by the resume cases."""
    w = tmp_path_factory.mktemp("cli") / "run"
    run_train(w, *STEPS)
    return w


def copy_run(trained, tmp_path, name="w"):
    dst = tmp_path / name
    shutil.copytree(trained, dst)
    return dst


def train_cli(workdir, *extra):
    return run_cli("train", "--config", TINY, "--workdir", workdir, *SMALL, *STEPS, *extra)


# ---------------------------------------------------------------------------------------------
# train: config and data, before anything is built


@pytest.mark.parametrize(
    "args, names",
    [
        (["--config.model.hidden_sz=96"], ["--config.model.hidden_sz", "--config.model.hidden_size"]),
        (["--config.trian.steps=5"], ["--config.trian.steps", "--config.train.steps"]),
        (["--config.train.batch_size=0"], ["config.train.batch_size", "0"]),
        (["--config.train.batch_size=abc"], ["--config.train.batch_size"]),
        (["--config.data.path=/nonexistent/data"], ["/nonexistent/data"]),
        (
            ["--config.eval.tasks=('/nonexistent/task.jsonl',)"],
            ["config.eval.tasks[0]", "/nonexistent/task.jsonl"],
        ),
        (["--config.train.init_from=/nonexistent/run"], ["config.train.init_from", "/nonexistent/run"]),
    ],
)
def test_train_bad_config(tmp_path, args, names):
    w = tmp_path / "w"
    assert_one_line_error(train_cli(w, *args), *names)
    assert not (w / "checkpoints").exists()


def test_train_missing_config_file_and_missing_flags(tmp_path):
    assert_one_line_error(
        run_cli("train", "--config", "configs/nope.py", "--workdir", tmp_path), "configs/nope.py"
    )
    assert_one_line_error(run_cli("train", "--config", TINY), "--workdir")


def test_train_workdir_is_a_file(tmp_path):
    f = tmp_path / "notadir"
    f.write_text("mine")
    assert_one_line_error(train_cli(f), str(f))
    assert f.read_text() == "mine"


def _prepare(tmp_path, *args):
    text = tmp_path / "book.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)
    out = tmp_path / "data"
    proc = run_cli("data.prepare", "--input", text, "--out", out, *args)
    assert proc.returncode == 0, proc.stderr
    return out


def test_train_empty_eval_split_fails_at_start(tmp_path):
    data = _prepare(tmp_path, "--eval-fraction", "0")
    w = tmp_path / "w"
    assert_one_line_error(train_cli(w, f"--config.data.path={data}"), str(data), "eval")
    assert not (w / "checkpoints").exists() and not (w / "metrics.jsonl").exists()


def test_train_truncated_shard_names_the_file(tmp_path):
    data = _prepare(tmp_path)
    shard = data / "train" / "shard_00000.npy"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    assert_one_line_error(train_cli(tmp_path / "w", f"--config.data.path={data}"), str(shard))


# ---------------------------------------------------------------------------------------------
# train: resuming a workdir with a wrong command leaves it byte-identical


@pytest.mark.slow
def test_resume_with_another_width_then_the_right_config(trained, tmp_path):
    """Finding 1: train; restart with another width -> error, nothing moved; restart with the right
    config -> continues from the last checkpoint, losses identical to the uninterrupted run."""
    w = copy_run(trained, tmp_path)
    shutil.rmtree(w / "checkpoints" / "6")  # as if killed after the step-3 save
    before = tree_digest(w)
    line = assert_one_line_error(
        train_cli(w, "--config.model.hidden_size=96"), "model.hidden_size: checkpoint 64, config 96", str(w)
    )
    assert "checkpoints.corrupt" not in line
    assert tree_digest(w) == before
    # another optimizer-state structure (Muon momentum dtype) is named the same way
    assert_one_line_error(train_cli(w, "--config.optim.muon.mu_dtype=bfloat16"), "optim.muon.mu_dtype")
    assert tree_digest(w) == before

    proc = train_cli(w)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["summary"]["start_step"] == 3
    ref, got = train_losses(trained), train_losses(w)
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == ref[s] for s in range(1, 7)), (got, ref)


@pytest.mark.slow
def test_all_checkpoints_quarantined_refuses_a_fresh_start(trained, tmp_path):
    w = copy_run(trained, tmp_path)
    corrupt = w / "checkpoints.corrupt"
    corrupt.mkdir()
    for step in os.listdir(w / "checkpoints"):
        shutil.move(w / "checkpoints" / step, corrupt / f"{step}-1")
    before = tree_digest(w)
    assert_one_line_error(train_cli(w), str(corrupt), "--config.checkpoint.allow_fresh_start=True")
    assert tree_digest(w) == before


@pytest.mark.slow
def test_a_step_too_large_for_the_machine_is_refused_at_start(trained, tmp_path):
    """The train step compiled at start-up needs more than the machine has (a 1 MB machine, faked by
    ZAYA_JAX_MEMORY_LIMIT_BYTES): one line naming what it needs, what there is and the remedies,
    before the first step; a resumed workdir is byte-identical, a new one is not left behind."""
    limit = {device_memory.LIMIT_ENV: "1000000"}
    names = ["the train step needs", f"the {device_memory.LIMIT_ENV} limit is 0.95 MiB", "train.grad_accum"]
    names += ["model.remat=full"]
    w = copy_run(trained, tmp_path)
    before = tree_digest(w)
    line = assert_one_line_error(
        run_cli("train", "--config", TINY, "--workdir", w, *SMALL, *STEPS, env=limit), *names
    )
    need = float(line.split("needs ")[1].split(" MiB")[0])
    assert 1.0 < need < 100.0, line  # the small model's step: a few MiB, more than the limit
    assert tree_digest(w) == before
    fresh = tmp_path / "new" / "run"  # its parent is made by the run too, and removed
    assert_one_line_error(
        run_cli("train", "--config", TINY, "--workdir", fresh, *SMALL, *STEPS, env=limit), *names
    )
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, args, names",
    [
        ("export", ["--checkpoint", "{w}/checkpoints/999", "--out", "{tmp}/hf"], ["{w}/checkpoints", "999"]),
        ("reshard", ["--src", "{w}", "--dst", "{w}"], ["{w}/checkpoints/6", "already exists"]),
        ("evaluate", ["--checkpoint", "{w}", "--data", "{tmp}/missing.txt"], ["{tmp}/missing.txt"]),
        ("generate", ["--checkpoint", "{w}", "--prompt", "Hi", "--batch-size", "0"], ["--batch-size"]),
        ("generate", ["--checkpoint", "{w}", "--prompts-file", "{tmp}/none.txt"], ["{tmp}/none.txt"]),
        ("import_hf", ["--hf", "{w}", "--out", "{tmp}/ck"], ["{w}", "config.json"]),
    ],
)
def test_cli_on_a_run_leaves_it_untouched(trained, tmp_path, module, args, names):
    w = copy_run(trained, tmp_path)
    fill = lambda s: s.format(w=w, tmp=tmp_path)
    before = tree_digest(w)
    assert_one_line_error(run_cli(module, *map(fill, args)), *map(fill, names))
    assert tree_digest(w) == before


# ---------------------------------------------------------------------------------------------
# the other CLIs, without a run


def test_prepare_bad_inputs(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("some text " * 100)
    assert_one_line_error(
        run_cli("data.prepare", "--input", tmp_path / "no.txt", "--out", tmp_path / "d"), "no.txt"
    )
    (tmp_path / "a.csv").write_text("x,y\n")
    assert_one_line_error(
        run_cli("data.prepare", "--input", tmp_path / "a.csv", "--out", tmp_path / "d"), "a.csv"
    )
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert_one_line_error(
        run_cli("data.prepare", "--input", tmp_path / "b.jsonl", "--out", tmp_path / "d"), "b.jsonl:2"
    )
    assert_one_line_error(
        run_cli("data.prepare", "--input", good, "--out", tmp_path / "d", "--eval-fraction", "1.5"),
        "--eval-fraction",
    )
    (tmp_path / "tok.json").write_text("{not json")
    assert_one_line_error(
        run_cli(
            "data.prepare", "--input", good, "--out", tmp_path / "d", "--tokenizer", tmp_path / "tok.json"
        ),
        "tok.json",
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep")
    assert_one_line_error(run_cli("data.prepare", "--input", good, "--out", tmp_path / "d"), "--overwrite")
    assert os.listdir(tmp_path / "d") == ["mine.txt"]
    assert_one_line_error(run_cli("data.prepare", "--out", tmp_path / "d"), "--input")


def test_prepare_one_text_file_gets_an_eval_split(tmp_path):
    """Finding 2: one .txt file (one document by default) still gets a held-out split, the
    tail of the text, and the train split keeps the rest; every token is in exactly one."""
    from zaya_jax.data.prepare import load_split

    data = _prepare(tmp_path)
    meta = json.loads((data / "meta.json").read_text())
    n = len(("Call me Ishmael. Some years ago, never mind how long precisely. " * 40).encode())
    assert meta["splits"]["eval"]["num_docs"] == 1 and meta["eval_tail_tokens"] == int(
        np.ceil(0.01 * (n + 1))
    )
    train, held = load_split(data, "train"), load_split(data, "eval")
    body = lambda docs: np.asarray(docs.doc_tokens(0))[:-1]
    whole = np.concatenate([body(train), body(held)])
    assert (
        bytes((whole - 3).astype(np.uint8))
        == ("Call me Ishmael. Some years ago, never mind how long precisely. " * 40).encode()
    )


@pytest.mark.slow  # ten CLI start-ups
def test_other_clis_missing_paths(tmp_path):
    missing = tmp_path / "missing"
    assert_one_line_error(run_cli("export", "--checkpoint", missing, "--out", tmp_path / "hf"), str(missing))
    assert_one_line_error(run_cli("export", "--checkpoint", missing), "--out")
    assert_one_line_error(run_cli("import_hf", "--hf", missing, "--out", tmp_path / "ck"), str(missing))
    hf_dir = tmp_path / "hf_no_weights"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "zaya"}')
    assert_one_line_error(
        run_cli("import_hf", "--hf", hf_dir, "--out", tmp_path / "ck"), str(hf_dir), "safetensors"
    )
    assert_one_line_error(run_cli("reshard", "--src", missing, "--dst", tmp_path / "d"), str(missing))
    assert_one_line_error(run_cli("evaluate", "--checkpoint", missing, "--data", "embedded"), str(missing))
    assert_one_line_error(run_cli("generate", "--checkpoint", missing, "--prompt", "x"), str(missing))
    assert_one_line_error(run_cli("plot", missing), str(missing))
    assert_one_line_error(
        run_cli("sizing", "--config", TINY, "--config.model.num_expert=4"), "--config.model.num_experts"
    )


def test_debug_env_shows_the_traceback(tmp_path):
    proc = run_cli("plot", tmp_path / "missing", env={"ZAYA_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_the_checkpoint_clis_do_not_import_the_trainer():
    """reshard, import_hf and export take their helpers from train_state, not from the trainer."""
    code = (
        "import sys, zaya_jax.reshard, zaya_jax.import_hf, zaya_jax.export; "
        "assert 'zaya_jax.train' not in sys.modules, sorted(m for m in sys.modules if m.startswith('zaya_jax'))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
