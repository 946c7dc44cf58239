"""Learning-rate schedules (optax schedules: ``step -> lr``, float32 scalars).

Step convention (shared by all schedules), for ``total_steps`` optimizer steps
numbered ``0 .. total_steps - 1``:

* warmup ``[0, warmup_steps)``: ``lr = peak * (step + 1) / warmup_steps`` — the
  first step already moves (no wasted zero-LR step) and the last warmup step
  reaches ``peak``.
* stable ``[warmup_steps, total_steps - decay_steps)``: ``lr = peak``.
* decay ``[total_steps - decay_steps, total_steps)``: progress
  ``p = (step - decay_start + 1) / decay_steps`` goes ``1/decay_steps .. 1`` and
  ``lr = final + (peak - final) * shape(p)``, so the LAST step uses exactly
  ``final = peak * final_lr_fraction``.
* steps ``>= total_steps`` keep ``final``.

Decay shapes ``shape(p)`` (1 at p=0, 0 at p=1):
  ``linear``: ``1 - p``; ``cosine``: ``(1 + cos(pi p)) / 2``;
  ``sqrt``: ``1 - sqrt(p)`` (the "1-sqrt" cooldown of Hägele et al. 2024).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import optax

DECAY_SHAPES = ("linear", "cosine", "sqrt")


def _check_int(name: str, value: Any, minimum: int) -> int:
    # Accept numpy ints and integral floats (e.g. 1e4 from a config file).
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    ):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _as_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a number, got {value!r}") from e


def _check_fraction(name: str, value: Any) -> float:
    value = _as_float(name, value)
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def _check_peak(peak_lr: Any) -> float:
    peak_lr = _as_float("peak_lr", peak_lr)
    if not peak_lr >= 0.0 or math.isinf(peak_lr):
        raise ValueError(f"peak_lr must be a finite value >= 0, got {peak_lr}")
    return peak_lr


def _piecewise(
    peak_lr: float,
    total_steps: int,
    warmup_steps: int,
    decay_steps: int,
    final_lr_fraction: float,
    decay_shape: str,
) -> optax.Schedule:
    """Shared warmup -> stable -> decay curve; arguments already validated."""
    final_lr = peak_lr * final_lr_fraction
    decay_start = total_steps - decay_steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak_lr * jnp.minimum((step + 1.0) / max(warmup_steps, 1), 1.0)
        p = jnp.clip((step - decay_start + 1.0) / max(decay_steps, 1), 0.0, 1.0)
        if decay_shape == "linear":
            frac = 1.0 - p
        elif decay_shape == "cosine":
            frac = 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        else:  # "sqrt"
            frac = 1.0 - jnp.sqrt(p)
        decayed = final_lr + (peak_lr - final_lr) * frac
        lr = jnp.where(step < warmup_steps, warm, peak_lr)
        if decay_steps > 0:
            lr = jnp.where(step >= decay_start, decayed, lr)
        return lr.astype(jnp.float32)

    return schedule


def warmup_stable_decay(
    peak_lr: float,
    total_steps: int,
    warmup_steps: int,
    decay_steps: int | None = None,
    decay_fraction: float | None = None,
    final_lr_fraction: float = 0.0,
    decay_shape: str = "linear",
) -> optax.Schedule:
    """Warmup-stable-decay (WSD / trapezoidal) schedule; see module doc.

    Exactly one of ``decay_steps`` / ``decay_fraction`` (of ``total_steps``,
    rounded) must be given; 0 means no decay (warmup then constant).
    Requires ``warmup_steps + decay_steps <= total_steps``.
    """
    peak_lr = _check_peak(peak_lr)
    total_steps = _check_int("total_steps", total_steps, 1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    final_lr_fraction = _check_fraction("final_lr_fraction", final_lr_fraction)
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"decay_shape must be one of {DECAY_SHAPES}, got {decay_shape!r}")
    if (decay_steps is None) == (decay_fraction is None):
        raise ValueError(
            "give exactly one of decay_steps / decay_fraction, got "
            f"decay_steps={decay_steps!r}, decay_fraction={decay_fraction!r}"
        )
    if decay_steps is None:
        decay_steps = round(_check_fraction("decay_fraction", decay_fraction) * total_steps)
    decay_steps = _check_int("decay_steps", decay_steps, 0)
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) + decay_steps ({decay_steps}) exceed total_steps ({total_steps})"
        )
    return _piecewise(peak_lr, total_steps, warmup_steps, decay_steps, final_lr_fraction, decay_shape)


def warmup_cosine(
    peak_lr: float,
    total_steps: int,
    warmup_steps: int,
    final_lr_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup then cosine decay over all remaining steps to
    ``peak_lr * final_lr_fraction`` at the last step. Requires
    ``warmup_steps < total_steps``."""
    total_steps = _check_int("total_steps", total_steps, 1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    if warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps}) so at least one step decays"
        )
    return warmup_stable_decay(
        peak_lr,
        total_steps,
        warmup_steps,
        decay_steps=total_steps - warmup_steps,
        final_lr_fraction=final_lr_fraction,
        decay_shape="cosine",
    )


def warmup_constant(peak_lr: float, total_steps: int, warmup_steps: int = 0) -> optax.Schedule:
    """Linear warmup then ``peak_lr`` forever (``total_steps`` only validates
    ``warmup_steps <= total_steps``)."""
    return warmup_stable_decay(peak_lr, total_steps, warmup_steps, decay_steps=0)


_SCHEDULES = {
    "wsd": warmup_stable_decay,
    "cosine": warmup_cosine,
    "constant": warmup_constant,
}
SCHEDULE_NAMES = tuple(_SCHEDULES)


def make_schedule(name: str, **kwargs: Any) -> optax.Schedule:
    """Dispatch by name: ``"wsd"`` -> :func:`warmup_stable_decay`, ``"cosine"`` ->
    :func:`warmup_cosine`, ``"constant"`` -> :func:`warmup_constant`; ``kwargs``
    are passed through. Unknown names or arguments raise ValueError."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULE_NAMES}")
    fn = _SCHEDULES[name]
    try:
        return fn(**kwargs)
    except TypeError as e:  # wrong/missing keyword: report it as a config error
        raise ValueError(f"bad arguments for schedule {name!r}: {e}") from e
