"""The training loop that `python -m zaya_jax.train` runs, and its evaluations."""
