"""`python -m zaya_jax.train --config configs/<name>.py --workdir DIR [--config.train.steps=100 ...]`

Trains a ZAYA1 model: validated config -> data (grain) -> jit-compiled train step with our Muon /
AdamW chain and aux-loss-free router balancing -> metrics (console, WORKDIR/metrics.jsonl,
TensorBoard) -> periodic held-out evaluation -> Orbax checkpoints. An existing WORKDIR resumes from
its latest checkpoint, data position included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from zaya_jax import balancing as bal
from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.checkpoint import Checkpointer, abstract_like
from zaya_jax.data.pipeline import make_dataset, make_eval_dataset, source_tokenizer
from zaya_jax.metrics import MetricsLogger
from zaya_jax.model import ZayaConfig
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.parallel.distributed import initialize_from_env
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.parallel.sharding import shard_batch
from zaya_jax.train_state import (TrainState, create_train_state, make_eval_step, make_train_step,
                                  state_shardings)


def balancing_config(c: ml_collections.ConfigDict) -> bal.BalancingConfig | None:
  if not c.balancing.enabled:
    return None
  fields = {f.name for f in dataclasses.fields(bal.BalancingConfig)}
  return bal.BalancingConfig(**{k: v for k, v in c.balancing.items() if k in fields}).validate()


def _to_python(metrics: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for k, v in jax.device_get(metrics).items():
    v = np.asarray(v)
    out[k] = v.tolist() if v.ndim else v.item()
  return out


def evaluate(eval_step, variables, c: ml_collections.ConfigDict, mesh) -> dict[str, float]:
  """Held-out loss over `eval.batches` batches (0 = the whole split); token-weighted mean."""
  ds = make_eval_dataset(c.data.path, seq_len=c.train.seq_len, global_batch_size=c.eval.batch_size,
                         process_index=jax.process_index(), process_count=jax.process_count(),
                         num_threads=c.data.num_threads)
  loss_sum, weight = 0.0, 0.0
  for i, batch in enumerate(ds):
    if c.eval.batches and i >= c.eval.batches:
      break
    out = jax.device_get(eval_step(variables, shard_batch(batch, mesh)))
    loss_sum += float(out["loss_sum"])
    weight += float(out["weight"])
  loss = loss_sum / max(weight, 1.0)
  return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)), "eval_tokens": weight}


def train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the training described by `c` in `workdir`. Returns a summary dict."""
  cfg = config_lib.validate(c)
  os.makedirs(workdir, exist_ok=True)
  tokenizer = source_tokenizer(c.data.path)
  if tokenizer.vocab_size > cfg.vocab_size:
    raise ValueError(f"config.model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer "
                     f"vocabulary ({tokenizer.vocab_size}, {tokenizer.name})")
  steps, seq_len, batch_size = c.train.steps, c.train.seq_len, c.train.batch_size

  mesh = mesh_from_config(c)
  if batch_size % mesh.size or (batch_size // c.train.grad_accum) % mesh.size:
    raise ValueError(f"config.train.batch_size={batch_size} (per microbatch "
                     f"{batch_size // c.train.grad_accum}) must be divisible by the {mesh.size} devices")
  tx = make_optimizer(c, total_steps=steps)
  schedule = lr_schedule(c, total_steps=steps)
  bal_cfg = balancing_config(c)
  create = lambda: create_train_state(cfg, tx, bal_cfg or bal.BalancingConfig(), jax.random.key(c.seed))
  shardings = state_shardings(jax.eval_shape(create), mesh, zero1=c.mesh.zero1)
  state = jax.jit(create, out_shardings=shardings)()

  train_ds = make_dataset(c.data.path, seq_len=seq_len, global_batch_size=batch_size, seed=c.seed,
                          process_index=jax.process_index(), process_count=jax.process_count(),
                          num_threads=c.data.num_threads, prefetch_buffer_size=c.data.prefetch)
  data_iter = iter(train_ds)

  ckpt = Checkpointer(workdir, keep=c.checkpoint.keep)
  start = ckpt.latest_step()
  if start is not None:
    state, data_state, _ = ckpt.restore(start, abstract_like(state))
    data_iter.set_state(data_state)
  elif c.train.init_from:
    state = _init_from(state, c.train.init_from)
  start = int(state.step)

  train_step = jax.jit(make_train_step(cfg, tx, bal_cfg, schedule, c.train.grad_accum, mesh),
                       in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(cfg, mesh))
  peak = sizing.peak_flops_per_device()
  config_json = json.loads(c.to_json_best_effort())

  summary: dict[str, Any] = {"start_step": start, "mesh": dict(mesh.shape)}
  # Process 0 owns WORKDIR/metrics.jsonl and TensorBoard; the others keep their own record.
  primary = jax.process_index() == 0
  log_dir = workdir if primary else os.path.join(workdir, f"process_{jax.process_index()}")
  with MetricsLogger(log_dir, total_steps=steps, tensorboard=c.logging.tensorboard and primary,
                     console=c.logging.console, resume_step=start) as logger:
    t_last, tokens_since = time.perf_counter(), 0
    for step in range(start, steps):
      batch = shard_batch(next(data_iter), mesh)
      state, metrics = train_step(state, batch)
      tokens_since += batch_size * seq_len
      done = step + 1
      if done % c.logging.every_steps == 0 or done == steps:
        m = _to_python(metrics)
        now = time.perf_counter()
        m["tokens_per_second"] = tokens_since / max(now - t_last, 1e-9)
        m["skipped_steps"] = int(state.skipped_steps)
        util = sizing.mfu(m["tokens_per_second"], cfg, seq_len, mesh.size, peak)
        if util is not None:
          m["mfu"] = util
        logger.log_train(done, m)
        t_last, tokens_since = now, 0
        summary["loss"] = m["loss"]
      if (c.eval.every_steps and done % c.eval.every_steps == 0) or done == steps:
        ev = evaluate(eval_step, state.variables, c, mesh)
        logger.log_eval(done, ev)
        summary.update(ev)
        t_last = time.perf_counter()  # evaluation time is not training throughput
      if (c.checkpoint.every_steps and done % c.checkpoint.every_steps == 0) or done == steps:
        ckpt.save(done, state, data_iter.get_state(), config_json)
  ckpt.wait()
  ckpt.close()
  summary["final_step"] = int(state.step)
  return summary


def _init_from(state: TrainState, directory: str) -> TrainState:
  """Phase chaining: params and balancing biases from another run's latest checkpoint; optimizer
  state and step start fresh (a new phase has its own schedule)."""
  src = Checkpointer(directory if os.path.basename(directory.rstrip("/")) != "checkpoints"
                     else os.path.dirname(directory.rstrip("/")))
  step = src.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.train.init_from={directory!r}: no complete checkpoint there")
  restored, _, _ = src.restore(step, abstract_like(state))
  src.close()
  return dataclasses.replace(state, params=restored.params, balancing=restored.balancing)


FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Training config file (configs/<name>.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard.")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
  initialize_from_env()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.config is None or not FLAGS.workdir:
    raise app.UsageError("--config and --workdir are required")
  summary = train(FLAGS.config, FLAGS.workdir)
  print(json.dumps({"summary": summary}))


if __name__ == "__main__":
  app.run(main)
