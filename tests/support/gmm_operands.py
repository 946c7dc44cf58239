"""Random operands of the grouped matmul kernels."""

import jax
import jax.numpy as jnp


def operands(t, k, n, g, dtype, seed=0):
    """lhs [t, k] and rhs [g, k, n] in `dtype`, the output's cotangent [t, n] in float32."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    lhs = jax.random.normal(ks[0], (t, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(ks[1], (g, k, n), jnp.float32).astype(dtype)
    dout = jax.random.normal(ks[2], (t, n), jnp.float32)
    return lhs, rhs, dout
