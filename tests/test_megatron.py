"""Megatron indexed datasets (PREFIX.bin + PREFIX.idx): read in place with the same documents,
split and batches as `prepare`'s output, every integer dtype, sentence-split documents, mixtures
with prepared sources, one-line start-up errors for bad files, and the export
(`prepare --format megatron`) read back by our reader and, where installed, megatron-core's."""

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from support.batches import assert_batches_equal, take
from support.train_runs import ROOT, run_train, train_losses

from zaya_jax.data.megatron import MegatronOptions, load_megatron_split
from zaya_jax.data.megatron_format import DTYPES, MegatronWriter, check_token_ids, read_index
from zaya_jax.data.mixture import mixed_sequences, parse_mixture
from zaya_jax.data.pipeline import batch_sequences, load_documents, make_dataset, make_eval_dataset
from zaya_jax.data.prepare import prepare_dataset
from zaya_jax.data.tokenizer import ByteTokenizer

BYTE = MegatronOptions("byte")


def write_jsonl(path, num_docs, seed, alphabet="abcdefgh \n"):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            text = "".join(rng.choice(list(alphabet), size=int(rng.integers(1, 200))))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def prepare_cli(*args):
    cmd = [sys.executable, "-m", "zaya_jax.data.prepare", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 300 documents (one whitespace-only) as a prepared dir and as a Megatron dataset
    exported by `prepare --format megatron`."""
    root = tmp_path_factory.mktemp("megatron")
    text = write_jsonl(root / "docs.jsonl", 300, 0)
    with open(text, "a") as f:
        f.write(json.dumps({"text": "  \n "}) + "\n")  # skipped by both
    prepare_dataset([text], root / "prepared", eval_fraction=0.05)
    out = prepare_cli("--input", text, "--out", root / "web", "--format", "megatron")
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "300 docs" in out.stdout
    return root


def docs_of(d):
    return [np.asarray(d.doc_tokens(i), np.int64) for i in range(d.num_docs)]


def test_megatron_export_reads_as_the_prepared_documents_and_batches(corpus):
    options = MegatronOptions("byte", eval_fraction=0.05)
    for split in ("train", "eval"):
        a = load_documents(corpus / "prepared", split)
        b = load_documents(corpus / "web", split, options)
        assert a.num_docs == b.num_docs > 0 and (a.eos_id, a.pad_id) == (b.eos_id, b.pad_id)
        assert all(np.array_equal(x, y) for x, y in zip(docs_of(a), docs_of(b)))
    kw = dict(seq_len=32, global_batch_size=4, seed=3)
    assert_batches_equal(take(make_dataset(corpus / "prepared", **kw), 30),
                         take(make_dataset(corpus / "web", megatron=options, **kw), 30))  # fmt: skip
    ev = dict(seq_len=32, global_batch_size=4)
    assert_batches_equal(list(make_eval_dataset(corpus / "prepared", **ev)),
                         list(make_eval_dataset(str(corpus / "web") + ".bin", megatron=options, **ev)))  # fmt: skip


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_every_integer_dtype_reads_the_same_tokens(tmp_path, code):
    dtype = np.dtype(DTYPES[code])
    rng = np.random.default_rng(code)
    high = min(int(np.iinfo(dtype).max), 259)
    docs = [np.append(rng.integers(3, high, int(rng.integers(1, 40))), 1) for _ in range(120)]
    w = MegatronWriter(tmp_path / "d", dtype)
    for d in docs:
        w.add(d)
    w.finish()
    with open(tmp_path / "d.idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00" and struct.unpack("<QB", f.read(9)) == (1, code)
    index = read_index(str(tmp_path / "d"))
    assert index.dtype == dtype and len(index.document_indices) == 121
    train, held = (load_megatron_split(str(tmp_path / "d"), s, BYTE) for s in ("train", "eval"))
    assert train.num_docs + held.num_docs == 120 and held.num_docs >= 1
    assert train.shards[0].dtype == dtype  # memory-mapped as stored, no conversion
    got = {tuple(x) for x in docs_of(train) + docs_of(held)}
    assert got == {tuple(d) for d in docs}


def test_sentence_split_documents_are_whole_documents(tmp_path):
    rng = np.random.default_rng(1)
    docs, w = [], MegatronWriter(tmp_path / "s", np.uint16)
    for i in range(50):
        sentences = [rng.integers(3, 259, int(rng.integers(1, 9))) for _ in range(1 + i % 4)]
        sentences[-1] = np.append(sentences[-1], 1)  # EOD on the last sentence, as --append-eod
        docs.append(np.concatenate(sentences))
        w.add(docs[-1], [len(s) for s in sentences])
    w.add(np.zeros(0, np.int64), [])  # an empty document: a zero-sequence entry, skipped
    w.finish()
    index = read_index(str(tmp_path / "s"))
    assert len(index.sequence_lengths) == sum(1 + i % 4 for i in range(50))
    options = MegatronOptions("byte", eval_fraction=0.1)
    split = [load_megatron_split(str(tmp_path / "s"), s, options) for s in ("train", "eval")]
    from zaya_jax.data import split_documents

    expect_train, expect_eval = split_documents([tuple(d) for d in docs], 0.1, 0)
    assert [tuple(d) for d in docs_of(split[0])] == expect_train
    assert [tuple(d) for d in docs_of(split[1])] == expect_eval


def test_mixture_of_a_megatron_source_and_a_prepared_source(corpus, tmp_path):
    code = write_jsonl(tmp_path / "code.jsonl", 40, 5, alphabet="0123456789+=")
    prepare_dataset([code], tmp_path / "code", eval_fraction=0.1)
    options = MegatronOptions("byte", eval_fraction=0.05)
    sources = parse_mixture(f"{corpus / 'web'}:0.75,{tmp_path / 'code'}:0.25")
    assert [s.name for s in sources] == ["web", "code"]
    mix = mixed_sequences(sources, seq_len=32, seed=0, megatron=options)
    batches = take(batch_sequences(mix, global_batch_size=8), 20)
    rows = np.concatenate([b["input_ids"] for b in batches])
    digits = [bool(set(r[r >= 3].tolist()) <= {ord(c) + 3 for c in "0123456789+="}) for r in rows]
    assert abs(np.mean(digits) - 0.25) < 0.05
    # the same mixture over the prepared copy of the Megatron source draws the same batches
    same = parse_mixture(f"{corpus / 'prepared'}:0.75,{tmp_path / 'code'}:0.25")
    ref = take(batch_sequences(mixed_sequences(same, seq_len=32, seed=0), global_batch_size=8), 20)
    assert_batches_equal(batches, ref)


def test_mixture_of_two_megatron_sources_draws_the_batches_of_their_prepared_copies(corpus, tmp_path):
    """Two Megatron prefixes in one data.mixture draw the batches of the same mixture over
    `prepare`'s directories of the same documents, and hold out the same eval documents."""
    code = write_jsonl(tmp_path / "code.jsonl", 40, 5, alphabet="0123456789+=")
    prepare_dataset([code], tmp_path / "code", eval_fraction=0.05)
    prepare_dataset([code], tmp_path / "code_mg", output_format="megatron")
    options = MegatronOptions("byte", eval_fraction=0.05)
    megatron = parse_mixture(f"{corpus / 'web'}:0.75,{tmp_path / 'code_mg'}:0.25")
    prepared = parse_mixture(f"{corpus / 'prepared'}:0.75,{tmp_path / 'code'}:0.25")
    assert [s.name for s in megatron] == ["web", "code_mg"]
    got = mixed_sequences(megatron, seq_len=32, seed=0, megatron=options)
    ref = mixed_sequences(prepared, seq_len=32, seed=0)
    assert_batches_equal(take(batch_sequences(got, global_batch_size=8), 12),
                         take(batch_sequences(ref, global_batch_size=8), 12))  # fmt: skip
    for mg, pr in zip(megatron, prepared):  # and the held-out documents of each source
        a, b = load_documents(mg.path, "eval", options), load_documents(pr.path, "eval", None)
        assert a.num_docs > 0 and [x.tolist() for x in docs_of(a)] == [x.tolist() for x in docs_of(b)]


def test_too_few_documents_hold_out_the_tail_of_the_last_as_prepare_does(tmp_path):
    text = write_jsonl(tmp_path / "few.jsonl", 3, 7)
    prepare_dataset([text], tmp_path / "few", eval_fraction=0.05)
    assert prepare_cli("--input", text, "--out", tmp_path / "fewm", "--format", "megatron").returncode == 0
    options = MegatronOptions("byte", eval_fraction=0.05)
    for split in ("train", "eval"):
        a, b = load_documents(tmp_path / "few", split), load_documents(tmp_path / "fewm", split, options)
        assert [tuple(x) for x in docs_of(a)] == [tuple(x) for x in docs_of(b)]
    assert load_documents(tmp_path / "fewm", "eval", options).num_docs == 1


def test_megatron_config_errors(corpus, tmp_path):
    from support.configs import load
    from tokenizers import Tokenizer, models, trainers

    from zaya_jax import config as config_lib

    hf = Tokenizer(models.WordLevel(unk_token="<unk>"))
    hf.train_from_iterator(["a b"], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    cases = [
        ({"mixture": f"{corpus / 'web'}:1,{corpus / 'prepared'}:1"},
         "config.data.mixture: .*web is a Megatron dataset, which stores token ids only: set config.data.tokenizer"),
        ({"mixture": f"{corpus / 'web'}:1,{corpus / 'prepared'}:1", "tokenizer": str(tmp_path / "tokenizer.json")},
         "config.data.mixture: .*web and .*prepared were prepared with different tokenizers"),
        ({"eval_fraction": 1.0}, r"config.data.eval_fraction: must be in \[0, 1\)"),
        ({"split_seed": -1}, "config.data.split_seed: must be an int >= 0"),
    ]  # fmt: skip
    for overrides, message in cases:
        c = load("tiny")
        for key, value in overrides.items():
            setattr(c.data, key, value)
        with pytest.raises(ValueError, match=message):
            config_lib.validate(c)
    c = load("tiny")
    c.data.mixture, c.data.tokenizer = f"{corpus / 'web'}:1,{corpus / 'prepared'}:1", "byte"
    config_lib.validate(c)


def test_megatron_export_never_writes_over_files_without_overwrite(corpus, tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", 5, 1)
    (tmp_path / "out.idx").write_bytes(b"mine")
    out = prepare_cli("--input", text, "--out", tmp_path / "out", "--format", "megatron")
    assert out.returncode == 2 and out.stderr.startswith(f"error: --out {tmp_path / 'out.idx'} is a file")
    assert (tmp_path / "out.idx").read_bytes() == b"mine" and not (tmp_path / "out.bin").exists()
    out = prepare_cli("--input", text, "--out", tmp_path / "out", "--format", "megatron", "--overwrite")
    assert out.returncode == 0 and read_index(str(tmp_path / "out")).document_indices.tolist() == list(range(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "out.idx", "t.jsonl"]


def test_token_ids_are_scanned_against_the_vocabulary(tmp_path):
    w = MegatronWriter(tmp_path / "t", np.int32)
    for d in ([5, 6, 1], [7, 8, 9, 1], [10, 300, 1]):
        w.add(np.asarray(d))
    w.finish()
    assert check_token_ids(str(tmp_path / "t"), 301) > 0
    with pytest.raises(ValueError, match=r"t\.bin: document 2 \(token 1\) holds token id 300"):
        check_token_ids(str(tmp_path / "t"), 259)


def test_megatron_core_reads_our_files_and_writes_what_we_write(tmp_path):
    """Byte-identical files from megatron-core's IndexedDatasetBuilder and our writer, and its
    IndexedDataset reads our export (runs where megatron-core is installed: the `test` extra)."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    rng = np.random.default_rng(2)
    docs = [[rng.integers(3, 259, int(rng.integers(1, 6))) for _ in range(1 + i % 3)] for i in range(40)]
    for dtype in (np.uint16, np.int32, np.int64, np.uint8):
        builder = indexed.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=dtype)
        ours = MegatronWriter(tmp_path / "ours", dtype)
        for sentences in docs:
            flat = np.concatenate(sentences) % (200 if dtype == np.uint8 else 1 << 16)
            builder.add_document(torch.tensor(flat), [len(s) for s in sentences])
            ours.add(flat, [len(s) for s in sentences])
        builder.finalize(str(tmp_path / "mc.idx"))
        ours.finish()
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"mc{suffix}").read_bytes() == (tmp_path / f"ours{suffix}").read_bytes()
        ds = indexed.IndexedDataset(str(tmp_path / "ours"))
        assert len(ds.document_indices) == 41
    # and megatron-core reads the documents `prepare --format megatron` wrote
    text = write_jsonl(tmp_path / "t.jsonl", 20, 3)
    assert prepare_cli("--input", text, "--out", tmp_path / "exp", "--format", "megatron").returncode == 0
    ds = indexed.IndexedDataset(str(tmp_path / "exp"))
    tok = ByteTokenizer()
    texts = [json.loads(line)["text"] for line in open(text)]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eos_id] for t in texts]


# ------------------------------------------------------------------------------------------------
# Bad data: one line at start-up, exit 2, nothing written


def _bad_files(root):
    """name -> (prefix, expected message) for each kind of bad Megatron dataset."""
    out = {}

    def fresh(name, docs=([5, 6, 1], [7, 8, 1]) * 20, dtype=np.uint16):
        w = MegatronWriter(root / name, dtype)
        for d in docs:
            w.add(np.asarray(d))
        w.finish()
        return root / name

    p = fresh("short")
    os.truncate(f"{p}.bin", os.path.getsize(f"{p}.bin") - 3)
    out["short"] = (
        p,
        rf"error: {p}.bin: 237 bytes, but {p}.idx puts document 39 at bytes 234\.\.240 \(a truncated \.bin\?\)$",
    )
    p = fresh("magic")
    raw = bytearray(open(f"{p}.idx", "rb").read())
    raw[:9] = b"NOTMMIDX\x00"
    open(f"{p}.idx", "wb").write(raw)
    out["magic"] = (p, rf"error: {p}.idx: not a Megatron index")
    p = fresh("version")
    raw = bytearray(open(f"{p}.idx", "rb").read())
    raw[9:17] = struct.pack("<Q", 2)
    open(f"{p}.idx", "wb").write(raw)
    out["version"] = (p, rf"error: {p}.idx: Megatron index version 2; only version 1 is read")
    p = fresh("floats")
    raw = bytearray(open(f"{p}.idx", "rb").read())
    raw[17] = 7
    open(f"{p}.idx", "wb").write(raw)
    out["floats"] = (p, rf"error: {p}.idx: the tokens are float32; token ids must be integers")
    p = fresh("vocab", docs=[[5, 6, 1]] * 30 + [[5, 259, 1]], dtype=np.int32)
    out["vocab"] = (p, rf"error: {p}.bin: document 30 \(token 1\) holds token id 259, outside")
    return out


@pytest.mark.slow
def test_bad_megatron_data_fails_at_start_up_in_one_line(tmp_path):
    for name, (prefix, message) in _bad_files(tmp_path).items():
        workdir = tmp_path / f"w_{name}"
        proc = run_train(workdir, f"--config.data.path={prefix}", "--config.data.tokenizer=byte", check=False)
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and re.match(message, lines[0]), (name, lines)
        assert not workdir.exists(), name
    proc = run_train(tmp_path / "w", f"--config.data.path={tmp_path / 'magic'}", check=False)
    assert proc.returncode == 2 and "set config.data.tokenizer" in proc.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_megatron_dataset_trains_on_the_batches_of_the_prepared_documents(corpus, tmp_path):
    """`python -m zaya_jax.train` on the Megatron export and on `prepare`'s output of the same
    JSONL: bit-identical losses, train and eval."""
    common = [
        "--config.train.steps=4",
        "--config.data.eval_fraction=0.05",
        "--config.checkpoint.every_steps=100",
    ]
    run_train(tmp_path / "prepared", f"--config.data.path={corpus / 'prepared'}", *common)
    run_train(
        tmp_path / "megatron", f"--config.data.path={corpus / 'web'}", "--config.data.tokenizer=byte", *common
    )
    a, b = train_losses(tmp_path / "prepared"), train_losses(tmp_path / "megatron")
    assert sorted(a) == [1, 2, 3, 4] and a == b
    from zaya_jax.training.metrics import read_metrics

    evals = [[(r["step"], r["eval_loss"]) for r in read_metrics(str(tmp_path / w)) if r["split"] == "eval"]
             for w in ("prepared", "megatron")]  # fmt: skip
    assert evals[0] and evals[0] == evals[1]


@pytest.mark.slow
def test_kill_9_mid_mixture_of_megatron_and_prepared_resumes_with_identical_losses(corpus, tmp_path):
    from support.checkpoints import kill_9_after_step
    from support.train_runs import SMALL

    from zaya_jax.training.events import read_events

    code = write_jsonl(tmp_path / "code.jsonl", 40, 5, alphabet="0123456789+=")
    prepare_dataset([code], tmp_path / "code", eval_fraction=0.1)
    args = [f"--config.data.mixture={corpus / 'web'}:0.75,{tmp_path / 'code'}:0.25",
            "--config.data.tokenizer=byte", "--config.data.eval_fraction=0.05", "--config.train.steps=8",
            "--config.checkpoint.every_steps=2", "--config.fault.spike_zscore=0"]  # fmt: skip
    run_train(tmp_path / "ref", *args)
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py"),
           "--workdir", str(killed), *SMALL, *args]  # fmt: skip
    resumed_from = kill_9_after_step(cmd, killed, 4)
    assert resumed_from is not None and 2 <= resumed_from < 8
    run_train(killed, *args)
    assert read_events(str(killed), "resume")[-1]["step"] == resumed_from
    ref, got = train_losses(tmp_path / "ref"), train_losses(killed)
    assert sorted(got) == list(range(1, 9)) and got == ref


_OPEN_AND_READ = """
import sys
from zaya_jax.data.megatron import MegatronOptions, load_megatron_split
from zaya_jax.data.megatron_format import check_token_ids
from zaya_jax.data.pipeline import make_dataset

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) << 10

before = rss()
scanned = check_token_ids(sys.argv[1], 320)
options = MegatronOptions("byte")
num_docs = load_megatron_split(sys.argv[1], "train", options).num_docs
batches = iter(make_dataset(sys.argv[1], seq_len=128, global_batch_size=16, megatron=options))
for _ in range(20):
    next(batches)
print(scanned, num_docs, rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_start_up_keeps_a_1_gib_bin_out_of_the_process_memory(tmp_path):
    """The trainer's data start-up on a 1 GiB .bin (sparse: no disk used): the token-id scan, the
    train split and 20 batches leave the process' RSS within 256 MiB of where it was, so the
    tokens are read in place (memory-mapped; the scan reads through a 64 MiB buffer), not loaded."""
    doc_tokens, num_docs = 2048, (1 << 29) // 2048  # uint16: 1 GiB
    prefix = str(tmp_path / "big")
    with open(prefix + ".bin", "wb") as f:
        f.truncate(doc_tokens * num_docs * 2)  # zeros: the pad id, within any vocabulary
    code = {np.dtype(t): c for c, t in DTYPES.items()}[np.dtype(np.uint16)]
    with open(prefix + ".idx", "wb") as f:  # Megatron's documented layout (megatron_format's docstring)
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, code, num_docs, num_docs + 1))
        f.write(np.full(num_docs, doc_tokens, np.int32).tobytes())
        f.write((np.arange(num_docs, dtype=np.int64) * doc_tokens * 2).tobytes())
        f.write(np.arange(num_docs + 1, dtype=np.int64).tobytes())
    out = subprocess.run([sys.executable, "-c", _OPEN_AND_READ, prefix], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    scanned, train_docs, grown = map(int, out.stdout.split())
    assert scanned == 1 << 30 and train_docs == num_docs - num_docs // 100
    assert grown < 256 << 20, f"RSS grew by {grown / 2**20:.0f} MiB over a 1024 MiB .bin"
