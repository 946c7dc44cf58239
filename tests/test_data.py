"""Tests for zaya_jax.data: embedded corpus, prepare CLI, and the grain packing pipeline."""

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.batches import KEYS, assert_batches_equal, take
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from zaya_jax.data import EMBEDDED_EVAL_FRACTION, EMBEDDED_SPLIT_SEED, load_embedded_corpus, split_documents
from zaya_jax.data.pipeline import (
    Lookahead,
    PackedSequences,
    interleave_process_batches,
    load_documents,
    make_dataset,
    make_eval_dataset,
    source_tokenizer,
)
from zaya_jax.data.prepare import prepare_dataset
from zaya_jax.data.prepared import TokenDocuments, load_split
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_prepare(*args):
    return subprocess.run(
        [sys.executable, "-m", "zaya_jax.data.prepare", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def split_texts(data_dir, split, tok):
    """Decoded documents of a prepared split (each stored document ends with exactly one EOS)."""
    docs = load_split(data_dir, split)
    out = []
    for d in range(docs.num_docs):
        ids = docs.doc_tokens(d).astype(np.int64)
        assert ids[-1] == tok.eos_id and tok.eos_id not in ids[:-1]
        out.append(tok.decode(ids[:-1]))
    return out


def synthetic_docs(n=60, seed=0):
    """Distinct documents from 1 to ~300 bytes, so some are longer than the test seq_len."""
    rng = np.random.default_rng(seed)
    return [
        f"doc{i:03d} " + "".join(rng.choice(list("abcdefgh "), size=int(rng.integers(0, 300))))
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def byte_data_dir(tmp_path_factory):
    """A prepared byte-level dataset of synthetic_docs() (train) plus a held-out split."""
    tmp = tmp_path_factory.mktemp("byte_data")
    with open(tmp / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in synthetic_docs())
    prepare_dataset([tmp / "docs.jsonl"], tmp / "data", eval_fraction=0.1, shard_tokens=2000)
    return tmp / "data"


# ------------------------------------------------------------------------------------------------
# Embedded corpus


def test_embedded_corpus_loads_and_split_is_disjoint():
    docs = load_embedded_corpus()
    assert docs == load_embedded_corpus()  # deterministic
    assert sum(len(d.encode("utf-8")) for d in docs) >= 200_000
    assert len(docs) >= 200 and all(d.strip() for d in docs)
    assert any("Call me Ishmael" in d for d in docs)
    train, held_out = split_documents(docs, EMBEDDED_EVAL_FRACTION, EMBEDDED_SPLIT_SEED)
    assert held_out and len(train) + len(held_out) == len(docs)
    assert collections.Counter(train) + collections.Counter(held_out) == collections.Counter(docs)
    assert not set(train) & set(held_out)
    # Different seeds hold out different documents, each the right amount.
    _, other = split_documents(docs, 0.1, seed=1)
    assert abs(len(other) - 0.1 * len(docs)) <= 1 and set(other) != set(split_documents(docs, 0.1, 2)[1])


def test_embedded_pipeline_batches_and_eval():
    ds = make_dataset(None, seq_len=64, global_batch_size=4, seed=0)
    batch = next(iter(ds))
    assert set(batch) == KEYS
    assert batch["input_ids"].shape == (4, 64) and batch["input_ids"].dtype == np.int32
    assert batch["targets"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])
    assert isinstance(source_tokenizer(None), ByteTokenizer)

    eval_batches = list(make_eval_dataset(None, seq_len=1024, global_batch_size=8))
    held_out = load_documents(None, "eval")
    mask = np.concatenate([b["loss_mask"].ravel() for b in eval_batches])
    assert mask.sum() == held_out.num_tokens  # one full pass, nothing more
    assert eval_batches[-1]["loss_mask"][-1].sum() < 1024  # last batch is padded

    def doc_bytes(docs):
        return {np.asarray(docs.doc_tokens(d)).tobytes() for d in range(docs.num_docs)}

    assert not doc_bytes(held_out) & doc_bytes(load_documents(None, "train"))


# ------------------------------------------------------------------------------------------------
# prepare CLI


def test_prepare_cli_byte_txt_and_jsonl(tmp_path):
    (tmp_path / "book.txt").write_text("First paragraph.\n\nSecond — non-ASCII é.\n\n\n\nThird.\n")
    with open(tmp_path / "web.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"json document {i}", "id": i}) + "\n" for i in range(10))
        f.write("\n")  # blank lines are skipped
    out = tmp_path / "data"
    r = run_prepare(
        "--input",
        tmp_path / "book.txt",
        tmp_path / "web.jsonl",
        "--out",
        out,
        "--doc-separator",
        "blank-line",
        "--eval-fraction",
        "0.25",
        "--shard-tokens",
        "40",
    )
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout and "eval" in r.stdout

    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == {"name": "byte", "vocab_size": 259, "eos_id": 1, "pad_id": 0, "bos_id": 2}
    train, held_out = meta["splits"]["train"], meta["splits"]["eval"]
    assert train["num_docs"] + held_out["num_docs"] == 13 and held_out["num_docs"] in (3, 4)
    assert len(train["shards"]) > 1  # --shard-tokens respected
    tok = load_tokenizer(out)
    assert isinstance(tok, ByteTokenizer)
    texts = split_texts(out, "train", tok) + split_texts(out, "eval", tok)
    expected = ["First paragraph.", "Second — non-ASCII é.", "Third.\n"] + [
        f"json document {i}" for i in range(10)
    ]
    assert sorted(texts) == sorted(expected)
    assert train["num_tokens"] == load_split(out, "train").num_tokens
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left

    # Whole-file documents by default; an existing output needs --overwrite.
    assert run_prepare("--input", tmp_path / "book.txt", "--out", out).returncode != 0
    r = run_prepare("--input", tmp_path / "book.txt", "--out", out, "--overwrite", "--eval-fraction", "0")
    assert r.returncode == 0, r.stderr
    assert split_texts(out, "train", tok) == [(tmp_path / "book.txt").read_text()]


def test_prepare_cli_hf_tokenizer(tmp_path):
    words = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"]
    hf = Tokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": words[i % 3]}) + "\n" for i in range(20))
    out = tmp_path / "data"
    r = run_prepare(
        "--input",
        tmp_path / "docs.jsonl",
        "--out",
        out,
        "--tokenizer",
        tmp_path / "tokenizer.json",
        "--eval-fraction",
        "0.2",
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    expected = HFTokenizer(tmp_path / "tokenizer.json")
    assert meta["tokenizer"]["name"] == expected.name
    assert (meta["tokenizer"]["eos_id"], meta["tokenizer"]["pad_id"]) == (1, 0)
    assert meta["splits"]["eval"]["num_docs"] == 4
    tok = source_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and tok.name == expected.name
    assert sorted(split_texts(out, "train", tok) + split_texts(out, "eval", tok)) == sorted(
        words[i % 3] for i in range(20)
    )
    batch = next(iter(make_dataset(out, seq_len=8, global_batch_size=2)))
    assert batch["input_ids"].max() < tok.vocab_size


def test_prepare_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    r = run_prepare("--input", good, bad, "--out", tmp_path / "data")
    assert r.returncode != 0 and "bad.jsonl:2" in r.stderr and "'text'" in r.stderr
    bad.write_text('{"text": "ok"}\n\n{broken\n')
    r = run_prepare("--input", good, bad, "--out", tmp_path / "data")
    assert r.returncode != 0 and "bad.jsonl:3" in r.stderr and "invalid JSON" in r.stderr
    r = run_prepare("--input", good, tmp_path / "missing.txt", "--out", tmp_path / "data")
    assert r.returncode != 0 and "missing.txt" in r.stderr
    # A failed run leaves neither the dataset nor its temporary directory behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl"]
    with pytest.raises(FileNotFoundError, match="not a prepared dataset"):
        load_split(tmp_path, "train")


# ------------------------------------------------------------------------------------------------
# Packing


def epoch_batches(source, seq_len, batch_size, **kwargs):
    return list(make_dataset(source, seq_len=seq_len, global_batch_size=batch_size, num_epochs=1, **kwargs))


def test_packing_no_loss_no_duplication_over_an_epoch(byte_data_dir):
    seq_len, tok = 32, ByteTokenizer()
    docs = load_split(byte_data_dir, "train")
    batches = epoch_batches(byte_data_dir, seq_len, 4, seed=3)
    inputs = np.concatenate([b["input_ids"] for b in batches])  # [N, S] in global sequence order
    targets = np.concatenate([b["targets"] for b in batches])
    mask = np.concatenate([b["loss_mask"] for b in batches])

    # The masked targets, in order, are exactly the epoch's documents (each + EOS) in the shuffled order.
    stream = targets[mask == 1]
    assert len(stream) == docs.num_tokens
    order = PackedSequences(docs, seq_len=seq_len, seed=3).epoch_order(0)
    assert sorted(order.tolist()) == list(range(docs.num_docs)) and order.tolist() != sorted(order.tolist())
    expected = np.concatenate([docs.doc_tokens(d) for d in order]).astype(np.int32)
    np.testing.assert_array_equal(stream, expected)
    # Equivalently as a multiset of documents: every train document once, whole.
    pieces = [tok.decode(p) for p in np.split(stream, np.flatnonzero(stream == tok.eos_id) + 1)[:-1]]
    assert collections.Counter(pieces) == collections.Counter(split_texts(byte_data_dir, "train", tok))

    # Inputs are the targets shifted by one; the epoch starts after an EOS.
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert inputs[0, 0] == tok.eos_id
    # Only the tail of the epoch's last real sequence and the batch-filling rows are padding.
    real = int(np.ceil(docs.num_tokens / seq_len))
    assert mask[: real - 1].all() and not mask[real:].any() and len(mask) % 4 == 0
    assert (targets[mask == 0] == tok.pad_id).all()


def test_documents_split_only_at_sequence_boundaries(byte_data_dir):
    seq_len = 16  # many documents are longer than one sequence
    batches = epoch_batches(byte_data_dir, seq_len, 2, seed=0)
    inputs = np.concatenate([b["input_ids"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    mask = np.concatenate([b["loss_mask"] for b in batches])
    real = int(mask.any(axis=1).sum())
    # A document cut at the end of sequence i continues at the start of sequence i + 1: the first
    # input of each sequence is the last target of the previous one, so no token is skipped.
    np.testing.assert_array_equal(inputs[1:real, 0], targets[: real - 1, -1])
    # No padding or truncation inside the epoch: every position before the final tail is a target.
    assert mask[: real - 1].all()


def test_packing_epochs_are_complete_and_reshuffled():
    tok = ByteTokenizer()
    texts = synthetic_docs(n=25, seed=1)
    docs = TokenDocuments.from_token_lists(
        tok.encode_batch(texts), eos_id=tok.eos_id, pad_id=tok.pad_id, vocab_size=tok.vocab_size
    )
    seqs = PackedSequences(docs, seq_len=40, seed=7, num_epochs=3, pad_to_multiple=8)
    assert len(seqs) % 8 == 0 and len(seqs) >= 3 * seqs.sequences_per_epoch
    n = seqs.sequences_per_epoch
    for epoch in range(3):
        items = [seqs[epoch * n + i] for i in range(n)]
        stream = np.concatenate([x["targets"][x["loss_mask"] == 1] for x in items])
        order = seqs.epoch_order(epoch)
        np.testing.assert_array_equal(stream, np.concatenate([docs.doc_tokens(d) for d in order]))
    assert seqs.epoch_order(0).tolist() != seqs.epoch_order(1).tolist()
    assert seqs[len(seqs) - 1]["loss_mask"].sum() == 0  # batch-filling row


# ------------------------------------------------------------------------------------------------
# Determinism, sharding, checkpointing


def test_determinism_by_seed(byte_data_dir):
    make = lambda seed: make_dataset(byte_data_dir, seq_len=32, global_batch_size=4, seed=seed)
    first = take(make(0), 12)
    assert_batches_equal(first, take(make(0), 12))
    other = take(make(1), 12)
    assert any(not np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other))


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_union_is_global_batch(byte_data_dir, process_count):
    kwargs = dict(seq_len=32, global_batch_size=8, seed=5)
    global_batches = take(make_dataset(byte_data_dir, **kwargs), 6)
    local = [
        take(make_dataset(byte_data_dir, process_index=p, process_count=process_count, **kwargs), 6)
        for p in range(process_count)
    ]
    for step in range(6):
        per_process = [local[p][step] for p in range(process_count)]
        assert all(b["input_ids"].shape == (8 // process_count, 32) for b in per_process)
        assert_batches_equal([interleave_process_batches(per_process)], [global_batches[step]])
    # Finite datasets: every process yields the same number of batches (no multi-host deadlock).
    counts = {
        len(epoch_batches(byte_data_dir, 32, 8, process_index=p, process_count=process_count))
        for p in range(process_count)
    }
    assert len(counts) == 1
    with pytest.raises(ValueError, match="divisible"):
        make_dataset(byte_data_dir, seq_len=32, global_batch_size=6, process_count=4)


def test_iterator_state_round_trip(byte_data_dir):
    # seq_len 256: an epoch is ~9 batches, so the resumed run crosses into the (reshuffled) next epoch.
    ds = make_dataset(byte_data_dir, seq_len=256, global_batch_size=4, seed=11)
    it = iter(ds)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 5)

    resumed = iter(make_dataset(byte_data_dir, seq_len=256, global_batch_size=4, seed=11))
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 5), expected)
    assert_batches_equal(take(ds, 12)[7:], expected)  # and equal to an uninterrupted run


def test_eval_dataset_is_finite_and_padded(byte_data_dir):
    held_out = load_split(byte_data_dir, "eval")
    assert held_out.num_docs > 0
    batches = list(make_eval_dataset(byte_data_dir, seq_len=16, global_batch_size=4))
    assert_batches_equal(batches, list(make_eval_dataset(byte_data_dir, seq_len=16, global_batch_size=4)))
    targets = np.concatenate([b["targets"] for b in batches])
    mask = np.concatenate([b["loss_mask"] for b in batches])
    expected = np.concatenate([held_out.doc_tokens(d) for d in range(held_out.num_docs)])
    np.testing.assert_array_equal(targets[mask == 1], expected)  # stored order, one pass
    assert mask[-1].sum() < 16


class _Iter:
    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return self.i

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def test_lookahead_keeps_the_peeked_batch_and_its_position():
    it = Lookahead(_Iter())
    assert next(it) == 1 and it.get_state() == {"i": 1}
    assert it.peek() == 2 and it.peek() == 2
    assert it.get_state() == {"i": 1}  # a checkpoint now resumes at the peeked batch
    assert next(it) == 2 and it.get_state() == {"i": 2} and next(it) == 3
    it.peek()
    it.set_state({"i": 0})  # a rollback drops the peeked batch
    assert next(it) == 1
