"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores HellaSwag, ARC,
PIQA, ... (`output_type: multiple_choice`).

Task file: JSONL, one example per line:
    {"context": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0}
optionally with "id". Each choice is scored as the continuation `delimiter + choice` of the context
(delimiter " " by default, lm-eval's `target_delimiter`). Tokenisation follows lm-eval's
`_encode_pair`: trailing spaces of the context move to the continuation, the pair is encoded whole
and the continuation is what follows the context's own tokens. Every request starts with the
model's prefix token (zaya_jax.hf.pretrained), so an empty context is predicted from a document
boundary; with prefix_every_request=False (`--prefix none`, lm-eval's default) only a request whose
context has no tokens does, as lm-eval conditions those on its prefix_token_id. A context longer
than max_len is cut from the left.

Metrics over examples (mean and standard error, ddof=1, as lm-eval):
    acc       argmax_i  loglik_i                      == answer
    acc_norm  argmax_i  loglik_i / len(choice_i)      == answer   (length in characters)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluate.scoring import Request, Score, Scorer


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int
    id: str | int | None = None


def load_task(path: str | Path, limit: int | None = None) -> list[Example]:
    """Reads and checks a task file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} not found")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if limit is not None and len(out) >= limit:
                    break
                out.append(_parse_example(line, f"{path}:{lineno}"))
    except UnicodeDecodeError as e:
        raise ValueError(f"task file {path}: not UTF-8 text ({e.reason})") from None
    if not out:
        raise ValueError(f"task file {path} has no examples")
    return out


def _parse_example(line: str, where: str) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("context", "choices", "answer") if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    context, choices, answer = row["context"], row["choices"], row["answer"]
    if not isinstance(context, str):
        raise ValueError(f"{where}: 'context' must be a string")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError(f"{where}: 'choices' must be a list of at least 2 non-empty strings")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(
            f"{where}: 'answer' must be an index into the {len(choices)} choices, got {answer!r}"
        )
    return Example(context, tuple(choices), answer, row.get("id"))


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's `_encode_pair`."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    context_tokens = tokenizer.encode(context)
    return context_tokens, whole[len(context_tokens) :]


def choice_requests(
    example: Example,
    tokenizer: Tokenizer,
    prefix_id: int,
    max_len: int,
    delimiter: str = " ",
    prefix_every_request: bool = True,
) -> list[Request]:
    out = []
    for choice in example.choices:
        context, continuation = encode_pair(tokenizer, example.context, delimiter + choice)
        if not continuation:
            raise ValueError(f"example {example.id}: choice {choice!r} encodes to no tokens")
        if len(continuation) > max_len:
            raise ValueError(
                f"example {example.id}: choice {choice!r} has {len(continuation)} tokens, more than "
                f"max_len={max_len}"
            )
        prefix = [prefix_id] if prefix_every_request or not context else []
        tokens = (prefix + context + continuation)[-(max_len + 1) :]
        out.append(Request.from_sequence(tokens, len(continuation)))
    return out


def _mean_stderr(x: np.ndarray) -> tuple[float, float]:
    stderr = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")
    return float(np.mean(x)), stderr


def task_requests(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    prefix_id: int,
    max_len: int,
    delimiter: str = " ",
    prefix_every_request: bool = True,
) -> list[Request]:
    """All choices of all examples, flat, in order."""
    return [
        r
        for e in examples
        for r in choice_requests(e, tokenizer, prefix_id, max_len, delimiter, prefix_every_request)
    ]


def task_metrics(examples: Sequence[Example], scores: Sequence[Score]) -> tuple[dict[str, float], list[dict]]:
    """(metrics, per-example samples with every choice's log-likelihood) from the scores of
    `task_requests(examples, ...)`."""
    samples, acc, acc_norm = [], [], []
    i = 0
    for e in examples:
        mine = scores[i : i + len(e.choices)]
        i += len(e.choices)
        ll = np.array([s.logprob for s in mine])
        pred = int(np.argmax(ll))
        pred_norm = int(np.argmax(ll / np.array([len(c) for c in e.choices], np.float64)))
        acc.append(pred == e.answer)
        acc_norm.append(pred_norm == e.answer)
        samples.append(
            {
                "id": e.id,
                "answer": e.answer,
                "pred": pred,
                "pred_norm": pred_norm,
                "loglikelihoods": ll.tolist(),
                "is_greedy": [s.greedy for s in mine],
                "num_tokens": [s.tokens for s in mine],
            }
        )
    assert i == len(scores), "one score per choice"
    (a, a_se), (an, an_se) = _mean_stderr(np.array(acc, float)), _mean_stderr(np.array(acc_norm, float))
    metrics = {
        "examples": len(examples),
        "acc": a,
        "acc_stderr": a_se,
        "acc_norm": an,
        "acc_norm_stderr": an_se,
    }
    return metrics, samples


def score_task(
    scorer: Scorer,
    variables: Any,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    prefix_id: int,
    *,
    delimiter: str = " ",
) -> tuple[dict[str, float], list[dict]]:
    """Scores one task: `task_requests` -> `Scorer.score` -> `task_metrics`."""
    requests = task_requests(examples, tokenizer, prefix_id, scorer.max_len, delimiter)
    return task_metrics(examples, scorer.score(variables, requests))
