"""zaya_jax: a JAX/XLA training stack for Zyphra's ZAYA1 mixture-of-experts LLM."""

import logging
import os

# The GPU compilers of the `gpu_compile` extra (`train --dry_run_target`, docs/conventions.md
# "Compiling for a GPU without one") are PJRT plugins that jax loads in every process. On a machine
# without GPUs the ROCm one refuses to initialise with a logged traceback and the CUDA one logs
# "Could not find cuda drivers" (C++ logging before it is initialised: not ours to silence), on every
# command, although nothing is wrong: the dry run registers the ROCm plugin itself when asked
# (zaya_jax/gpu_target.py). Its traceback is dropped here; ZAYA_DEBUG=1 shows it.


def _no_amd_gpu(record: logging.LogRecord) -> bool:
    """False (drop) for jax's "Jax plugin configuration error" when the ROCm plugin found no AMD GPU."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, ValueError) and "No AMD GPUs were found" in str(exc))


if not os.environ.get("ZAYA_DEBUG"):
    logging.getLogger("jax._src.xla_bridge").addFilter(_no_amd_gpu)
