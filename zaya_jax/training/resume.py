"""What a resume may change: the checks of a run's config against the config saved with the
checkpoint it resumes from, before the run continues.

- A finished run (train.steps <= the checkpoint's step) has nothing to do: said in one line.
- Other training data (data.path / data.mixture) is refused unless data.allow_path_change.
- A learning-rate schedule that differs from the saved one over the steps still to run (another
  train.steps, or another optim.lr / schedule / warmup / decay) is refused unless
  train.allow_schedule_change; allowed, the change is said in one line.
The tensors themselves (another model or optimizer) are checked by zaya_jax/training/checkpoint.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections
import numpy as np

from zaya_jax import config as config_lib
from zaya_jax.optim.chain import lr_schedule
from zaya_jax.runtime.cli import UserError
from zaya_jax.training.checkpoint import config_diff

SCHEDULE_KEYS = (
    "lr",
    "schedule",
    "warmup_steps",
    "decay_fraction",
    "decay_steps",
    "decay_shape",
    "final_lr_fraction",
)
MAX_COMPARED_STEPS = 100_000  # schedules are compared on at most this many of the steps to run


def check(saved: dict[str, Any], c: ml_collections.ConfigDict, step: int, where: str) -> list[str]:
    """The lines to print on resuming config `c` from checkpoint `step` (`where`: its directory)
    saved with config `saved` (JSON); UserError (one line, naming the override) on a refused change."""
    if step >= c.train.steps:
        of = f"of {c.train.steps}" if step == c.train.steps else f"(past train.steps={c.train.steps})"
        return [f"already at step {step} {of}; nothing to do"]
    _check_data(saved, c, where)
    change = schedule_change(saved, c, step)
    if change is None:
        return []
    if not c.train.allow_schedule_change:
        old_steps = saved.get("train", {}).get("steps")
        same = f" (--config.train.steps={old_steps})" if old_steps != c.train.steps else ""
        raise UserError(
            f"resuming {where} would re-plan its learning-rate schedule ({change}); resume with the "
            f"checkpoint's settings{same}, or pass --config.train.allow_schedule_change=True to re-plan it"
        )
    return [f"re-planned the learning-rate schedule ({change})"]


def _data(d: dict[str, Any]) -> tuple[str | None, str | None]:
    data = d.get("data", {})
    return data.get("path"), data.get("mixture")


def _same_path(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _check_data(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Refuses other training data than the checkpoint's, unless data.allow_path_change."""
    (old_path, old_mix), (new_path, new_mix) = _data(saved), (c.data.path, c.data.mixture)
    if _same_path(old_path, new_path) and old_mix == new_mix:
        return
    if c.data.allow_path_change:
        return
    key, old, new = (
        ("data.mixture", old_mix, new_mix) if old_mix or new_mix else ("data.path", old_path, new_path)
    )
    name = lambda v: repr(v) if v else "unset (the embedded corpus)"
    raise UserError(
        f"config.{key}={name(new)}: {where} was trained with {key}={name(old)}; resume with that data, "
        "or pass --config.data.allow_path_change=True to continue on this one"
    )


def schedule_change(saved: dict[str, Any], c: ml_collections.ConfigDict, step: int) -> str | None:
    """'train.steps: checkpoint 6, config 8; lr at step 7: 0 planned, 0.003 now' where the learning
    rate of the steps still to run (step + 1 .. train.steps) differs from the saved run's plan, else
    None. A config the code can no longer read is not compared."""
    try:
        old_c = config_lib.from_json(saved)
        old_schedule = lr_schedule(old_c, old_c.train.steps)
    except (ValueError, TypeError, AttributeError, KeyError):
        return None
    counts = np.arange(step, c.train.steps)  # the optimizer step counts of the updates to run
    if counts.size > MAX_COMPARED_STEPS:
        counts = np.unique(np.linspace(step, c.train.steps - 1, MAX_COMPARED_STEPS).astype(np.int64))
    old = np.asarray(old_schedule(counts))
    new = np.asarray(lr_schedule(c, c.train.steps)(counts))
    differs = ~np.isclose(old, new, rtol=1e-6, atol=0.0)
    if not differs.any():
        return None
    i = int(np.argmax(differs))
    current = _json(c)
    keys = [d for d in config_diff(saved, current, ("train",)) if d.startswith("train.steps:")]
    keys += [
        d
        for d in config_diff(saved, current, ("optim",))
        if d.split(":")[0][len("optim.") :] in SCHEDULE_KEYS
    ]
    what = "; ".join(keys) or "the schedule's code"
    return f"{what}; lr at step {counts[i] + 1}: {old[i]:.3g} planned, {new[i]:.3g} now"


def _json(c: ml_collections.ConfigDict) -> dict[str, Any]:
    return json.loads(c.to_json_best_effort())
