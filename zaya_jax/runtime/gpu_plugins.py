"""What jax's GPU plugins print on a machine without that GPU, kept out of every command's output.

The `gpu_compile` extra (`train --dry_run_target`, docs/conventions.md "Compiling for a GPU without
one") installs XLA's CUDA and ROCm compilers as PJRT plugins, which jax loads in every process:

* `import jax` loads the CUDA plugin's kernels (`jax_cuda12_plugin._versions`, `_sparse`, ...),
  each a library with its own copy of absl logging that says, before logging is initialised, "Could
  not find cuda drivers on your machine" on stderr (three times; a fourth when the plugin registers).
  That is C++ writing to file descriptor 2: `quiet_native_stderr` captures the descriptor while it
  happens and replays every other line.
* When jax starts its backends, the CUDA plugin's version check ("Unable to load CUDA. Is it
  installed?") and the ROCm plugin ("No AMD GPUs were found") fail and jax logs each with a
  traceback: `drop_no_gpu_record` filters those two records out of jax's logger.

Both are dropped only on a machine where that GPU's driver is absent (the NVIDIA driver's
`libcuda.so.1` does not load; the ROCm plugin checks for AMD GPUs itself): where the driver is there,
the same message is a real error and stays. `ZAYA_DEBUG=1` keeps everything.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# the CUDA stub's notice and the absl line that precedes each library's first log
_STUB_NOTICE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine")
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


@functools.cache
def nvidia_driver_present() -> bool:
    """True if the NVIDIA driver library (what the CUDA plugin needs to run anything) loads."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def without_stub_notices(text: str) -> str:
    """`text` less the CUDA stub's "no driver" lines and the absl preamble right before each."""
    lines = text.splitlines(keepends=True)
    kept = []
    for i, line in enumerate(lines):
        if _STUB_NOTICE.search(line):
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() == _ABSL_PREAMBLE and _STUB_NOTICE.search(following):
            continue
        kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """File descriptor 2 goes to a temporary file inside the block; afterwards what was written is
    replayed on stderr less `without_stub_notices`. Nothing is captured where the driver is present,
    ZAYA_DEBUG is set, or descriptor 2 cannot be duplicated."""
    if nvidia_driver_present() or os.environ.get("ZAYA_DEBUG", "") not in ("", "0"):
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        sys.stderr.flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            rest = without_stub_notices(capture.read().decode(errors="replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def import_jax() -> None:
    """`import jax` with the stub's notices dropped; where the platforms are already pinned
    (JAX_PLATFORMS), the plugins register now too, since registering loads the CUDA plugin's library
    (a fourth notice). Unpinned, registration waits for jax's backends: pinning them later (the GPU
    dry run, zaya_jax/runtime/gpu_target.prepare_process) must still be possible."""
    with quiet_native_stderr():
        import jax

        if jax.config.jax_platforms:
            register_plugins()


def register_plugins() -> None:
    """jax's plugin discovery and registration (each plugin's `initialize()`), its notices dropped."""
    from jax._src import xla_bridge

    with quiet_native_stderr():
        xla_bridge._discover_and_register_pjrt_plugins()


def drop_no_gpu_record(record: logging.LogRecord) -> bool:
    """A `logging` filter: False (drop) for jax's "Jax plugin configuration error" records of a GPU
    plugin that found no GPU of its kind on this machine; True (keep) for every other record."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, ValueError) and "No AMD GPUs were found" in str(exc):
        return False
    cuda_missing = isinstance(exc, RuntimeError) and "Unable to load CUDA" in str(exc)
    return not (cuda_missing and not nvidia_driver_present())
