"""lm-evaluation-harness tasks run inside training (`eval.harness_tasks`): loaded once at start-up
(an unknown task name fails there), then run at every evaluation through the `zaya_jax` backend on
the training mesh, as `python -m zaya_jax.lm_eval` runs them on the saved checkpoint (lm-eval's
default seeds and num_fewshot; no bootstrap stderr, no samples).

Every process runs every task (the backend is rank 0 of world size 1 on each) and gets the same
metrics: `{task: {metric: value}}`, a metric named as in lm-eval's results with its filter
(`acc`, `word_perplexity`, `exact_match_strict-match`; the filter "none" is left out)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval import evaluator
from lm_eval.tasks import TaskManager
from lm_eval.utils import set_torch_seed

from zaya_jax.lm_eval.backend import ZayaLM
from zaya_jax.runtime.cli import near_key

# lm-eval's simple_evaluate defaults (random, numpy, torch, few-shot), so the numbers equal the CLI's
SEEDS = (0, 1234, 1234, 1234)


def task_manager(names: Sequence[str], include_path: str | None, key: str = "tasks") -> TaskManager:
    """A TaskManager that knows every name in `names`: the include_path's tasks alone when they
    suffice (indexing lm-eval's ~15k built-in task files takes ~15 s), else with the built-in ones.
    A name known to neither is a ValueError naming `key`, with the nearest known name."""
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([n]) for n in names):
            return local
    manager = TaskManager(include_path=include_path)
    for n in names:
        if not manager.match_tasks([n]):
            where = " or under " + include_path if include_path else ""
            raise ValueError(
                f"{key}: no lm-evaluation-harness task {n!r} (neither built in{where})"
                + near_key(n, manager.all_tasks)
            )
    return manager


class HarnessTasks:
    """`run(lm)` -> {task: {metric: value}} for the tasks named (see the module docstring)."""

    def __init__(self, names: Sequence[str], include_path: str | None, limit: int | None, key: str):
        self.loaded = task_manager(names, include_path, key).load(list(names))
        self.limit = limit
        for task in self.loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)

    def run(self, lm: ZayaLM) -> dict[str, dict[str, float]]:
        random.seed(SEEDS[0])
        np.random.seed(SEEDS[1])
        set_torch_seed(SEEDS[2])
        for task in self.loaded["tasks"].values():
            task.set_fewshot_seed(seed=SEEDS[3])  # the same few-shot examples at every evaluation
        out = evaluator.evaluate(lm, self.loaded, limit=self.limit, bootstrap_iters=0, log_samples=False)
        return harness_metrics(out["results"])


def harness_metrics(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's `results` ({task: {"acc,none": x, "acc_stderr,none": s, "alias": ...}}) -> the
    numeric metrics per task: `acc`, or `metric_filter` for a filter other than "none"."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        row = {}
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if not filt or "_stderr" in name or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                row[name if filt == "none" else f"{name}_{filt}"] = float(value)
        out[task] = row
    return out
