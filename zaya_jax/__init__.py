"""zaya_jax: a JAX/XLA training stack for Zyphra's ZAYA1 mixture-of-experts LLM."""

import logging
import os

from zaya_jax.runtime import gpu_plugins

# jax is imported here, before any command's own imports, so that what the GPU compilers of the
# `gpu_compile` extra print on a machine without a GPU stays out of every command's output
# (zaya_jax/runtime/gpu_plugins.py); ZAYA_DEBUG=1 shows it.
if os.environ.get("ZAYA_DEBUG", "") in ("", "0"):
    logging.getLogger("jax._src.xla_bridge").addFilter(gpu_plugins.drop_no_gpu_record)
gpu_plugins.import_jax()

from zaya_jax.runtime import compile_cache  # after gpu_plugins.import_jax(): it imports jax

# CPU programs of several devices with a collective inside a loop stay out of jax's persistent
# compilation cache: read back from it, XLA:CPU can deadlock in them (zaya_jax/runtime/compile_cache.py).
compile_cache.install()
