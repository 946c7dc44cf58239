"""Test set-up: 8 simulated CPU devices (multi-device code is tested on CPU), set before jax loads."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Identical programs (the same tiny train step in several tests and CLI subprocesses) compile once.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zaya_jax_test_xla_cache")
)
