"""lm-evaluation-harness (HF backend) as an outside client of an exported directory: the same acc,
acc_norm, per-choice log-likelihoods and rolling perplexity as `python -m zaya_jax.evaluate` with
the matching --prefix (lm-eval default <-> none, add_bos_token=True <-> bos). Offline: a local task
YAML over local JSONL files."""

import json

import numpy as np
import pytest
import torch
from eval_models import BYTE_CASE, TASK, orbax_from_hf, write_task
from hf_reference import random_hf_model

from zaya_jax.evaluate.__main__ import main as evaluate_main
from zaya_jax.export import export

MAX_LEN = 64  # several rolling windows per document
DOCS = [
    (
        "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in "
        "my purse, and nothing particular to interest me on shore, I thought I would sail about a little."
    ),
    "Ünïcödé — naïve café, 日本語, 🐋 whales.",
    "Short.",
]
MC_YAML = """task: zaya_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: zaya_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random model through the user's path: HF -> import_hf -> Orbax -> export (fp32)."""
    d = tmp_path_factory.mktemp("lm_eval")
    ref = random_hf_model(BYTE_CASE, eos_token_id=1)
    with torch.no_grad():  # transformers' from_pretrained resets the skip class's bias to -1 (as we train)
        for name, buf in ref.named_buffers():
            if name.endswith("balancing_biases"):
                buf[-1] = -1.0
    ref.save_pretrained(str(d / "random_hf"))
    export(orbax_from_hf(str(d / "random_hf"), str(d / "ckpt")), str(d / "hf"), dtype="float32")
    task, text = write_task(str(d / "task.jsonl")), str(d / "docs.jsonl")
    with open(text, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in DOCS)
    (d / "tasks").mkdir()
    (d / "tasks" / "zaya_mc.yaml").write_text(MC_YAML.format(path=task))
    (d / "tasks" / "zaya_ppl.yaml").write_text(PPL_YAML.format(path=text))
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
        task_manager=TaskManager(include_path=str(d / "tasks")),
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
