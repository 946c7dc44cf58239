"""`prepare`'s inputs beyond .txt / .jsonl: parquet (streamed by record batches), .jsonl.zst and
a Hugging Face dataset saved to disk give the same shards as the same documents in JSONL;
`--workers 2` writes what `--workers 1` writes; bad inputs end in one error line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support.train_runs import ROOT

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")


def texts_of(num_docs, seed):
    rng = np.random.default_rng(seed)
    out = ["".join(rng.choice(list("abcdé fgh\n"), size=int(rng.integers(1, 120)))) for _ in range(num_docs)]
    out[7] = "   "  # whitespace-only: skipped by every format
    return out


def prepare(*args):
    cmd = [sys.executable, "-m", "zaya_jax.data.prepare", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def shards(out_dir):
    """Every file of a prepared dataset but meta.json, and meta.json without what names the run."""
    files = {p.relative_to(out_dir): p.read_bytes() for p in out_dir.rglob("*") if p.is_file()}
    meta = json.loads(files.pop(next(k for k in files if k.name == "meta.json")))
    for key in ("created_unix", "inputs"):
        meta.pop(key)
    return files, meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    texts = texts_of(500, 0)
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    out = prepare("--input", root / "docs.jsonl", "--out", root / "ref", "--eval-fraction", "0.05")
    assert out.returncode == 0, out.stderr
    return root, texts, shards(root / "ref")


def test_parquet_gives_the_shards_of_jsonl(reference):
    root, texts, expected = reference
    # several row groups and an extra column, read in record batches
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, root / "docs.parquet", row_group_size=64)
    args = ("--out", root / "pq", "--eval-fraction", "0.05", "--text-field", "content")
    out = prepare("--input", root / "docs.parquet", *args)
    assert out.returncode == 0, out.stderr
    got = shards(root / "pq")
    assert got[0] == expected[0] and {**got[1], "text_field": "text"} == expected[1]


def test_jsonl_zst_gives_the_shards_of_jsonl(reference):
    root, texts, expected = reference
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    half = len(lines) // 2
    with open(root / "docs.jsonl.zst", "wb") as f:  # two zstd frames, as parallel compressors write
        f.writelines(zstandard.ZstdCompressor().compress("".join(part).encode()) for part in (lines[:half], lines[half:]))
    out = prepare("--input", root / "docs.jsonl.zst", "--out", root / "zst", "--eval-fraction", "0.05")
    assert out.returncode == 0, out.stderr
    assert shards(root / "zst") == expected


def test_hf_dataset_saved_to_disk_gives_the_shards_of_jsonl(reference):
    datasets = pytest.importorskip("datasets")
    root, texts, expected = reference
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(root / "hf"), num_shards=3)
    assert len(list((root / "hf").glob("*.arrow"))) == 3
    out = prepare("--input", root / "hf", "--out", root / "hf_out", "--eval-fraction", "0.05")
    assert out.returncode == 0, out.stderr
    assert shards(root / "hf_out") == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:5]})}).save_to_disk(
        str(root / "dd")
    )
    out = prepare("--input", root / "dd", "--out", root / "dd_out")
    assert out.returncode == 2 and out.stderr.startswith(f"error: {root / 'dd'} holds a DatasetDict")


def test_bad_columnar_inputs_fail_in_one_line(reference):
    root, texts, _ = reference
    pq.write_table(pa.table({"body": texts}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": ["a", None, "b"]}), root / "null.parquet")
    (root / "fake.parquet").write_bytes(b"not parquet at all")
    cases = [
        ("nocol.parquet", f"error: {root / 'nocol.parquet'} has no column 'text' (columns: body); see --text-field"),
        ("null.parquet", f"error: {root / 'null.parquet'}: row 1: 'text' is NoneType, not a string"),
        ("fake.parquet", f"error: {root / 'fake.parquet'}: not a readable parquet file"),
    ]  # fmt: skip
    for name, message in cases:
        out = prepare("--input", root / name, "--out", root / f"out_{name}")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), (name, out.stderr)
        assert not (root / f"out_{name}").exists()


@pytest.mark.slow
def test_two_workers_write_what_one_writes(tmp_path):
    """Over 4 MiB of input, so two processes really tokenize; the progress line is on stderr."""
    rng = np.random.default_rng(1)
    words = np.array(["alpha", "beta", "gamma", "delta", "é", "\n"])
    with open(tmp_path / "big.jsonl", "w") as f:
        f.writelines(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(100, 400))))}) + "\n" for _ in range(3500))
    assert (tmp_path / "big.jsonl").stat().st_size > 4 << 20
    runs = {}
    for workers in (1, 2):
        args = ("--out", tmp_path / f"w{workers}", "--workers", workers, "--shard-tokens", 500_000)
        out = prepare("--input", tmp_path / "big.jsonl", *args)
        assert out.returncode == 0, out.stderr
        assert "prepare: 3,500 docs" in out.stderr and "tokens/s" in out.stderr and "input 100%" in out.stderr
        runs[workers] = shards(tmp_path / f"w{workers}")
    assert len(runs[1][0]) > 4 and runs[1] == runs[2]


class Started:
    """`prepare` in a subprocess of its own process group (a terminal's Ctrl-C reaches it all),
    stderr collected as it comes."""

    def __init__(self, *args):
        cmd = [sys.executable, "-m", "zaya_jax.data.prepare", *map(str, args)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     cwd=ROOT, start_new_session=True)  # fmt: skip
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()

    def until(self, ready, timeout=240.0):
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, ("ended early", self.proc.returncode, self.err[-5:])
            assert time.monotonic() < deadline, self.err[-5:]
            time.sleep(0.05)

    def stop(self, signum):
        """(exit code, seconds from the signal to the exit, stderr lines)."""
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signum)
        code = self.proc.wait(timeout=60)
        seconds = time.monotonic() - t0
        time.sleep(0.2)
        return code, seconds, [line.rstrip("\n") for line in self.err if line.strip()]


@pytest.mark.slow
def test_resume_after_kill_9_and_ctrl_c_writes_what_one_run_writes(tmp_path):
    """`--resume` on two workers: killed with SIGKILL once it wrote shards, then stopped by a Ctrl-C
    to its process group (exit 130 within 3 s, one line), then run to the end: the shards and
    meta.json are those of one uninterrupted run, the shards checkpointed before an interrupt are not
    written again, and a run with other options, or without --resume, is refused in one line."""
    rng = np.random.default_rng(3)
    words = np.array(["alpha", "beta", "gamma", "delta", "é", "\n"])
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path, n in zip(inputs, (9000, 9000)):
        rows = [" ".join(rng.choice(words, size=int(rng.integers(50, 500)))) for _ in range(n)]
        rows[100] = " "  # skipped; counted in meta.json as in one run
        path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    common = ("--input", *inputs, "--shard-tokens", 100_000, "--eval-fraction", 0.03)
    assert prepare(*common, "--out", tmp_path / "ref", "--workers", 1).returncode == 0
    out, state = tmp_path / "out", tmp_path / ".out.prepare-resume"
    progress = state / "progress.json"

    run = Started(*common, "--out", out, "--workers", 2, "--resume")
    run.until(progress.is_file)
    assert run.stop(signal.SIGKILL)[0] == -signal.SIGKILL
    first = json.loads(progress.read_text())
    # the shards its last checkpoint records (one the kill cut off before its checkpoint is redone)
    recorded = [
        f"{split}/{shard[part]}"
        for split, writer in first["writers"].items()
        for shard in writer["shards"]
        for part in ("tokens", "offsets")
    ]
    kept = {name: (state / name).stat() for name in recorded}
    assert first["doc_index"] > 0 and kept and not out.exists()

    for args, message in (
        (("--workers", 2), f"error: an interrupted `prepare --resume` of --out {out} left its shards in {state}"),
        (("--resume", "--split-seed", 1), f"error: --resume: the interrupted run in {state} had other split_seed"),
    ):
        refused = prepare(*common, "--out", out, *args)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), refused.stderr

    run = Started(*common, "--out", out, "--workers", 2, "--resume")
    run.until(lambda: any(line.startswith("prepare: resuming") for line in run.err))
    run.until(lambda: json.loads(progress.read_text())["doc_index"] > first["doc_index"])
    code, seconds, lines = run.stop(signal.SIGINT)
    assert code == 130 and seconds < 3.0, (code, seconds, lines[-5:])
    assert lines[-1] == f"interrupted by SIGINT: nothing written to {out}; its shards are kept in {state}: run it again to continue"
    assert all(line.startswith("prepare: ") for line in lines[:-1]), lines
    assert not out.exists() and json.loads(progress.read_text())["doc_index"] > first["doc_index"]

    done = prepare(*common, "--out", out, "--workers", 2, "--resume")
    assert done.returncode == 0, done.stderr
    assert f"prepare: resuming from {state}" in done.stderr and not state.exists()
    assert shards(out) == shards(tmp_path / "ref")
    for name, stat in kept.items():  # the same file, moved: not tokenized and written again
        now = (out / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), name


def test_resume_of_a_megatron_export_is_refused_in_one_line(reference):
    root, _, _ = reference
    out = prepare("--input", root / "docs.jsonl", "--out", root / "mg", "--format", "megatron", "--resume")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --resume applies to --format zaya only (a --format megatron export restarts)"
    ], out.stderr
    assert not list(root.glob("mg*")) and not list(root.glob(".mg*"))
