"""lm-evaluation-harness (HF backend) as an outside client of an exported directory: the same acc,
acc_norm, per-choice log-likelihoods and rolling perplexity as `python -m zaya_jax.evaluate` with
the matching --prefix (lm-eval default <-> none, add_bos_token=True <-> bos). Offline: a local task
YAML over local JSONL files."""

import json

import numpy as np
import pytest
from support.eval_models import TASK, orbax_from_hf, random_byte_model, write_harness_tasks

from zaya_jax.evaluate.__main__ import main as evaluate_main
from zaya_jax.export import export

MAX_LEN = 64  # several rolling windows per document


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random model through the user's path: HF -> import_hf -> Orbax -> export (fp32)."""
    d = tmp_path_factory.mktemp("lm_eval")
    random_byte_model().save_pretrained(str(d / "random_hf"))
    export(orbax_from_hf(str(d / "random_hf"), str(d / "ckpt")), str(d / "hf"), dtype="float32")
    write_harness_tasks(d)
    return d


def run_lm_eval(d, monkeypatch, extra_args=""):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(d / "datasets_cache"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={d / 'hf'},dtype=float32,max_length={MAX_LEN}{extra_args}",
        tasks=["zaya_mc", "zaya_ppl"],
        task_manager=TaskManager(include_path=str(d / "tasks"), include_defaults=False),
        device="cpu",
        batch_size=1,
        log_samples=True,
    )
    return out["results"], out["samples"]


def run_ours(d, prefix):
    samples = d / f"samples_{prefix}.jsonl"
    out = evaluate_main(
        [
            "--checkpoint", str(d / "hf"), "--data", str(d / "task.jsonl"), "--data", str(d / "docs.jsonl"),
            "--prefix", prefix, "--max-len", str(MAX_LEN), "--mesh", "none", "--quiet",
            "--samples-out", str(samples),
        ]
    )  # fmt: skip
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return out["results"], rows


def compare_choices(theirs, their_samples, ours, our_rows) -> dict:
    """Asserts the multiple-choice agreement; returns (lm-eval, ours) acc and acc_norm, worst |dlogL|."""
    mc = sorted(their_samples["zaya_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(our_rows) == len(TASK)
    worst = 0.0
    for s, row in zip(mc, our_rows):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        worst = max(worst, float(np.max(np.abs(np.array(lls) - row["loglikelihoods"]))))
    assert worst < 1e-4, worst
    table = {"worst_loglik_diff": worst}
    for metric in ("acc", "acc_norm"):
        table[metric] = (theirs["zaya_mc"][f"{metric},none"], ours["task"][metric])
        assert table[metric][0] == pytest.approx(table[metric][1], abs=1e-12), metric
    return table


def compare_perplexity(theirs, their_samples, ours) -> dict:
    """Asserts the rolling-perplexity agreement; returns (lm-eval, ours) per metric."""
    ppl, mine = theirs["zaya_ppl"], ours["docs"]
    their_nll = -sum(float(s["filtered_resps"][0]) for s in their_samples["zaya_ppl"])
    assert their_nll == pytest.approx(mine["nll"], rel=1e-5, abs=1e-4)
    table = {}
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        table[metric] = (ppl[f"{metric},none"], mine[metric])
        assert table[metric][0] == pytest.approx(table[metric][1], rel=1e-5), metric
    return table


@pytest.mark.slow
def test_lm_eval_default_matches_prefix_none_and_add_bos_matches_prefix_bos(exported, monkeypatch):
    d = exported
    theirs, their_samples = run_lm_eval(d, monkeypatch)
    ours, rows_none = run_ours(d, "none")
    table = compare_choices(theirs, their_samples, ours, rows_none)
    table.update(compare_perplexity(theirs, their_samples, ours))
    print("lm-eval default vs --prefix none (lm-eval, ours):", table)

    # add_bos_token=True: every context starts with BOS. Rolling perplexity then scores a BOS the
    # tokenizer put at the document's start after lm-eval's own prefix, so only the choices compare.
    theirs, their_samples = run_lm_eval(d, monkeypatch, ",add_bos_token=True")
    ours, rows = run_ours(d, "bos")
    print("lm-eval add_bos_token=True vs --prefix bos:", compare_choices(theirs, their_samples, ours, rows))
    # the two pairs are told apart: the BOS changes every non-empty context's scores
    gap = max(
        abs(a - b) for x, y in zip(rows, rows_none) for a, b in zip(x["loglikelihoods"], y["loglikelihoods"])
    )
    assert gap > 1e-2, gap
