"""Export a training checkpoint to transformers and import it back (zaya_jax.export / import_hf)."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from support.configs import small_train_config
from support.xla_env import xla_flags
from transformers import AutoModelForCausalLM, AutoTokenizer

from zaya_jax import model
from zaya_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from zaya_jax.export import export, skip_bias_warning
from zaya_jax.generate import main as generate_main
from zaya_jax.hf.pretrained import load_checkpoint_variables
from zaya_jax.import_hf import import_hf
from zaya_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT = (
    "Checkpoints carry the whole run: params, optimizer state, the data position. "
    "An exported model must give the same logits in transformers."
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    w = tmp_path_factory.mktemp("run")
    train(small_train_config(), str(w))
    return w


def _ours(workdir, ids):
    _, cfg, variables, _ = load_checkpoint_variables(str(workdir))
    return np.asarray(model.ZayaForCausalLM(cfg).apply(variables, jnp.asarray(ids)).logits, np.float32)


def _theirs(hf_dir, ids):
    m = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.slow
def test_export_fp32_and_bf16_load_in_transformers(trained, tmp_path):
    ids = np.asarray([ByteTokenizer().encode(HELD_OUT)], np.int64)
    ref = _ours(trained, ids)
    info = export(str(trained / "checkpoints" / "3"), str(tmp_path / "fp32"), dtype="float32")
    assert (
        info["step"] == 3
        and info["warnings"] == []
        and {"config.json", "generation_config.json", "model.safetensors"} <= set(info["files"])
    )
    assert load_tokenizer(str(tmp_path / "fp32")).name == "byte"
    _assert_special_ids_agree(tmp_path / "fp32")
    err = np.abs(_theirs(tmp_path / "fp32", ids) - ref).max()
    print(f"export fp32: max abs logits error {err:.3g}")
    assert err < 1e-4, err

    # bf16, sharded, through the CLI.
    out = tmp_path / "bf16"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "zaya_jax.export",
            "--checkpoint",
            str(trained),
            "--out",
            str(out),
            "--dtype",
            "bfloat16",
            "--max-shard-bytes",
            "100000",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = _theirs(out, ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"export bf16: max abs error / max |logit| {rel:.3g}")
    assert rel < 2e-2, rel


def test_skip_bias_transformers_would_reset_is_reported():
    biases = np.zeros((3, 5), np.float32)
    biases[:, -1] = -1.0
    as_variables = lambda b: {"balancing": {"layers": {"mlp": {"gate": {"balancing_biases": b}}}}}
    assert skip_bias_warning(as_variables(biases)) is None  # what the trainer keeps by default
    biases[1, -1] = -0.5
    assert "layers [1]" in skip_bias_warning(as_variables(biases))


def _assert_special_ids_agree(hf_dir):
    """config.json, generation_config.json and the tokenizer transformers builds name the same ids."""
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    want = {
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    assert want == {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
    for name in ("config.json", "generation_config.json"):
        got = json.loads((hf_dir / name).read_text())
        assert {k: got[k] for k in want} == want, name


PROMPTS = ["Call me Ishmael.", "It was the best of times", "naïve café — 日本語 🐋", "x"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_generate_with_exported_tokenizer_matches_ours(trained, tmp_path, dtype):
    """AutoTokenizer + AutoModelForCausalLM greedy generate == python -m zaya_jax.generate on the same
    prompts (--prefix none: the exported tokenizer adds no special token). Both read the bf16 export's
    weights in fp32, so the tokens must be identical."""
    out = tmp_path / "hf"
    export(str(trained), str(out), dtype=dtype)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    generate_main(
        ["--checkpoint", str(out), "--prompts-file", str(prompts), "--max-new-tokens", "12",
         "--prefix", "none", "--out", str(tmp_path / "ours.jsonl")]
    )  # fmt: skip
    ours = [json.loads(line) for line in (tmp_path / "ours.jsonl").read_text().splitlines()]
    assert sum(len(r["tokens"]) for r in ours) > 2 * len(PROMPTS)  # more than an immediate EOS
    tok = AutoTokenizer.from_pretrained(str(out))
    m = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    for prompt, row in zip(PROMPTS, ours):
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            ids = m.generate(**enc, do_sample=False, max_new_tokens=12)[0, enc.input_ids.shape[1] :].tolist()
        assert ids == row["tokens"], prompt
        assert tok.decode(ids, skip_special_tokens=True) == row["completion"]


@pytest.mark.slow
def test_import_hf_then_init_from(trained, tmp_path):
    export(str(trained), str(tmp_path / "hf"), dtype="float32")
    (tmp_path / "imported").mkdir()
    (tmp_path / "imported" / "old.txt").write_text("replaced")
    info = import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"), small_train_config(), overwrite=True)
    assert not (tmp_path / "imported" / "old.txt").exists()
    assert info["step"] == 0 and info["tokenizer"] == "byte"
    # the tokenizer files come back: exporting the imported checkpoint writes the same ones
    export(str(tmp_path / "imported"), str(tmp_path / "hf2"), dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "zaya_tokenizer.json"):
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    ids = np.asarray([ByteTokenizer().encode(HELD_OUT)], np.int64)
    np.testing.assert_array_equal(_ours(tmp_path / "imported", ids), _ours(trained, ids))

    c = small_train_config(steps=2)
    c.train.init_from = str(tmp_path / "imported")
    w = tmp_path / "phase2"
    summary = train(c, str(w))
    assert summary["start_step"] == 0 and summary["final_step"] == 2
    # It started from the imported params: the first loss is the trained model's, not a fresh init's.
    fresh = train(small_train_config(steps=1), str(tmp_path / "fresh"))
    from zaya_jax.training.metrics import read_metrics

    first = read_metrics(str(w), split="train")[0]["loss"]
    assert first < fresh["loss"] - 0.05
