"""zaya_jax/runtime/gpu_plugins.py: the GPU plugins' no-GPU notices are dropped from a command's output, all
else kept (the CLIs' one-line errors rely on it once the gpu_compile extra is installed)."""

import logging
import os
import subprocess
import sys

import pytest

import zaya_jax
from zaya_jax.runtime import gpu_plugins

NO_DRIVER = pytest.mark.skipif(gpu_plugins.nvidia_driver_present(), reason="an NVIDIA driver is present")


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except type(exc):
        info = sys.exc_info()
    return logging.LogRecord(
        "jax._src.xla_bridge", logging.ERROR, __file__, 1, "Jax plugin configuration error", (), info
    )


@NO_DRIVER
def test_no_gpu_records_are_dropped_others_kept():
    logger = logging.getLogger("jax._src.xla_bridge")
    assert gpu_plugins.drop_no_gpu_record in logger.filters
    assert not logger.filter(_record(ValueError("No AMD GPUs were found, skipping ROCm plugin init")))
    assert not logger.filter(_record(RuntimeError("Unable to load CUDA. Is it installed?")))
    assert logger.filter(_record(ValueError("something else")))
    assert logger.filter(_record(RuntimeError("No AMD GPUs were found")))
    assert logger.filter(_record(ValueError("Unable to load CUDA. Is it installed?")))


def test_stub_notices_removed_other_lines_kept():
    preamble = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    stub = "I0000 00:00:1.2  7 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n"
    other = "W0000 something.cc:1] a real warning\n"
    assert gpu_plugins.without_stub_notices(preamble + stub + preamble + stub) == ""
    assert gpu_plugins.without_stub_notices(preamble + other + stub + "error: x\n") == preamble + other + "error: x\n"


@NO_DRIVER
@pytest.mark.parametrize("platforms", [None, "cpu"])
def test_a_fresh_process_prints_only_its_own_stderr(platforms):
    """`import zaya_jax` then starting jax's backends: stderr holds only what the program wrote (the
    plugins' notices and tracebacks, when the extra is installed, are gone), even on fd 2."""
    code = (
        "import os, zaya_jax, jax; jax.devices(); "
        "os.write(2, b'native line\\n'); import sys; print('python line', file=sys.stderr)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ZAYA_DEBUG", "JAX_PLATFORMS")}
    env |= {"JAX_PLATFORMS": platforms} if platforms else {}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert proc.stderr.splitlines() == ["native line", "python line"], proc.stderr
    assert zaya_jax.runtime.gpu_plugins is gpu_plugins
