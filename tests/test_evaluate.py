"""`python -m zaya_jax.evaluate` end to end: against the PyTorch model, on a data=2 x expert=4 mesh,
from an Orbax checkpoint and from an HF directory, and its errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.eval_models import TASK, TEXT, orbax_from_hf, save_byte_hf_model, write_task, write_text

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.evaluate import evaluate, parse_data_spec, parse_mesh
from zaya_jax.evaluate.__main__ import main as evaluate_main

OPTS = dict(max_len=48, min_bucket=16, separator="blank-line")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    ref = save_byte_hf_model(str(d / "hf"))
    data = [write_task(str(d / "task.jsonl")), write_text(str(d / "moby.txt"))]
    single = evaluate(str(d / "hf"), data, mesh="none", **OPTS)
    return d, ref, data, single


def torch_loglik(ref, context: str, choice: str) -> float:
    """The continuation's log-likelihood from transformers, one unpadded sequence, lm-eval's split."""
    tok = ByteTokenizer()
    stripped = context.rstrip()
    ctx = [tok.eos_id, *tok.encode(stripped)]
    cont = tok.encode(context[len(stripped) :] + " " + choice)
    ids = torch.as_tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(ref(ids).logits[0].double(), -1)
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_per_choice_loglikelihoods_match_pytorch(setup):
    _, ref, _, single = setup
    samples = single["samples"]["task"]
    assert len(samples) == len(TASK)
    worst = 0.0
    for row, s in zip(TASK, samples):
        want = [torch_loglik(ref, row["context"], c) for c in row["choices"]]
        worst = max(worst, float(np.max(np.abs(np.array(s["loglikelihoods"]) - want))))
        assert s["pred"] == int(np.argmax(want))
    assert worst < 1e-4, worst
    m = single["results"]["task"]
    assert m["acc"] == np.mean([s["pred"] == r["answer"] for s, r in zip(samples, TASK)])


def test_perplexity_matches_pytorch(setup):
    _, ref, _, single = setup
    tok = ByteTokenizer()
    nll, tokens = 0.0, 0
    for doc in TEXT.split("\n\n"):  # disjoint windows predicting 48 tokens each, lm-eval style
        seq = [tok.eos_id, *tok.encode(doc)]
        for first in range(1, len(seq), 48):  # predict seq[first:end] reading seq[lo:end-1]
            end = min(first + 48, len(seq))
            lo = max(0, end - 1 - 48)
            ids = seq[lo:end]
            with torch.no_grad():
                logp = torch.log_softmax(ref(torch.as_tensor([ids[:-1]])).logits[0].double(), -1)
            for j in range(first - lo - 1, len(ids) - 1):
                nll -= float(logp[j, ids[j + 1]])
                tokens += 1
    m = single["results"]["moby"]
    assert m["tokens"] == tokens == len(TEXT.encode()) - 4  # the two blank-line separators
    np.testing.assert_allclose(m["nll"], nll, rtol=1e-5)
    assert single["compilations"] <= len(single["buckets"]) == 3  # one per bucket (16, 32, 48) at most


@pytest.mark.slow
def test_orbax_checkpoint_on_a_data2_expert4_mesh_equals_single_device(setup, tmp_path):
    d, _, data, single = setup
    ckpt = orbax_from_hf(str(d / "hf"), str(tmp_path / "run"))
    mesh = evaluate(ckpt, data, mesh="data=2,expert=4", **OPTS)
    assert mesh["source"] == "orbax" and mesh["mesh"] == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}
    assert mesh["batch_size"] == 8 and mesh["prefix_id"] == single["prefix_id"] == 1
    for a, b in zip(mesh["samples"]["task"], single["samples"]["task"]):
        np.testing.assert_allclose(a["loglikelihoods"], b["loglikelihoods"], rtol=1e-5, atol=1e-5)
        assert (a["pred"], a["pred_norm"], a["is_greedy"]) == (b["pred"], b["pred_norm"], b["is_greedy"])
    for task in ("task", "moby"):
        for key, value in single["results"][task].items():
            if key != "seconds" and not isinstance(value, str):
                np.testing.assert_allclose(mesh["results"][task][key], value, rtol=1e-5, err_msg=key)


def test_cli_writes_results_and_samples(setup, tmp_path, capsys):
    d, _, data, single = setup
    out, samples = tmp_path / "r" / "results.json", tmp_path / "samples.jsonl"
    evaluate_main(
        ["--checkpoint", str(d / "hf"), "--data", f"mc:{data[0]}", "--data", data[1], "--mesh", "none",
         "--max-len", "48", "--min-bucket", "16", "--separator", "blank-line", "--out", str(out),
         "--samples-out", str(samples), "--quiet"]
    )  # fmt: skip
    table = capsys.readouterr().out
    assert "acc_norm" in table and "bits/byte" in table
    written = json.loads(out.read_text())
    assert written["results"]["task"]["acc"] == single["results"]["task"]["acc"]
    assert written["results"]["moby"]["nll"] == pytest.approx(single["results"]["moby"]["nll"], rel=1e-6)
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["task"] * len(TASK) and rows[1]["id"] == "empty-context"


def test_data_specs_and_mesh_specs(setup, tmp_path):
    d, _, data, _ = setup
    assert parse_data_spec(data[0]).kind == "mc" and parse_data_spec(data[1]).kind == "text"
    assert parse_data_spec("embedded").kind == "tokens"
    text_jsonl = tmp_path / "docs.jsonl"
    text_jsonl.write_text('{"text": "hello"}\n')
    assert parse_data_spec(str(text_jsonl)) == parse_data_spec(f"text:{text_jsonl}")
    assert parse_data_spec(str(text_jsonl)).kind == "text"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_data_spec(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the kind"):
        parse_data_spec(str(tmp_path / "x.csv"))
    assert parse_mesh("none") is None and dict(parse_mesh("data=2,expert=4").shape)["expert"] == 4
    with pytest.raises(ValueError, match="--mesh 'gpu=8'"):
        parse_mesh("gpu=8")
    with pytest.raises(ValueError, match="share a name"):
        evaluate(str(d / "hf"), [data[0], data[0]], mesh="none")


def test_cli_errors_name_the_problem(setup, tmp_path):
    d, _, data, _ = setup
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "zaya_jax.evaluate", *args], capture_output=True, text=True, env=env
        )

    r = run("--checkpoint", str(tmp_path / "missing"), "--data", data[0])
    assert r.returncode != 0 and "does not exist" in r.stderr
    r = run("--checkpoint", str(tmp_path), "--data", data[0])  # neither HF dir nor workdir
    assert r.returncode != 0 and "neither a Hugging Face directory" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["x", "y"], "answer": 5}\n')
    r = run("--checkpoint", str(d / "hf"), "--data", f"mc:{bad}", "--mesh", "none")
    assert r.returncode != 0 and "bad.jsonl:1: 'answer' must be an index" in r.stderr


def test_cli_progress_in_a_log_is_whole_lines(setup):
    """stdout is not a TTY (a log, a pipe): the progress comes as whole lines, no `\\r`; stderr names
    the tokenizer file read. On a terminal the line is redrawn in place."""
    import io

    from zaya_jax.evaluate import ProgressLine

    d, _, data, _ = setup
    args = ["--mesh", "none", "--max-len", "48", "--min-bucket", "16", "--separator", "blank-line"]
    r = subprocess.run(  # bytes: text mode would turn a \r into a newline
        [
            sys.executable,
            "-m",
            "zaya_jax.evaluate",
            "--checkpoint",
            str(d / "hf"),
            "--data",
            data[1],
            *args,
        ],
        capture_output=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    assert "\r" not in out
    progress = [line for line in out.splitlines() if line.startswith("scored")]
    assert progress and all(line.endswith(" requests") for line in progress)
    assert progress[-1].split()[1].split("/")[0] == progress[-1].split()[1].split("/")[1]
    assert any(line.startswith(f"tokenizer byte: {d / 'hf'}/") for line in err.splitlines())

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    line = ProgressLine(tty)
    line(1, 3), line(3, 3)
    assert tty.getvalue() == "\rscored 1/3 requests\rscored 3/3 requests\n"


def test_without_a_trained_length_the_window_is_the_models_positions(setup):
    """An HF directory records no training length: rows as long as the model's positions."""
    d, _, data, _ = setup
    out = evaluate(str(d / "hf"), [data[1]], mesh="none", min_bucket=16, separator="blank-line", limit=1)
    assert out["max_len"] == 131072 and out["max_len_from"] == "max_position_embeddings"


def test_embedded_token_data_and_bf16_compute(setup):
    d, _, data, single = setup
    out = evaluate(str(d / "hf"), ["embedded", data[0]], mesh="none", max_len=48, min_bucket=16, limit=1)
    m = out["results"]["embedded"]
    assert m["kind"] == "tokens" and m["documents"] == 1 and m["tokens"] == m["bytes"] > 1000
    assert m["windows"] == -(-m["tokens"] // 48) and 0 < m["bits_per_byte"] < 20
    bf16 = evaluate(str(d / "hf"), data[:1], mesh="none", dtype="bfloat16", **OPTS)
    assert bf16["dtype"] == "bfloat16"
    for a, b in zip(bf16["samples"]["task"], single["samples"]["task"]):
        np.testing.assert_allclose(a["loglikelihoods"], b["loglikelihoods"], rtol=3e-2)
