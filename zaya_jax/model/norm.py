"""RMSNorm with fp32 statistics (docs/model.md §1.1: eps 1e-5, fp32 statistics).

Matches `transformers` ZayaRMSNorm: the weight multiplies the normalised activations (no `1 + w`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x [..., d] -> fp32 x / sqrt(mean(x^2) + eps) over the last axis."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """[..., d] -> [..., d] in `dtype`; the statistics are always fp32."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return (rms_normalize(x, self.eps) * scale.astype(jnp.float32)).astype(self.dtype)
