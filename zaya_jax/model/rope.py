"""Partial rotary position embedding in the rotate-half layout (docs/model.md §1, HF
`apply_rotary_pos_emb`).

Only the first p = `rotary_dim` features of each head (head dim h) rotate; the rest pass through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(
    positions_bs: jax.Array, rotary_dim: int, theta: jax.Array | float
) -> tuple[jax.Array, jax.Array]:
    """positions [B, S] -> (cos, sin), each fp32 [B, S, P] (P = rotary_dim).

    `theta` may be a traced scalar (one per scanned layer). The frequency ladder is computed as in
    transformers (`1 / theta ** (arange(0, dim, 2) / dim)` in fp32) so the angles agree bit for bit.
    """
    exponent = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim
    inv_freq = 1.0 / (jnp.asarray(theta, jnp.float32) ** exponent)  # [P / 2]
    freqs = positions_bs.astype(jnp.float32)[..., None] * inv_freq  # [B, S, P / 2]
    # transformers takes cos / sin of [freqs, freqs]; here each half once (the same values). XLA:CPU
    # re-evaluates the concatenated form in every fusion that reads it (tiny's step: 29 sin / cos
    # of [B, S, P] against 3 of [B, S, P / 2] this way).
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def _rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_bsnh: jax.Array, cos_bsp: jax.Array, sin_bsp: jax.Array) -> jax.Array:
    """x [B, S, N, H] (any head count N); cos/sin [B, S, P] with P <= H. Rotates x[..., :P] and
    keeps x[..., P:]."""
    p = cos_bsp.shape[-1]
    cos, sin = cos_bsp[:, :, None, :], sin_bsp[:, :, None, :]
    x_rot, x_pass = x_bsnh[..., :p], x_bsnh[..., p:]
    x_rot = x_rot.astype(jnp.float32) * cos + _rotate_half(x_rot.astype(jnp.float32)) * sin
    return jnp.concatenate([x_rot.astype(x_bsnh.dtype), x_pass], axis=-1)
