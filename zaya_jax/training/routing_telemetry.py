"""Routing telemetry: what ZAYA1's router did at a training step, per layer and per expert.

Every name, shape and meaning: docs/reference/metrics.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.optim.balancing import expert_load_stats, safe_div

# The metric names this module defines (the step's metrics dict, metrics.jsonl, TensorBoard).
STEP_METRICS = (
    "expert_load",
    "expert_skip_fraction",
    "expert_load_max_over_mean",
    "router_entropy",
    "balancing_bias",
    "balancing_skip_bias",
)
DEAD = "expert_dead"


def step_metrics(
    counts_le: jax.Array, entropy_l: jax.Array, biases_le: jax.Array, num_experts: int
) -> dict[str, jax.Array]:
    """The step's routing metrics (module docstring) from the global expert counts [L, E+1] (class E
    = skip), the summed router entropies [L] over the same tokens, and the biases [L, E+1] after the
    update. Pure and jit-able."""
    counts = jnp.asarray(counts_le, jnp.float32)
    tokens_l1 = jnp.sum(counts, axis=-1, keepdims=True)
    load = expert_load_stats(counts, num_experts)
    biases = jnp.asarray(biases_le, jnp.float32)
    return {
        "expert_load": safe_div(counts[:, :num_experts], tokens_l1),
        "expert_skip_fraction": load["skip_fraction"],
        "expert_load_max_over_mean": load["load_max_over_mean"],
        "router_entropy": safe_div(jnp.asarray(entropy_l, jnp.float32), tokens_l1[:, 0]),
        "balancing_bias": biases[:, :num_experts],
        "balancing_skip_bias": biases[:, num_experts],
    }


class DeadExperts:
    """Counts, per layer, the experts that got no token in any of the last `window` steps, from the
    `expert_load` [L, E] of every step (host side, numpy). Steps before the first observed one are
    unknown, so no expert counts as dead until `window` steps were observed; `reset` (after a
    rollback) starts over."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"dead-expert window must be >= 1 step, got {window}")
        self.window = window
        self.reset()

    def reset(self) -> None:
        self._last_seen: np.ndarray | None = None  # [L, E] int64: the last step an expert got a token

    def observe(self, step: int, load_le) -> None:
        """Step `step`'s expert_load [L, E] (any array-like)."""
        routed = np.asarray(load_le) > 0
        if self._last_seen is None:
            self._last_seen = np.full(routed.shape, step - 1, np.int64)  # "seen" just before the start
        self._last_seen[routed] = step

    def count(self, step: int) -> np.ndarray:
        """[L] int: experts idle in every one of steps step - window + 1 .. step."""
        if self._last_seen is None:
            return np.zeros((0,), np.int64)
        return np.sum(step - self._last_seen >= self.window, axis=-1)
