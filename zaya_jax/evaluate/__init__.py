"""Evaluation: perplexity / bits per byte and multiple-choice accuracy of a trained model.

    python -m zaya_jax.evaluate --checkpoint CKPT_OR_HF_DIR --data SPEC [--data SPEC ...] [options]

or from Python:

    results = evaluate("runs/tiny", ["embedded", "tasks/arc_easy.jsonl"], mesh="data=2,expert=4")

A data SPEC is one task, its kind read off the path (or forced with a "kind:" prefix):
    embedded | tokens:DIR | a prepared dir   perplexity over token shards (split: --split, default eval)
    FILE.txt[.gz] | text:FILE                perplexity over text (--separator cuts it into documents)
    FILE.jsonl[.gz]                          multiple choice if its first row has "choices", else text
    mc:FILE                                  multiple choice (zaya_jax/evaluate/multiple_choice.py)

The checkpoint is an Orbax training checkpoint (WORKDIR, WORKDIR/checkpoints or .../<step>) or a
Hugging Face directory (zaya_jax.hf.pretrained). Scoring is one jit-compiled step per sequence bucket
(zaya_jax/evaluate/scoring.py), on one device or a (data, fsdp, expert) mesh.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from zaya_jax.data.tasks import KINDS, Task, parse_data_spec  # noqa: F401  (KINDS: re-exported)
from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluate.multiple_choice import Example, load_task, score_task, task_metrics, task_requests
from zaya_jax.evaluate.perplexity import (
    Document,
    document_requests,
    perplexity,
    perplexity_metrics,
    text_documents,
    token_documents,
)
from zaya_jax.evaluate.scoring import Request, Score, Scorer, sequence_buckets
from zaya_jax.hf.pretrained import Pretrained, load_model, tokenizer_line
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.mesh import make_mesh, parse_mesh_spec

__all__ = [
    "Document",
    "Example",
    "Request",
    "Score",
    "Scorer",
    "Task",
    "TaskSuite",
    "evaluate",
    "load_task",
    "parse_data_spec",
    "parse_mesh",
    "perplexity",
    "score_task",
    "sequence_buckets",
]


def parse_mesh(spec: str | None):
    """The mesh of a --mesh spec: none -> None (one device); auto -> all devices on the data axis
    (None if there is one); data=2,expert=4 -> that (unnamed axes: 1, data = the rest)."""
    if spec in (None, "none"):
        return None
    if spec == "auto":
        return make_mesh() if jax.device_count() > 1 else None
    try:
        sizes = parse_mesh_spec(spec)
    except ValueError as e:
        raise ValueError(f"{e} (or none / auto)") from None
    return make_mesh(**sizes)


class TaskSuite:
    """Tasks read and tokenised once, then scored any number of times (every eval of a training run).

    run(scorer, variables) scores all of them in one `Scorer.score` call (so batches are shared
    between tasks) and returns (metrics per task name, multiple-choice samples per task name).
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: Tokenizer,
        prefix_id: int,
        max_len: int,
        *,
        split: str = "eval",
        stride: int | None = None,
        delimiter: str = " ",
        separator: str | None = None,
        text_field: str = "text",
        limit: int | None = None,
        prefix_every_request: bool = True,
    ):
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"two evaluation tasks share a name: {names}")
        self.tasks = list(tasks)
        self._jobs: list[tuple[Task, list[Request], Callable[[list[Score]], tuple[dict, list | None]]]] = []
        for task in tasks:
            if task.kind == "mc":
                examples = load_task(task.path, limit)
                requests = task_requests(
                    examples, tokenizer, prefix_id, max_len, delimiter, prefix_every_request
                )
                finish = functools.partial(task_metrics, examples)
            else:
                if task.kind == "text":
                    docs = text_documents(task.path, tokenizer, separator=separator, text_field=text_field)
                else:
                    docs = token_documents(None if task.path == "embedded" else task.path, split, tokenizer)
                docs = docs[:limit]
                requests = document_requests(docs, prefix_id, max_len, stride)
                if not requests:
                    raise ValueError(f"task {task.name} ({task.path}): no non-empty documents to score")
                finish = functools.partial(lambda d, scores: (perplexity_metrics(d, scores), None), docs)
            self._jobs.append((task, requests, finish))

    @property
    def num_requests(self) -> int:
        return sum(len(r) for _, r, _ in self._jobs)

    def run(
        self, scorer: Scorer, variables: Any, progress: Callable[[int, int], None] | None = None
    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict]]]:
        t0 = time.perf_counter()
        scores = scorer.score(variables, [r for _, requests, _ in self._jobs for r in requests], progress)
        seconds = time.perf_counter() - t0
        results, samples, i = {}, {}, 0
        for task, requests, finish in self._jobs:
            metrics, task_samples = finish(scores[i : i + len(requests)])
            i += len(requests)
            # time is shared out by requests: tasks are scored together
            share = seconds * len(requests) / max(self.num_requests, 1)
            results[task.name] = {"kind": task.kind, **metrics, "seconds": share}
            if task_samples is not None:
                samples[task.name] = task_samples
        return results, samples


class ProgressLine:
    """`scored DONE/TOTAL requests` on stdout (process 0): redrawn in place on a terminal; in a log
    (not a TTY) a whole line at the first call, then at most every `every_s` seconds, and the last."""

    def __init__(self, stream=None, every_s: float = 10.0):
        self.stream = sys.stdout if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.last = every_s, -float("inf")  # the first call prints: scoring began

    def __call__(self, done: int, total: int) -> None:
        if jax.process_index() != 0:
            return
        text, now = f"scored {done}/{total} requests", time.monotonic()
        if self.tty:
            self.stream.write("\r" + text + ("\n" if done == total else ""))
        elif done == total or now - self.last >= self.every_s:
            self.stream.write(text + "\n")
            self.last = now
        self.stream.flush()


WINDOW_FROM = {  # where evaluate's window comes from -> its words
    "--max-len": "--max-len",
    "train.seq_len": "the checkpoint's train.seq_len; --max-len N sets another",
    "max_position_embeddings": "the model's max_position_embeddings, no trained length recorded; "
    "--max-len N sets another",
}


def check_window(model: Pretrained, max_len: int | None) -> tuple[int, str]:
    """(tokens per row, where the number comes from): --max-len, checked against the model's
    positions, or the model's default window (`Pretrained.default_window`)."""
    if max_len is None:
        return model.default_window()
    if max_len > model.cfg.max_position_embeddings:
        raise ValueError(
            f"--max-len {max_len}: beyond the model's max_position_embeddings "
            f"({model.cfg.max_position_embeddings})"
        )
    return max_len, "--max-len"


def evaluate(
    checkpoint: str,
    data: Sequence[str],
    *,
    mesh: str | None = "none",
    batch_size: int | None = None,
    max_len: int | None = None,
    min_bucket: int = 64,
    dtype: str | None = None,
    tokenizer: str | None = None,
    prefix: str = "auto",
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    **task_options,
) -> dict[str, Any]:
    """Loads `checkpoint` and runs every --data task; returns the results dict the CLI writes
    (task_options: TaskSuite's keyword arguments). max_len None: the trained sequence length when
    the checkpoint records one, else the model's max_position_embeddings (`check_window`); `log`
    gets one line saying which."""
    tasks = [parse_data_spec(d) for d in data]
    mesh_obj = parse_mesh(mesh)
    model = load_model(checkpoint, mesh=mesh_obj, dtype=dtype, tokenizer=tokenizer, prefix=prefix)
    devices = row_devices(mesh_obj)
    if batch_size is None:
        batch_size = -(-8 // devices) * devices
    max_len, window_from = check_window(model, max_len)
    if log is not None:
        log(f"window: {max_len} tokens per row ({WINDOW_FROM[window_from]})")
    suite = TaskSuite(
        tasks,
        model.tokenizer,
        model.prefix_id,
        max_len,
        prefix_every_request=model.prefix_every_request,
        **task_options,
    )
    scorer = Scorer(model.cfg, mesh=mesh_obj, batch_size=batch_size, max_len=max_len, min_bucket=min_bucket)
    if progress and jax.process_index() == 0:
        print(tokenizer_line(model), file=sys.stderr, flush=True)
    results, samples = suite.run(scorer, model.variables, ProgressLine() if progress else None)
    return {
        "checkpoint": os.path.abspath(checkpoint),
        "source": model.source,
        "step": model.step,
        "tokenizer": model.tokenizer.name,
        "prefix_id": model.prefix_id,
        "prefix_every_request": model.prefix_every_request,
        "dtype": model.cfg.dtype,
        "mesh": None if mesh_obj is None else dict(mesh_obj.shape),
        "batch_size": batch_size,
        "max_len": max_len,
        "max_len_from": window_from,
        "buckets": list(scorer.buckets),
        "compilations": scorer.num_traces,
        "results": results,
        "samples": samples,
    }
