"""Test set-up: 8 simulated CPU devices (multi-device code is tested on CPU), set before jax loads."""

import os
import tempfile

from xla_env import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# `python -m zaya_jax.train` re-executes itself once to set this (zaya_jax/host_memory.py); set
# here, the CLI subprocesses start with it (tests/test_train.py runs one without it).
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
# Identical programs (the same tiny train step in several tests and CLI subprocesses) compile once.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zaya_jax_test_xla_cache")
)

import jax

# The test process itself reads the cache but never writes it (the CLI subprocesses it starts
# write): XLA:CPU (jax 0.10.2) aborted the whole process serializing an executable into the cache
# late in the full suite (three CI runs; the same compile alone serializes fine). jax reads the
# minimum compile time at every write, so this holds for every compile of the session.
jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
