"""Routing telemetry: what ZAYA1's router did at a training step, per layer and per expert.

The train step (zaya_jax/train_state.py) returns these with its metrics; the trainer logs them at
`logging.every_steps` to metrics.jsonl and TensorBoard (zaya_jax/metrics.py), and
`python -m zaya_jax.plot` draws them (zaya_jax/plot.py). Names, shapes and meaning (L layers, E
routed experts; class E of the router is the skip class; README "Metrics" lists them too):

  expert_load [L, E]         share of layer l's tokens routed to expert e at this step (the global
                             batch, every microbatch); a row plus expert_skip_fraction sums to 1, and
                             1/E is the balancing controller's target (zaya_jax/balancing.py)
  expert_skip_fraction [L]   share of the layer's tokens routed to the skip class (no expert MLP)
  expert_load_max_over_mean [L]   max_e / mean_e of the routed experts' loads (1 = balanced)
  expert_dead [L]            experts of the layer that got no token in any of the last
                             `logging.dead_expert_window` steps (counted by the trainer from every
                             step's expert_load, see `DeadExperts`; 0 until that many steps were seen)
  router_entropy [L]         mean over the layer's tokens of the entropy (nats) of the router's
                             softmax over the E+1 classes: ln(E+1) = uniform, 0 = certain
  balancing_bias [L, E]      the routed experts' balancing biases after the step's controller update
  balancing_skip_bias [L]    the skip class's bias (constant unless balancing.update_skip)

In metrics.jsonl an [L, E] value is a list of L lists of E numbers (`r["expert_load"][l][e]`); in
TensorBoard it is one scalar per layer and expert, `train/expert_load/layer_<l>/expert_<e>`; an [L]
value is `train/<name>/layer_<l>`. Other per-layer [L] metrics of the step (e.g. an expert
exchange's spill) follow the same rules without changes here.

Cost: the step computes a scalar entropy per block (ZayaBlock, next to the expert counts) and a few
[L, E] divisions; the trainer reads `expert_load` with each step's loss (one small transfer, in the
read it already makes) for the dead-expert window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.balancing import expert_load_stats, safe_div

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
