"""ZAYA1 residual scaling: `(y + b_y) * s_y + (h + b_h) * s_h`, per channel, in fp32 (docs/model.md §2)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class ResidualScaling(nn.Module):
    """Combines a sub-layer output y [..., d] with the fp32 residual stream h [..., d] -> fp32 [..., d].

    Bias is added before the scale (HF `ZayaResidualScaling`); scales init 1 and biases 0, so at init
    this is the plain residual sum.
    """

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, y: jax.Array, h: jax.Array) -> jax.Array:
        d = h.shape[-1]
        p = lambda name, init: self.param(name, init, (d,), self.param_dtype).astype(jnp.float32)
        y = (y.astype(jnp.float32) + p("hidden_states_bias", nn.initializers.zeros)) * p(
            "hidden_states_scale", nn.initializers.ones
        )
        h = (h.astype(jnp.float32) + p("residual_bias", nn.initializers.zeros)) * p(
            "residual_scale", nn.initializers.ones
        )
        return y + h
