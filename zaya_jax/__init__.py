"""zaya_jax: a JAX/XLA training stack for Zyphra's ZAYA1 mixture-of-experts LLM."""
