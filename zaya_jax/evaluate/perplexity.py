"""Perplexity and bits per byte of documents, scored in rolling windows (lm-evaluation-harness's
`loglikelihood_rolling`).

A document's tokens t_1..t_n are predicted from the prefix token t_0 (zaya_jax.hf.pretrained:
the document boundary the model was trained with). Windows of at most `max_len` inputs each
predict up to `stride` new tokens with as much preceding context as fits; stride = max_len (the
default) gives disjoint windows, a smaller stride more context per prediction at more compute.
Every token is predicted exactly once.

Documents come from text (.txt, .jsonl with a "text" field, optionally .gz, split like
`zaya_jax.data.prepare` does) or from a prepared token-shard directory / the embedded corpus; a
stored document's trailing EOS is not scored, so a text file and its prepared shards give the same
numbers. Metrics (all from the summed negative log-likelihood NLL, in nats):
    loss = NLL / tokens     perplexity = exp(loss)     bits_per_byte = NLL / (ln 2 * UTF-8 bytes)
    byte_perplexity = 2 ** bits_per_byte               word_perplexity = exp(NLL / words)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluate.scoring import Request, Score, Scorer


@dataclasses.dataclass(frozen=True)
class Document:
    tokens: np.ndarray  # int [n], no prefix and no trailing EOS
    num_bytes: int  # UTF-8 bytes of its text
    num_words: int  # whitespace-separated words of its text


def text_document(text: str, tokenizer: Tokenizer) -> Document:
    return Document(
        np.asarray(tokenizer.encode(text), np.int32), len(text.encode("utf-8")), len(text.split())
    )


def rolling_windows(
    tokens: np.ndarray, prefix_id: int, max_len: int, stride: int | None = None
) -> list[Request]:
    """Requests that together predict every token of `tokens` once (see the module docstring)."""
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride={stride} must be in [1, max_len={max_len}]")
    seq = np.concatenate([[prefix_id], np.asarray(tokens, np.int32)]).astype(np.int32)
    n = len(seq) - 1  # tokens to predict: seq[1..n]
    out, first = [], 1
    while first <= n:
        end = min(first + stride, n + 1)  # predict seq[first:end]
        lo = max(0, end - 1 - max_len)  # inputs seq[lo:end-1], at most max_len of them
        out.append(Request(seq[lo : end - 1], seq[lo + 1 : end], first - 1 - lo))
        first = end
    return out


def document_requests(
    documents: Sequence[Document], prefix_id: int, max_len: int, stride: int | None = None
) -> list[Request]:
    """The rolling windows of every non-empty document, in order."""
    return [
        r for d in documents if len(d.tokens) for r in rolling_windows(d.tokens, prefix_id, max_len, stride)
    ]


def perplexity_metrics(documents: Sequence[Document], scores: Sequence[Score]) -> dict[str, float]:
    """The metrics of the module docstring from the scores of `document_requests(documents, ...)`."""
    documents = [d for d in documents if len(d.tokens)]
    if not documents:
        raise ValueError("perplexity: no non-empty documents to score")
    nll = -math.fsum(s.logprob for s in scores)
    tokens = sum(s.tokens for s in scores)
    assert tokens == sum(len(d.tokens) for d in documents), "rolling windows must score every token once"
    num_bytes = sum(d.num_bytes for d in documents)
    words = sum(d.num_words for d in documents)
    bpb = nll / (math.log(2) * num_bytes) if num_bytes else float("nan")
    return {
        "documents": len(documents),
        "tokens": tokens,
        "bytes": num_bytes,
        "words": words,
        "windows": len(scores),
        "nll": nll,
        "loss": nll / tokens,
        "perplexity": _exp(nll / tokens),
        "bits_per_byte": bpb,
        "byte_perplexity": 2.0**bpb if num_bytes else float("nan"),
        "word_perplexity": _exp(nll / words) if words else float("nan"),
    }


def perplexity(
    scorer: Scorer,
    variables: Any,
    documents: Sequence[Document],
    prefix_id: int,
    *,
    stride: int | None = None,
) -> dict[str, float]:
    """Scores `documents` (empty ones are skipped): `document_requests` -> `Scorer.score` -> metrics."""
    if not any(len(d.tokens) for d in documents):
        raise ValueError("perplexity: no non-empty documents to score")
    requests = document_requests(documents, prefix_id, scorer.max_len, stride)
    return perplexity_metrics(documents, scorer.score(variables, requests))


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def text_documents(
    path: str | Path, tokenizer: Tokenizer, *, separator: str | None = None, text_field: str = "text"
) -> list[Document]:
    """Documents of a .txt / .jsonl (optionally .gz) file, split as `zaya_jax.data.prepare` splits."""
    from zaya_jax.data.documents import iter_documents, parse_separator

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation text {path} not found")
    texts = iter_documents(path, separator=parse_separator(separator), text_field=text_field)
    return [text_document(t, tokenizer) for t in texts if t.strip()]


def token_documents(source: str | None, split: str, tokenizer: Tokenizer) -> list[Document]:
    """Documents of a prepared token-shard directory (or "embedded"), their stored EOS dropped.
    Byte and word counts come from decoding the tokens with `tokenizer` (the data's own)."""
    from zaya_jax.data.pipeline import load_documents

    docs = load_documents(source, split)
    if tokenizer.eos_id != docs.eos_id:
        raise ValueError(
            f"{source}: the shards were written with eos_id {docs.eos_id}, the model's tokenizer "
            f"{tokenizer.name} has eos_id {tokenizer.eos_id}: different tokenizers"
        )
    out = []
    for d in range(docs.num_docs):
        tokens = np.asarray(docs.doc_tokens(d), np.int32)
        if len(tokens) and tokens[-1] == docs.eos_id:
            tokens = tokens[:-1]
        text = tokenizer.decode(tokens.tolist())
        out.append(Document(tokens, len(text.encode("utf-8")), len(text.split())))
    return out
