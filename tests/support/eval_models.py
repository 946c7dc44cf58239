"""Tiny byte-vocabulary models saved as HF directories and Orbax checkpoints (evaluation tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.hf_reference import Case, random_hf_model
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.import_hf import import_hf

# vocab 259 = the byte tokenizer's, so text tasks run end to end through the tokenizer
BYTE_CASE = Case(
    seed=11,
    layers=2,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    t0=2,
    t1=3,
    experts=4,
    theta=1e4,
    batch=1,
    seq=1,
    padded=False,
    vocab=259,
)

TASK = [
    {"context": "The cat sat on the", "choices": ["mat", "moon", "quantum field"], "answer": 0},
    {"context": "", "choices": ["a", "bb"], "answer": 1, "id": "empty-context"},
    {"context": "One two three ", "choices": ["four", "five", "4"], "answer": 0},
    {"context": "Call me Ishmael. Some years ago", "choices": [", never mind", " I went"], "answer": 0},
    {"context": "x" * 30, "choices": ["y", "xx"], "answer": 1},
]
TEXT = (
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money "
    "in my purse, and nothing particular to interest me on shore, I thought I would sail about.\n\n"
    "It is a way I have of driving off the spleen.\n\nShort."
)


def save_byte_hf_model(path: str, case: Case = BYTE_CASE):
    """Writes a random transformers model + the byte tokenizer to `path`; returns the torch model."""
    ref = random_hf_model(case, eos_token_id=1)
    ref.save_pretrained(path)
    ByteTokenizer().save(path)
    return ref


def write_task(path: str, rows=TASK) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def write_text(path: str, text: str = TEXT) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def orbax_from_hf(hf_dir: str, workdir: str) -> str:
    import_hf(hf_dir, workdir)
    return os.path.join(workdir, "checkpoints", "0")


# lm-evaluation-harness tasks over local JSONL (tests/test_lm_eval.py, tests/test_lm_eval_backend.py)
DOCS = [
    (
        "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in "
        "my purse, and nothing particular to interest me on shore, I thought I would sail about a little."
    ),
    "Ünïcödé — naïve café, 日本語, 🐋 whales.",
    "Short.",
]
_TASK_HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
"""
MC_YAML = """output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """output_type: generate_until
doc_to_text: prompt
doc_to_target: answer
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_harness_tasks(d, gen_prompts=(), until=("\n\n",), max_gen=16) -> str:
    """Task YAMLs under d/tasks: zaya_mc (TASK, d/task.jsonl), zaya_ppl (DOCS, d/docs.jsonl) and,
    with prompts, zaya_gen (greedy generate_until, d/gen.jsonl). Returns the tasks directory."""
    d = Path(d)
    (d / "tasks").mkdir(exist_ok=True)
    write_task(str(d / "task.jsonl"))
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    (d / "tasks" / "zaya_mc.yaml").write_text(
        _TASK_HEAD.format(name="zaya_mc", path=d / "task.jsonl") + MC_YAML
    )
    (d / "tasks" / "zaya_ppl.yaml").write_text(
        _TASK_HEAD.format(name="zaya_ppl", path=d / "docs.jsonl") + PPL_YAML
    )
    if gen_prompts:
        (d / "gen.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in gen_prompts)
        )
        gen = GEN_YAML.format(until=json.dumps(list(until)), max_gen=max_gen)
        (d / "tasks" / "zaya_gen.yaml").write_text(
            _TASK_HEAD.format(name="zaya_gen", path=d / "gen.jsonl") + gen
        )
    return str(d / "tasks")


def random_byte_model(**config):
    """A random transformers model over the byte vocabulary with the skip class's balancing bias at
    -1, where transformers' from_pretrained resets it (and where we train it)."""
    import torch

    ref = random_hf_model(BYTE_CASE, eos_token_id=1, **config)
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("balancing_biases"):
                buf[-1] = -1.0
    return ref
