"""Weighted data mixtures (data.mixture) and the batch-size ramp (train.batch_ramp): proportions,
per-process sharding, no sequence lost or repeated, resumable state, config errors, and a kill -9
mid-mixture / mid-ramp training run that resumes with identical losses."""

import itertools
import json
import os
import sys

import numpy as np
import pytest
from support.batches import assert_batches_equal, take
from support.checkpoints import kill_9_after_step
from support.configs import load
from support.train_runs import ROOT, SMALL, run_train, train_losses

from zaya_jax import config as config_lib
from zaya_jax.data.mixture import mixed_sequences, parse_mixture
from zaya_jax.data.pipeline import (
    PackedSequences,
    batch_sequences,
    interleave_process_batches,
    load_documents,
)
from zaya_jax.data.prepare import prepare_dataset
from zaya_jax.data.ramp import BatchRamp, parse_batch_ramp
from zaya_jax.training.events import read_events
from zaya_jax.training.metrics import read_metrics

# Two sources told apart by their alphabets: every row of a batch shows which one it came from.
ALPHABETS = {"web": "abcdefgh ", "code": "0123456789+="}


def write_source(root, name, num_docs, seed):
    rng = np.random.default_rng(seed)
    text = root / f"{name}.jsonl"
    with open(text, "w") as f:
        for _ in range(num_docs):
            doc = "".join(rng.choice(list(ALPHABETS[name]), size=int(rng.integers(20, 300))))
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset([text], root / name, eval_fraction=0.1)
    return root / name


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prepared byte-level datasets of different sizes: web (~350 sequences of 32) and code (~50)."""
    root = tmp_path_factory.mktemp("mixture")
    return write_source(root, "web", 80, 0), write_source(root, "code", 12, 1)


def spec(web, code, w_web=0.75, w_code=0.25):
    return f"{web}:{w_web},{code}:{w_code}"


def row_source(row):
    """'web' or 'code' from the bytes of one row (special ids 0..2 are shared)."""
    chars = {chr(t - 3) for t in row.tolist() if t >= 3}
    (name,) = [n for n, alphabet in ALPHABETS.items() if chars <= set(alphabet)]
    return name


def mixture_batches(mix_spec, n, *, ramp=None, batch=8, process_index=0, process_count=1, seed=0):
    mix = mixed_sequences(parse_mixture(mix_spec), seq_len=32, seed=seed)
    ds = batch_sequences(
        mix, global_batch_size=batch, process_index=process_index, process_count=process_count, ramp=ramp
    )
    return mix, take(ds, n)


# ------------------------------------------------------------------------------------------------
# Mixtures


@pytest.mark.parametrize("weights", [(0.75, 0.25), (0.4, 0.6)])
def test_mixture_proportions_and_every_source_in_order(sources, weights):
    web, code = sources
    mix, batches = mixture_batches(spec(web, code, *weights), 50)  # 400 sequences
    rows = np.concatenate([b["input_ids"] for b in batches])
    names = [row_source(r) for r in rows]
    mask = np.concatenate([b["loss_mask"] for b in batches])
    for k, (name, w) in enumerate(zip(("web", "code"), weights)):
        mine = np.array([n == name for n in names])
        assert abs(mine.mean() - w) <= 0.02  # sequences
        assert abs(mask[mine].sum() / mask.sum() - w) <= 0.02  # real (non-padding) tokens
        # every source's own packed sequences, in order: none skipped or repeated, and the
        # mixture/<name> count (closed form) is what was drawn
        assert mix.counts(len(rows))[k] == mine.sum()
        expected = np.stack([mix.sequences[k][j]["input_ids"] for j in range(mine.sum())])
        np.testing.assert_array_equal(rows[mine], expected)
    # the small source has gone round more than once (each epoch packed and reshuffled on its own)
    assert mix.counts(len(rows))[1] > mix.sequences[1].sequences_per_epoch
    assert mix.sequences[1].docs.num_tokens == load_documents(code, "train").num_tokens


def test_mixture_is_deterministic_by_seed_and_short_spans_stay_proportional(sources):
    web, code = sources
    _, a = mixture_batches(spec(web, code), 6, seed=3)
    _, b = mixture_batches(spec(web, code), 6, seed=3)
    _, c = mixture_batches(spec(web, code), 6, seed=4)
    assert_batches_equal(a, b)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    # systematic interleaving: every batch of 8 holds 6 web rows and 2 code rows (no sampling noise)
    for batch in a + c:
        assert sorted(row_source(r) for r in batch["input_ids"]) == ["code"] * 2 + ["web"] * 6


@pytest.mark.parametrize("ramp_spec", [None, "2,2,24"])
def test_mixture_two_processes_equal_one(sources, ramp_spec):
    web, code = sources
    ramp = None if ramp_spec is None else parse_batch_ramp(ramp_spec, 8)
    _, single = mixture_batches(spec(web, code), 10, ramp=ramp)
    local = [
        mixture_batches(spec(web, code), 10, ramp=ramp, process_index=p, process_count=2)[1] for p in (0, 1)
    ]
    for step in range(10):
        per_process = [local[p][step] for p in (0, 1)]
        assert all(len(b["input_ids"]) * 2 == len(single[step]["input_ids"]) for b in per_process)
        assert_batches_equal([interleave_process_batches(per_process)], [single[step]])


def test_mixture_config_errors(sources, tmp_path):
    web, code = sources
    other = tmp_path / "hf"
    other.mkdir()
    (other / "docs.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.WordLevel(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(["a b"], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    hf.save(str(other / "tokenizer.json"))
    prepare_dataset(
        [other / "docs.jsonl"], other / "words", tokenizer=other / "tokenizer.json", eval_fraction=0
    )
    cases = [
        (f"{web}:0.5,{other / 'words'}:0.5",
         f"config.data.mixture: {web} and {other / 'words'} were prepared with different tokenizers"),
        (f"{web}:0.5,{tmp_path}:0.5", f"config.data.mixture: {tmp_path} is not a prepared dataset"),
        (f"{web}:0.5,{code}", "config.data.mixture: .*expected PATH:WEIGHT"),
        (f"{web}:0.5,{code}:-1", "config.data.mixture: .*weight > 0"),
        (f"{web}:1,{web}/:1", "config.data.mixture: two sources are named 'web'"),
    ]  # fmt: skip
    for mix, message in cases:
        c = load("tiny")
        c.data.mixture = mix
        with pytest.raises(ValueError, match=message):
            config_lib.validate(c)
    c = load("tiny")
    c.data.mixture, c.data.path = spec(web, code), str(web)
    with pytest.raises(ValueError, match="config.data.mixture: set either data.path or data.mixture"):
        config_lib.validate(c)
    assert [(s.name, s.weight) for s in parse_mixture(f"{web}:3,{code}:1")] == [("web", 0.75), ("code", 0.25)]


# ------------------------------------------------------------------------------------------------
# Batch-size ramp


def megatron_sizes(start, increment, ramp_sequences, full, steps):
    """Megatron-LM's RampupBatchsizeNumMicroBatches.update, written out: the reference rule."""
    per_increment = ramp_sequences / ((full - start) // increment)
    consumed, out = 0, []
    for _ in range(steps):
        size = full if consumed > ramp_sequences else start + int(consumed / per_increment) * increment
        out.append(size)
        consumed += size
    return out


@pytest.mark.parametrize(
    "start, increment, ramp_sequences, full",
    [(8, 8, 64, 32), (2, 2, 10, 16), (16, 8, 7, 64), (3, 1, 50, 9), (1024, 1024, 1_000_000, 4096)],
)
def test_ramp_sizes_are_megatrons_monotone_from_start_to_full(start, increment, ramp_sequences, full):
    ramp = BatchRamp.create(start, increment, ramp_sequences, full)
    n = max(400, ramp.segments[-1][0] + 5)
    sizes = [ramp.size(k) for k in range(n)]
    assert sizes == megatron_sizes(start, increment, ramp_sequences, full, n)
    assert sizes[0] == start and sizes[-1] == full
    assert all(a <= b for a, b in itertools.pairwise(sizes))
    assert [ramp.consumed(k) for k in range(n)] == np.cumsum([0] + sizes[:-1]).tolist()
    assert list(ramp.sizes) == sorted(set(sizes))


def test_ramp_parse_and_divisibility_errors():
    assert parse_batch_ramp(None, 16).sizes == (16,) and parse_batch_ramp("16,4,100", 16).sizes == (16,)
    assert parse_batch_ramp("4, 4, 1_000", 16).sizes == (4, 8, 12, 16)
    for bad, message in [
        ("4,4", "three ints"),
        ("a,4,100", "three ints"),
        ("0,4,100", "START must be an int >= 1"),
        ("32,4,100", "START=32 exceeds train.batch_size=16"),
        ("4,5,100", "not a multiple of INCREMENT=5"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_batch_ramp(bad, 16)
    with pytest.raises(ValueError, match="batch size 6 .* over the 4 devices"):
        parse_batch_ramp("4,2,20", 8).check_divisible(4, 1)
    c = load("tiny")
    c.train.batch_ramp, c.train.grad_accum = "4,2,64", 4
    message = "config.train.batch_ramp: batch size 6 of the ramp is not divisible"
    with pytest.raises(ValueError, match=message):
        config_lib.validate(c)
    c.train.batch_ramp = "4,2"
    with pytest.raises(ValueError, match="config.train.batch_ramp: .*START,INCREMENT,RAMP_SEQUENCES"):
        config_lib.validate(c)


def test_ramp_batches_lose_and_repeat_no_sequence(sources):
    web, _ = sources
    seqs = PackedSequences(load_documents(web, "train"), seq_len=32, seed=9)
    ramp = parse_batch_ramp("2,2,24", 8)
    batches = take(batch_sequences(seqs, global_batch_size=8, ramp=ramp), 12)
    sizes = [len(b["input_ids"]) for b in batches]
    assert sizes == [ramp.size(k) for k in range(12)] == [2] * 4 + [4] * 2 + [6] * 2 + [8] * 4
    rows = np.concatenate([b["input_ids"] for b in batches])
    np.testing.assert_array_equal(rows, np.stack([seqs[i]["input_ids"] for i in range(ramp.consumed(12))]))
    # a constant "ramp" (START = full) batches exactly like the fixed-size pipeline
    assert_batches_equal(
        take(batch_sequences(seqs, global_batch_size=8, ramp=parse_batch_ramp("8,4,64", 8)), 4),
        take(batch_sequences(seqs, global_batch_size=8), 4),
    )


def test_ramp_and_mixture_iterator_state_round_trip(sources):
    web, code = sources
    ramp = parse_batch_ramp("2,2,24", 8)
    mix = mixed_sequences(parse_mixture(spec(web, code)), seq_len=32, seed=2)
    it = iter(batch_sequences(mix, global_batch_size=8, ramp=ramp))
    take(it, 5)  # mid-ramp: batch 5 is the second of size 4
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 6)
    resumed = iter(batch_sequences(mixed_sequences(parse_mixture(spec(web, code)), seq_len=32, seed=2),
                                   global_batch_size=8, ramp=ramp))  # fmt: skip
    resumed.set_state(state)
    assert_batches_equal(take(resumed, 6), expected)


# ------------------------------------------------------------------------------------------------
# Training end to end


def test_the_zaya1_phases_carry_a_mixture_and_a_ramp(sources, tmp_path):
    web, code = sources
    p1 = load("zaya1_base", "phase1")
    assert p1.data.mixture is None and p1.train.batch_ramp  # the embedded corpus until data= is given
    ramp = parse_batch_ramp(p1.train.batch_ramp, p1.train.batch_size)
    assert ramp.sizes[0] < ramp.sizes[-1] == p1.train.batch_size
    root = tmp_path / "datasets"
    root.mkdir()
    for name in ("web", "code", "math", "reasoning", "long"):  # the placeholder source names
        os.symlink(web if name != "code" else code, root / name)
    mixes = []
    for phase in ("phase1", "phase2", "phase3"):
        c = load("zaya1_base", f"{phase},data={root}")
        config_lib.validate(c)
        mixes.append({s.name: s.weight for s in parse_mixture(c.data.mixture)})
    assert mixes[1]["web"] < mixes[0]["web"]  # phase 2 leans towards maths / code / reasoning
    assert "long" in mixes[2]


def test_a_ramp_that_does_not_divide_over_the_mesh_fails_at_start_up(tmp_path):
    proc = run_train(tmp_path / "w", "--config.train.batch_ramp=4,2,16", devices=4, check=False)
    assert proc.returncode != 0
    assert "config.train.batch_ramp='4,2,16': batch size 6 (per microbatch 6)" in proc.stderr
    assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.slow
def test_kill_9_mid_mixture_and_mid_ramp_resumes_with_identical_losses(sources, tmp_path):
    web, code = sources
    args = [
        f"--config.data.mixture={spec(web, code)}",
        "--config.train.batch_ramp=2,2,24",  # sizes 2 x4, 4 x2, 6 x2, then 8 (steps 9, 10)
        "--config.train.steps=10",
        "--config.checkpoint.every_steps=2",
        "--config.fault.spike_zscore=0",
    ]
    ref = tmp_path / "ref"
    out = run_train(ref, *args)
    assert "data.mixture: 44 sequences over the run" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    assert summary["batch_sizes"] == [2, 4, 6, 8] and summary["train_programs"] == 4
    killed = tmp_path / "killed"
    resumed_from = kill_9_after_step(_train_cmd(killed, *args), killed, 5)
    assert resumed_from is not None and 2 <= resumed_from <= 6  # mid-ramp: the full batch starts at step 9
    run_train(killed, *args)
    assert read_events(str(killed), "resume")[-1]["step"] == resumed_from
    ref_losses, got = train_losses(ref), train_losses(killed)
    assert sorted(got) == list(range(1, 11))
    for s in range(1, 11):
        assert got[s] == ref_losses[s], (s, got[s], ref_losses[s])

    records = {r["step"]: r for r in read_metrics(str(killed), split="train")}
    sizes = [records[s]["batch_size"] for s in range(1, 11)]
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
    assert [records[s]["tokens_seen"] for s in range(1, 11)] == (np.cumsum(sizes) * 32).tolist()
    for s in range(1, 11):  # tokens drawn per source add up, within one sequence of 0.75 / 0.25
        web_tokens, code_tokens = records[s]["mixture/web"], records[s]["mixture/code"]
        assert web_tokens + code_tokens == records[s]["tokens_seen"]
        assert abs(web_tokens - 0.75 * records[s]["tokens_seen"]) < 32
    evals = [[r for r in read_metrics(str(w)) if r["split"] == "eval"] for w in (ref, killed)]
    assert [r["step"] for r in evals[1]] == [3, 6, 9, 10]
    for a, b in zip(*evals):
        assert {k: v for k, v in a.items() if k != "time"} == {k: v for k, v in b.items() if k != "time"}
    last = evals[1][-1]
    assert last["eval_loss"] == pytest.approx(0.75 * last["eval_loss/web"] + 0.25 * last["eval_loss/code"])


def _train_cmd(workdir, *extra):
    return [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py"),
            "--workdir", str(workdir), *SMALL, *extra]  # fmt: skip
