"""Tiny byte-vocabulary models saved as HF directories and Orbax checkpoints (evaluation tests)."""

from __future__ import annotations

import json
import os

from hf_reference import Case, random_hf_model
from zaya_jax.import_hf import import_hf
from zaya_jax.tokenizer import ByteTokenizer

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
