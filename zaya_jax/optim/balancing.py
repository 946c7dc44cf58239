"""Aux-loss-free load balancing of the ZAYA1 router (docs/model.md §2.2.4).

The controller, global counts and the skip class: docs/design/balancing.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

# Where the biases live inside the model's variables (see zaya_jax/model/router.py): the
# "balancing" collection, stacked over the scanned layers -> [L, E+1].
BIASES_PATH = ("balancing", "layers", "mlp", "gate", "balancing_biases")

FRACTION_OF = ("all", "routed")


@dataclasses.dataclass(frozen=True)
class BalancingConfig:
    """Hyper-parameters of the bias controller (frozen: usable as a static jit argument).

    lr, b1, b2, eps, weight_decay: the AdamW step (decoupled decay pulls biases towards 0).
    update_skip: also move the skip-class bias (default False; see module docstring).
    skip_target: the skip share (of all tokens) aimed at when update_skip; None = 1/E (the spec
      formula).
    fraction_of: "all" = f_e over every non-padding token (spec); "routed" = over routed tokens.
    """

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    update_skip: bool = False
    skip_target: float | None = None
    fraction_of: str = "all"

    def validate(self) -> BalancingConfig:
        """Raise ValueError on an invalid field; returns self for chaining."""
        if not self.lr > 0:
            raise ValueError(f"balancing lr must be > 0, got {self.lr}")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"balancing {name} must be in [0, 1), got {v}")
        if not self.eps > 0:
            raise ValueError(f"balancing eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"balancing weight_decay must be >= 0, got {self.weight_decay}")
        if self.skip_target is not None and not 0.0 <= self.skip_target <= 1.0:
            raise ValueError(f"balancing skip_target must be in [0, 1], got {self.skip_target}")
        if self.fraction_of not in FRACTION_OF:
            raise ValueError(f"balancing fraction_of must be one of {FRACTION_OF}, got {self.fraction_of!r}")
        return self


def from_config(section: Any) -> BalancingConfig | None:
    """The validated BalancingConfig of a training config's `balancing` section (its keys are this
    dataclass's fields plus `enabled`; zaya_jax/config.py derives them); None when not enabled."""
    if not section.enabled:
        return None
    fields = {f.name for f in dataclasses.fields(BalancingConfig)}
    return BalancingConfig(**{k: v for k, v in section.items() if k in fields}).validate()


def _optimizer(cfg: BalancingConfig) -> optax.GradientTransformation:
    return optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def init_balancing_state(biases_le: jax.Array, cfg: BalancingConfig) -> optax.OptState:
    """AdamW state for biases [L, E+1] (moments [L, E+1] fp32 + a step count)."""
    cfg.validate()
    return _optimizer(cfg).init(jnp.asarray(biases_le, jnp.float32))


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, 0 where den == 0 (the double where keeps gradients and values NaN-free)."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def expert_load_stats(counts_le: jax.Array, num_experts: int) -> dict[str, jax.Array]:
    """Per-layer load statistics from token counts [L, E+1] (class E = skip). Each value is [L]:

    load_max_over_mean: max_e count_e / mean_e count_e over the E routed experts (1 = balanced,
      E = everything on one expert); 1.0 for a layer that routed no token.
    load_min_over_mean: the same with min (0 = some expert idle); 1.0 when nothing was routed.
    skip_fraction: skipped tokens / all tokens; 0 for an empty batch.
    """
    counts = jnp.asarray(counts_le, jnp.float32)
    routed = counts[:, :num_experts]
    mean = jnp.mean(routed, axis=-1)
    empty = mean <= 0
    total = jnp.sum(counts, axis=-1)
    return {
        "load_max_over_mean": jnp.where(empty, 1.0, safe_div(jnp.max(routed, axis=-1), mean)),
        "load_min_over_mean": jnp.where(empty, 1.0, safe_div(jnp.min(routed, axis=-1), mean)),
        "skip_fraction": safe_div(counts[:, num_experts], total),
    }


def balancing_gradient(counts_le: jax.Array, cfg: BalancingConfig) -> jax.Array:
    """The controller's pseudo-gradient [L, E+1]: f_e - 1/E for routed experts; for the skip
    class f_skip - skip_target if cfg.update_skip else 0. Zero for a layer without tokens."""
    counts = jnp.asarray(counts_le, jnp.float32)
    num_experts = counts.shape[-1] - 1
    total = jnp.sum(counts, axis=-1, keepdims=True)
    if cfg.fraction_of == "routed":
        denom = jnp.sum(counts[:, :num_experts], axis=-1, keepdims=True)
    else:
        denom = total
    # f_e - 1/E as (E c_e - N) / (E N): the numerator is exact for integer counts, so an exactly
    # balanced expert gets exactly 0. (A rounding residue of ~1e-9 would not be harmless: Adam
    # divides by sqrt(v) + eps, eps = 1e-8, and turns it into a step of a sizeable fraction of lr.)
    grad = safe_div(num_experts * counts - denom, num_experts * denom)
    if cfg.update_skip:
        # The skip share is always over all tokens (over routed ones it could exceed 1).
        skip, n = counts[:, num_experts], total[:, 0]
        if cfg.skip_target is None:
            skip_grad = safe_div(num_experts * skip - n, num_experts * n)
        else:
            skip_grad = safe_div(skip - cfg.skip_target * n, n)
        grad = grad.at[:, num_experts].set(skip_grad)
    else:
        grad = grad.at[:, num_experts].set(0.0)
    return grad  # safe_div made it 0 for a layer without (routed) tokens


def balancing_update(
    biases_le: jax.Array, counts_le: jax.Array, state: optax.OptState, cfg: BalancingConfig
) -> tuple[jax.Array, optax.OptState, dict[str, jax.Array]]:
    """One controller step: biases [L, E+1], GLOBAL counts [L, E+1] (see module docstring), state.

    Returns (new biases [L, E+1] fp32, new state, metrics). Metrics, each [L], describe the load
    that produced ``counts_le`` (i.e. under the old biases): the :func:`expert_load_stats` keys
    plus ``bias_spread`` = max - min of the new routed-expert biases.
    """
    cfg.validate()  # Python-side, once per trace under jit
    biases = jnp.asarray(biases_le, jnp.float32)
    counts_le = jnp.asarray(counts_le, jnp.float32)
    num_experts = biases.shape[-1] - 1
    if counts_le.shape != biases.shape:
        raise ValueError(f"counts {counts_le.shape} and biases {biases.shape} must both be [L, E+1]")
    grad = balancing_gradient(counts_le, cfg)
    tx = _optimizer(cfg)
    updates, new_state = tx.update(grad, state, biases)
    new_biases = optax.apply_updates(biases, updates)
    if not cfg.update_skip:
        # Weight decay would otherwise still move the skip bias with a zero gradient.
        new_biases = new_biases.at[:, num_experts].set(biases[:, num_experts])
    # No token anywhere (e.g. an all-padding batch): nothing was observed, so change nothing;
    # not even the Adam step count / momentum, which a zero gradient would still advance.
    has_tokens = jnp.sum(counts_le) > 0
    new_biases = jnp.where(has_tokens, new_biases, biases)
    new_state = jax.tree.map(lambda n, o: jnp.where(has_tokens, n, o), new_state, state)
    metrics = expert_load_stats(counts_le, num_experts)
    routed = new_biases[:, :num_experts]
    metrics["bias_spread"] = jnp.max(routed, axis=-1) - jnp.min(routed, axis=-1)
    return new_biases, new_state, metrics


def get_balancing_biases(variables: dict[str, Any]) -> jax.Array:
    """The [L, E+1] biases out of the model variables {"params", "balancing"}."""
    node = variables
    for key in BIASES_PATH:
        node = node[key]
    return node


def set_balancing_biases(variables: dict[str, Any], biases_le: jax.Array) -> dict[str, Any]:
    """A copy of ``variables`` with the biases replaced (other leaves shared, not copied)."""

    def replace(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        out = dict(node)
        out[path[0]] = biases_le if len(path) == 1 else replace(node[path[0]], path[1:])
        return out

    return replace(variables, BIASES_PATH)
