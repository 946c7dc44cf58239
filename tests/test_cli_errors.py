"""Every CLI turns user errors into one `error: ...` line naming the key / file, a non-zero exit and
no traceback; a wrong command leaves the workdir it names byte-identical (each run a process of its
own running the CLI's `__main__`, forked from one that imported the CLIs: tests/support/cli_fork.py). The
bad inputs stop at validation, before anything compiles; the cases that need a trained run share
one tiny workdir."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support.cli_runs import ENV, TINY, assert_one_line_error, prepare_text, run_cli, tree_digest
from support.train_runs import ROOT, SMALL, run_train, train_losses

from zaya_jax.runtime import device_memory
from zaya_jax.training.checkpoint import Checkpointer

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
        run_cli("train", "--config", "configs/nope.py", "--workdir", tmp_path),
        "configs/nope.py",
        "does not exist",
    )
    assert_one_line_error(
        run_cli("train", "--config", "configs/zaya1_base.py:phase9", "--workdir", tmp_path),
        "--config=configs/zaya1_base.py:phase9",
        "unknown phase 'phase9'",
    )
    assert_one_line_error(
        run_cli("reshard", "--src", tmp_path / "a", "--dst", tmp_path / "b", "--config.model.hidden_sz=3"),
        "--config.model.hidden_sz",
        "--config.mesh.data",
    )
    assert os.listdir(tmp_path) == []
    assert_one_line_error(run_cli("train", "--config", TINY), "--workdir")


def test_train_workdir_is_a_file(tmp_path):
    f = tmp_path / "notadir"
    f.write_text("mine")
    assert_one_line_error(train_cli(f), str(f))
    assert f.read_text() == "mine"


def test_train_empty_eval_split_fails_at_start(tmp_path):
    data = prepare_text(tmp_path, "--eval-fraction", "0")
    w = tmp_path / "w"
    assert_one_line_error(train_cli(w, f"--config.data.path={data}"), str(data), "eval")
    assert not (w / "checkpoints").exists() and not (w / "metrics.jsonl").exists()


def test_train_truncated_shard_names_the_file(tmp_path):
    data = prepare_text(tmp_path)
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
        ("reshard", ["--src", "{w}", "--dst", "{w}"], ["--dst {w} is the workdir of --src {w}"]),
        ("evaluate", ["--checkpoint", "{w}", "--data", "{tmp}/missing.txt"], ["{tmp}/missing.txt"]),
        ("generate", ["--checkpoint", "{w}", "--prompt", "Hi", "--batch-size", "0"], ["--batch-size"]),
        ("generate", ["--checkpoint", "{w}", "--prompts-file", "{tmp}/none.txt"], ["{tmp}/none.txt"]),
        (
            "generate",
            ["--checkpoint", "{w}", "--prompt", "Hi", "--max-new-tokens", "100000"],
            ["--max-new-tokens 100000", "100003 positions", "max_position_embeddings (4096)"],
        ),
        (
            "evaluate",
            ["--checkpoint", "{w}", "--data", "embedded", "--max-len", "100000"],
            ["--max-len 100000", "max_position_embeddings (4096)"],
        ),
        ("import_hf", ["--hf", "{w}", "--out", "{tmp}/ck"], ["{w}", "config.json"]),
    ],
)
def test_cli_on_a_run_leaves_it_untouched(trained, tmp_path, module, args, names):
    w = copy_run(trained, tmp_path)
    fill = lambda s: s.format(w=w, tmp=tmp_path)
    before = tree_digest(w)
    assert_one_line_error(run_cli(module, *map(fill, args)), *map(fill, names))
    assert tree_digest(w) == before


@pytest.mark.slow  # two model loads and lm-eval's import
def test_evaluate_and_lm_eval_windows_default_to_the_trained_seq_len(trained, tmp_path, capsys):
    """The run trained 32-token sequences (SMALL) of a 4096-position model: evaluate's rows and
    lm-eval's max_length are 32 tokens unless set, and one line says so."""
    out = tmp_path / "r.json"
    args = ["--checkpoint", trained, "--data", "embedded", "--limit", "2", "--mesh", "none", "--quiet"]
    proc = run_cli("evaluate", *args, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "window: 32 tokens per row (the checkpoint's train.seq_len; --max-len N sets another)" in proc.stdout
    )
    default = json.loads(out.read_text())
    assert default["max_len"] == 32 and default["max_len_from"] == "train.seq_len"
    pytest.importorskip("lm_eval")
    from zaya_jax.lm_eval.backend import ZayaLM

    assert ZayaLM(checkpoint=str(trained), mesh="none").max_length == 32
    assert "zaya_jax: max_length 32 (the checkpoint's train.seq_len;" in capsys.readouterr().out
    assert ZayaLM(checkpoint=str(trained), mesh="none", max_length=64).max_length == 64


# ---------------------------------------------------------------------------------------------
# export, reshard, import_hf and prepare never write over what the user has


def _user_dirs(tmp_path):
    """Beside the run: a directory of the user's (a file of mode 0o640 in it) and a file."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    os.chmod(mine / "notes.txt", 0o640)
    (tmp_path / "notes.txt").write_text("keep")


OVER = "write to a directory outside it (--overwrite never replaces what is being read)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, args, cwd, names",
    [
        ("export", "--checkpoint {w} --out {w}", None, ["--out {w} is the workdir of", OVER]),
        ("export", "--checkpoint {w} --out {w} --overwrite", None, ["--out {w} is the", OVER]),
        ("export", "--checkpoint {w} --out {tmp}", None, ["--out {tmp} contains the workdir", OVER]),
        ("export", "--checkpoint {w} --out {tmp}/mine", None, ["{tmp}/mine is a directory", "--overwrite"]),
        (
            "export",
            "--checkpoint {w} --out {tmp}/notes.txt",
            None,
            ["{tmp}/notes.txt is a file", "--overwrite"],
        ),
        ("export", "--checkpoint {w} --out .", "{tmp}/mine", ["--out . is the current directory"]),
        ("export", "--checkpoint {w} --out . --overwrite", "{tmp}/mine", ["--out . is the current"]),
        ("export", "--checkpoint . --out .", "{w}", ["--out . is the workdir of --checkpoint", OVER]),
        ("export", "--checkpoint {w}/checkpoints/6 --out {w}/checkpoints/6/hf", None, ["is inside", OVER]),
        (
            "export",
            "--checkpoint {w} --out {w}/checkpoints/3 --overwrite",
            None,
            ["/checkpoints/3 is inside"],
        ),
        ("reshard", "--src {w}/checkpoints/3 --dst {tmp} --overwrite", None, ["--dst {tmp} contains", OVER]),
        ("reshard", "--src {w} --dst {tmp}/mine", None, ["--dst {tmp}/mine is a directory", "--overwrite"]),
        ("import_hf", "--hf {w} --out {w} --overwrite", None, ["--out {w} is --hf {w}", OVER]),
        ("import_hf", "--hf {w} --out {tmp}/mine", None, ["--out {tmp}/mine is a directory", "--overwrite"]),
        ("import_hf", "--hf {w} --out {tmp}/notes.txt", None, ["{tmp}/notes.txt is a file", "--overwrite"]),
    ],
)
def test_an_output_never_replaces_what_the_user_has(trained, tmp_path, module, args, cwd, names):
    """Each refused before anything is read, in one line naming the path and the remedy; nothing under
    tmp_path (the run, its parent, the user's directory and file) changes, modes included."""
    w = copy_run(trained, tmp_path)
    _user_dirs(tmp_path)
    fill = lambda s: s.format(w=w, tmp=tmp_path)
    before = tree_digest(tmp_path)
    proc = run_cli(module, *map(fill, args.split()), cwd=fill(cwd) if cwd else ROOT)
    assert_one_line_error(proc, *map(fill, names))
    assert tree_digest(tmp_path) == before


@pytest.mark.slow
def test_export_overwrite_empty_dir_and_umask(trained, tmp_path):
    """--overwrite replaces an unrelated non-empty directory, an empty directory is written into,
    and what export creates (new parents included) follows the umask; the run is never touched."""
    _user_dirs(tmp_path)
    run_before = tree_digest(trained)
    proc = run_cli("export", "--checkpoint", trained, "--out", tmp_path / "mine", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf_files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "zaya_tokenizer.json"]  # fmt: skip
    assert sorted(os.listdir(tmp_path / "mine")) == hf_files
    (tmp_path / "empty").mkdir()
    proc = run_cli("export", "--checkpoint", trained, "--out", tmp_path / "empty")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "empty")) == hf_files
    proc = run_cli("export", "--checkpoint", trained, "--out", tmp_path / "new" / "hf", umask=0o027)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d in (tmp_path / "new", tmp_path / "new" / "hf"):
        assert oct(os.stat(d).st_mode & 0o777) == oct(0o750), d
    assert {oct(os.stat(f).st_mode & 0o777) for f in (tmp_path / "new" / "hf").iterdir()} == {oct(0o640)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine", "new", "notes.txt"]  # no temp dirs
    assert tree_digest(trained) == run_before


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
    before = tree_digest(tmp_path)
    assert_one_line_error(run_cli("data.prepare", "--input", good, "--out", tmp_path / "d"), "--overwrite")
    assert_one_line_error(run_cli("data.prepare", "--input", good, "--out", good), f"--out {good} is --input")
    assert_one_line_error(
        run_cli("data.prepare", "--input", good, "--out", ".", cwd=tmp_path / "d"), "--out . is the current"
    )
    assert_one_line_error(  # the directory holding an input, even with --overwrite
        run_cli("data.prepare", "--input", "a.txt", "--out", ".", "--overwrite", cwd=tmp_path),
        "--out . contains --input a.txt",
    )
    assert tree_digest(tmp_path) == before
    assert os.listdir(tmp_path / "d") == ["mine.txt"]
    assert_one_line_error(run_cli("data.prepare", "--out", tmp_path / "d"), "--input")


def test_prepare_overwrite_and_umask(tmp_path):
    """--overwrite replaces an unrelated file; a new dataset directory follows the umask."""
    good = tmp_path / "a.txt"
    good.write_text("some text " * 100)
    (tmp_path / "f").write_text("mine")
    proc = run_cli("data.prepare", "--input", good, "--out", tmp_path / "f", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "f" / "meta.json").is_file()
    proc = run_cli("data.prepare", "--input", good, "--out", tmp_path / "new" / "d", umask=0o027)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = [tmp_path / "new", tmp_path / "new" / "d", *(tmp_path / "new" / "d").rglob("*")]
    assert {oct(os.stat(p).st_mode & 0o777) for p in made if p.is_dir()} == {oct(0o750)}
    assert {oct(os.stat(p).st_mode & 0o777) for p in made if p.is_file()} == {oct(0o640)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "f", "new"]  # no temp dirs left


def test_unreadable_inputs_name_the_file(tmp_path):
    """A latin-1 text to prepare (.txt and .jsonl), an empty, blank or latin-1 --prompts-file, an HF
    directory given to export: one line naming the file and what it is; nothing written."""
    (tmp_path / "latin.txt").write_bytes("café naïve\n".encode("latin-1"))
    (tmp_path / "latin.jsonl").write_bytes('{"text": "ok"}\n{"text": "café"}\n'.encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "zaya"}')
    before = tree_digest(tmp_path)
    for name in ("latin.txt", "latin.jsonl"):
        proc = run_cli("data.prepare", "--input", tmp_path / name, "--out", tmp_path / "d")
        assert_one_line_error(proc, tmp_path / name, "not UTF-8", "0xe9")
    for name in ("empty.txt", "blank.txt"):
        proc = run_cli("generate", "--checkpoint", tmp_path / "w", "--prompts-file", tmp_path / name)
        assert_one_line_error(proc, f"--prompts-file {tmp_path / name} is empty")
    proc = run_cli("generate", "--checkpoint", tmp_path / "w", "--prompts-file", tmp_path / "latin.txt")
    assert_one_line_error(proc, tmp_path / "latin.txt", "not UTF-8")
    proc = run_cli("export", "--checkpoint", hf_dir, "--out", tmp_path / "again")
    assert_one_line_error(proc, f"--checkpoint {hf_dir} is a Hugging Face directory", "WORKDIR")
    assert tree_digest(tmp_path) == before


def test_prepare_one_text_file_gets_an_eval_split(tmp_path):
    """Finding 2: one .txt file (one document by default) still gets a held-out split, the
    tail of the text, and the train split keeps the rest; every token is in exactly one."""
    from zaya_jax.data.prepared import load_split

    data = prepare_text(tmp_path)
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


# ---------------------------------------------------------------------------------------------
# a workdir stands on its own: its tokenizer, its data path


@pytest.mark.slow
def test_workdir_holds_its_tokenizer(tmp_path):
    """Trained on a relative data.path, then generate / export from another directory after the data
    moved: the workdir's tokenizer is read, and named; a workdir without one (as written before the
    trainer stored it) falls back to the data path, and its error names that path and where it
    was read from."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    proj.mkdir(), elsewhere.mkdir()
    (proj / "book.txt").write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)
    assert run_cli("data.prepare", "--input", "book.txt", "--out", "data/mine", cwd=proj).returncode == 0
    w = proj / "w"
    # the shapes and plan of `trained` (STEPS): its compiled programs are read from the cache
    proc = run_cli(
        "train", "--config", TINY, "--workdir", w, *SMALL, *STEPS, "--config.data.path=data/mine", cwd=proj
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(w / "tokenizer")) == ["zaya_tokenizer.json"]
    assert not [n for n in os.listdir(w) if n.startswith(".tokenizer")]
    saved = Checkpointer(str(w), read_only=True)
    assert saved.restore_config()["data"]["path"] == str(proj / "data" / "mine")
    saved.close()
    shutil.move(proj / "data", proj / "moved")  # the data is gone: the workdir alone must do

    before = tree_digest(w)
    proc = run_cli("generate", "--checkpoint", w, "--prompt", "Call", "--max-new-tokens", "2", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"tokenizer byte: {w}/tokenizer/zaya_tokenizer.json" in proc.stderr.splitlines()
    proc = run_cli(
        "export", "--checkpoint", w, "--out", elsewhere / "hf", "--dtype", "float32", cwd=elsewhere
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["tokenizer_file"] == f"{w}/tokenizer/zaya_tokenizer.json"
    assert tree_digest(w) == before

    shutil.rmtree(w / "tokenizer")  # a workdir from before the trainer stored its tokenizer
    before = tree_digest(w)
    proc = run_cli("generate", "--checkpoint", w, "--prompt", "Call", cwd=elsewhere)
    assert_one_line_error(proc, f"{w} has no tokenizer/", str(proj / "data" / "mine"), "--tokenizer")
    # the first generate's prompt and length: its compiled programs are read from the cache
    byte = ["--tokenizer", "byte", "--max-new-tokens", "2"]
    proc = run_cli("generate", "--checkpoint", w, "--prompt", "Call", *byte, cwd=elsewhere)
    assert proc.returncode == 0 and "tokenizer byte: built in" in proc.stderr, proc.stderr[-3000:]
    assert tree_digest(w) == before


@pytest.mark.slow
def test_reshard_copies_the_tokenizer(trained, tmp_path):
    src = copy_run(trained, tmp_path, "src")
    before = tree_digest(src)
    proc = run_cli("reshard", "--src", src, "--dst", tmp_path / "dst", "--config.mesh.data=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_digest(tmp_path / "dst" / "tokenizer") == tree_digest(src / "tokenizer")
    assert tree_digest(src) == before


@pytest.mark.slow
def test_resume_on_data_of_another_tokenizer_is_refused(trained, tmp_path):
    from support.tokenizers import build_hf_tokenizer

    from zaya_jax.data.tokenizer import HFTokenizer

    w = copy_run(trained, tmp_path)
    assert (w / "tokenizer" / "zaya_tokenizer.json").is_file()  # the trainer stored it
    shutil.rmtree(w / "tokenizer")
    HFTokenizer(build_hf_tokenizer(tmp_path / "tokenizer.json")).save(w / "tokenizer")
    before = tree_digest(w)
    assert_one_line_error(
        train_cli(w), f"{w}/tokenizer holds tokenizer hf-", "prepared with byte", "--workdir"
    )
    assert tree_digest(w) == before


@pytest.mark.slow
def test_init_from_another_model_names_the_key(trained, tmp_path):
    src = copy_run(trained, tmp_path, "src")
    before = tree_digest(src)
    proc = train_cli(tmp_path / "w", f"--config.train.init_from={src}", "--config.model.hidden_size=96")
    line = assert_one_line_error(
        proc, "config.train.init_from", "model.hidden_size: checkpoint 64, config 96"
    )
    assert "strict" not in proc.stderr and "Event loop" not in proc.stderr, line
    assert tree_digest(src) == before


@pytest.mark.slow
def test_corrupt_checkpoint_warning_is_one_line(trained, tmp_path):
    """An unreadable newest checkpoint: one warning line naming the step and the file, then the
    run resumes from the one before."""
    from support.checkpoints import corrupt_state

    w = copy_run(trained, tmp_path)
    corrupt_state(w, 6)
    proc = train_cli(w)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "cannot be restored" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("WARNING: checkpoint 6 cannot be restored (reading ")
    assert f"{w}/checkpoints/6/state/" in warnings[0] and "tensorstore_spec" not in warnings[0]
    assert f"moved to {w}/checkpoints.corrupt/6-" in warnings[0]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["summary"]["start_step"] == 3


def test_debug_env_shows_the_traceback(tmp_path):
    proc = run_cli("plot", tmp_path / "missing", env={"ZAYA_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_a_forked_run_is_what_python_dash_m_gives(tmp_path):
    """run_cli's fork (tests/support/cli_fork.py) gives a fresh `python -m` process' exit code, stdout and
    stderr: an argparse CLI and an absl one, an error, a traceback, a usage message."""
    cases = [
        ("plot", [tmp_path / "missing"], {}),
        ("plot", [tmp_path / "missing"], {"ZAYA_DEBUG": "1"}),
        ("train", ["--config", TINY, "--workdir", tmp_path / "w", "--config.model.hidden_sz=3"], {}),
        ("export", ["--help"], {}),
    ]
    for module, args, env in cases:
        forked = run_cli(module, *args, env=env)
        fresh = subprocess.run(
            [sys.executable, "-m", f"zaya_jax.{module}", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**ENV, **env},
            timeout=300,
        )
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), module
        if "Traceback" not in fresh.stderr:
            assert forked.stderr == fresh.stderr, module
        else:  # its first frames are the process' own (runpy's, the fork's); jax's plugin notices
            # come from the imports, which the fork server made
            assert "Traceback" in forked.stderr, forked.stderr[-1500:]
            assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], module


def test_the_checkpoint_clis_do_not_import_the_trainer():
    """reshard, import_hf and export take their helpers from train_state, not from the trainer."""
    code = (
        "import sys, zaya_jax.reshard, zaya_jax.import_hf, zaya_jax.export; "
        "assert 'zaya_jax.train' not in sys.modules, sorted(m for m in sys.modules if m.startswith('zaya_jax'))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
