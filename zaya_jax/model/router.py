"""The ZAYA1 router (docs/model.md §2.2.1): an MLP router with exponential depth averaging (EDA).

  r = x W_down + b_down                      [B, S, R]
  r = r + router_states_scale * r_prev       (EDA; r_prev is zeros at block 0, which adds nothing)
  s = out_proj(gelu(fc2(gelu(fc1(rmsnorm(r))))))   [B, S, E+1]; class E is the "skip" expert
  p = softmax(s); e = argmax(p + balancing_biases); w = p[e]

The biases change which class wins, never the weight, and carry no gradient: they live in the
`balancing` variable collection and are updated by the trainer from expert counts (aux-loss-free
balancing). The router runs in fp32 whatever the compute dtype: its argmax decides discrete routing,
and bf16 rounding there flips choices for near-ties.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.norm import RMSNorm

BALANCING = "balancing"  # variable collection of the balancing biases


def init_balancing_biases(num_experts: int) -> jax.Array:
    """[E+1] zeros with the skip class at -1, as transformers initialises them."""
    return jnp.zeros((num_experts + 1,), jnp.float32).at[num_experts].set(-1.0)


def _fp32_dense(cfg: ZayaConfig, features: int, name: str, bias: bool = True) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=jnp.float32,
        param_dtype=cfg.params_dtype,
        name=name,
        kernel_init=nn.initializers.normal(cfg.initializer_range),
    )


class Routing(NamedTuple):
    """expert_bs: chosen class in [0, E] (E = skip) [B, S] int32; weight_bs: p[chosen] [B, S] fp32
    (0 for skip); probs_bse: softmax over E+1 classes [B, S, E+1]; next_state_bsr: pre-norm router
    state passed to the next block [B, S, R]."""

    expert_bs: jax.Array
    weight_bs: jax.Array
    probs_bse: jax.Array
    next_state_bsr: jax.Array


class ZayaRouter(nn.Module):
    cfg: ZayaConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, prev_state_bsr: jax.Array) -> Routing:
        cfg = self.cfg
        r_dim = cfg.router_hidden_size
        r = _fp32_dense(cfg, r_dim, "down_proj")(x_bsd.astype(jnp.float32))
        scale = self.param("router_states_scale", nn.initializers.ones, (r_dim,), cfg.params_dtype)
        r = r + prev_state_bsr.astype(jnp.float32) * scale.astype(jnp.float32)
        logits = RouterMLP(cfg, name="router_mlp")(r)
        probs = jax.nn.softmax(logits, axis=-1)
        biases = self.variable(BALANCING, "balancing_biases", init_balancing_biases, cfg.num_experts).value
        expert = jnp.argmax(jax.lax.stop_gradient(probs) + biases, axis=-1).astype(jnp.int32)
        weight = jnp.take_along_axis(probs, expert[..., None], axis=-1)[..., 0]
        weight = jnp.where(expert == cfg.num_experts, 0.0, weight)  # the skip class outputs nothing
        return Routing(expert, weight, probs, r)


class RouterMLP(nn.Module):
    """[.., R] -> logits [.., E+1]: RMSNorm, two exact-GELU layers, a bias-free output layer."""

    cfg: ZayaConfig

    @nn.compact
    def __call__(self, r: jax.Array) -> jax.Array:
        cfg = self.cfg
        z = RMSNorm(cfg.rms_norm_eps, jnp.float32, cfg.params_dtype, name="norm")(r)
        z = jax.nn.gelu(_fp32_dense(cfg, cfg.router_hidden_size, "fc1")(z), approximate=False)
        z = jax.nn.gelu(_fp32_dense(cfg, cfg.router_hidden_size, "fc2")(z), approximate=False)
        return _fp32_dense(cfg, cfg.num_router_classes, "out_proj", bias=False)(z)
