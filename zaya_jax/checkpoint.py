"""Orbax checkpoints of the whole training run under WORKDIR/checkpoints/<step>/.

Each checkpoint holds `state` (params, optimizer state, balancing biases and their optimizer, step),
`data` (the grain iterator state, JSON) and `config` (the training config, JSON). Orbax writes a
step into a temporary directory and renames it when complete, so a crash mid-save never leaves a
checkpoint that `latest_step` would pick. Saves are asynchronous: training continues while the
arrays are written; `wait()` blocks until the last save is durable.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """A thin, typed wrapper over `ocp.CheckpointManager` for our three items."""

  def __init__(self, workdir: str, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep or None, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict | None, config: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {}),
        config=ocp.args.JsonSave(config)), force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """Restores into `abstract_state` (a pytree of jax.ShapeDtypeStruct with shardings)."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore()))
    return out.state, out.data, out.config

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete pytree: the restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                      tree)
