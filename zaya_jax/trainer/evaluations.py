"""The evaluations of a training run (`eval.every_steps` and the last step): the held-out loss of
the training data (per mixture source and their weighted mean) and the downstream tasks of
`eval.tasks`, scored on the training mesh as `python -m zaya_jax.evaluate` scores them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from zaya_jax.data import mixture as mixture_lib
from zaya_jax.data.megatron import MegatronOptions
from zaya_jax.data.pipeline import make_eval_dataset
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.distributed import barrier
from zaya_jax.parallel.sharding import shard_batch


def eval_rows(c: ml_collections.ConfigDict, mesh) -> int:
    """eval.batch_size rounded up to a multiple of the devices that split batch rows (context ranks
    hold chunks of the same rows): the rows of every evaluation batch. The held-out batches are
    padded (loss mask 0) and the scorers fill their rows, so the extra rows change no result."""
    rows = row_devices(mesh)
    return -(-c.eval.batch_size // rows) * rows


def evaluate(eval_step, variables, c: ml_collections.ConfigDict, mesh) -> dict[str, float]:
    """Held-out loss of data.path, or of each mixture source (`eval_loss/<name>`) and the mixture's
    `eval_loss` = the weight-averaged per-source loss (the expected loss of a held-out token drawn
    in the training proportions)."""
    if not c.data.mixture:
        return _held_out_loss(eval_step, variables, c, mesh, c.data.path)
    out, loss, tokens = {}, 0.0, 0.0
    for source in mixture_lib.parse_mixture(c.data.mixture):
        r = _held_out_loss(eval_step, variables, c, mesh, source.path)
        out[f"eval_loss/{source.name}"] = r["eval_loss"]
        loss += source.weight * r["eval_loss"]
        tokens += r["eval_tokens"]
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)), "eval_tokens": tokens, **out}


def _held_out_loss(eval_step, variables, c: ml_collections.ConfigDict, mesh, path) -> dict[str, float]:
    """Held-out loss over `eval.batches` batches (0 = the whole split); token-weighted mean."""
    ds = make_eval_dataset(
        path,
        seq_len=c.train.seq_len,
        global_batch_size=eval_rows(c, mesh),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        num_threads=c.data.num_threads,
        megatron=MegatronOptions.of(c.data),
    )
    loss_sum, weight = 0.0, 0.0
    for i, batch in enumerate(ds):
        if c.eval.batches and i >= c.eval.batches:
            break
        out = jax.device_get(eval_step(variables, shard_batch(batch, mesh)))
        loss_sum += float(out["loss_sum"])
        weight += float(out["weight"])
    loss = loss_sum / max(weight, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)), "eval_tokens": weight}


# the metrics of each downstream task kind logged at every evaluation
TASK_METRICS = {
    "mc": ("acc", "acc_norm"),
    "text": ("bits_per_byte", "loss"),
    "tokens": ("bits_per_byte", "loss"),
}


def downstream_tasks(c: ml_collections.ConfigDict, cfg, tokenizer, mesh) -> Callable[[Any], dict] | None:
    """eval.tasks read and tokenised once -> fn(variables) -> {task: {metric: value}} (None if none).

    Scored like `python -m zaya_jax.evaluate` (zaya_jax/evaluate), on the training mesh, from the
    document boundary the packer uses (EOS)."""
    if not c.eval.tasks:
        return None
    from zaya_jax.evaluate import Scorer, TaskSuite, parse_data_spec

    max_len = c.eval.task_max_len or c.train.seq_len
    suite = TaskSuite(
        [parse_data_spec(s) for s in c.eval.tasks],
        tokenizer,
        tokenizer.eos_id,
        max_len,
        limit=c.eval.task_limit or None,
    )
    scorer = Scorer(cfg, mesh=mesh, batch_size=eval_rows(c, mesh), max_len=max_len, min_bucket=min(64, max_len))

    def run(variables) -> dict:
        results, _ = suite.run(scorer, variables)
        return {name: {k: r[k] for k in TASK_METRICS[r["kind"]]} for name, r in results.items()}

    return run


HARNESS_KEY = "config.eval.harness_tasks"


def harness_tasks(c: ml_collections.ConfigDict, cfg, tokenizer, mesh) -> Callable[[Any], dict] | None:
    """eval.harness_tasks loaded once (lm-eval imported only here; a missing lm-eval or an unknown
    task name is a one-line error at start-up) -> fn(variables) -> {"harness": {task: {metric:
    value}}} (logged as eval_harness/<task>/<metric>), None if none.

    Run through the `zaya_jax` lm-eval backend on the training mesh with its defaults (prefix
    none: lm-eval's and `python -m zaya_jax.lm_eval`'s), eval.task_max_len tokens per row (0 =
    train.seq_len), eval.task_limit examples per task (0 = all) and eval.batch_size rows per step
    (rounded up to the mesh); every process computes every task and gets the same numbers."""
    if not c.eval.harness_tasks:
        return None
    from zaya_jax.lm_eval import require_lm_eval

    require_lm_eval(HARNESS_KEY)
    from zaya_jax.hf.pretrained import resolve_prefix
    from zaya_jax.lm_eval.backend import ZayaLM
    from zaya_jax.lm_eval.harness import HarnessTasks

    tasks = HarnessTasks(
        list(c.eval.harness_tasks), c.eval.harness_include_path, c.eval.task_limit or None, HARNESS_KEY
    )
    # importing lm-eval and loading its tasks takes uneven time on the processes: the first train
    # step's collectives would time out on the earliest (zaya_jax/parallel/distributed.py)
    barrier("zaya_jax/harness_tasks_loaded")
    lm = ZayaLM.from_model(
        cfg,
        None,
        tokenizer,
        prefix_id=resolve_prefix("none", tokenizer, trained_by_us=True),
        prefix_every_request=False,
        mesh=mesh,
        batch_size=eval_rows(c, mesh),
        max_length=c.eval.task_max_len or c.train.seq_len,
        progress=False,
    )

    def run(variables) -> dict:
        lm.variables = variables
        return {"harness": tasks.run(lm)}

    return run
