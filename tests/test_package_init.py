"""zaya_jax/__init__.py: the ROCm plugin's "no AMD GPU" traceback is dropped, other plugin errors kept."""

import logging
import sys

import zaya_jax


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except type(exc):
        info = sys.exc_info()
    return logging.LogRecord(
        "jax._src.xla_bridge", logging.ERROR, __file__, 1, "Jax plugin configuration error", (), info
    )


def test_no_amd_gpu_record_is_dropped_others_kept():
    logger = logging.getLogger("jax._src.xla_bridge")
    assert zaya_jax._no_amd_gpu in logger.filters
    assert not logger.filter(_record(ValueError("No AMD GPUs were found, skipping ROCm plugin init")))
    assert logger.filter(_record(ValueError("something else")))
    assert logger.filter(_record(RuntimeError("No AMD GPUs were found")))
