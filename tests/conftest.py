"""Test set-up: 8 simulated CPU devices (multi-device code is tested on CPU), set before jax loads."""

import collections
import os
import sys
import tempfile

import pytest

# The shared helpers' asserts report the values they compared, as the test files' own asserts do.
pytest.register_assert_rewrite("support")

from support.xla_env import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# `python -m zaya_jax.train` re-executes itself once to set this (zaya_jax/runtime/host_memory.py); set
# here, the CLI subprocesses start with it (tests/test_train.py runs one without it).
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
# Identical programs (the same tiny train step in several tests, test files, pytest workers and CLI
# subprocesses) compile once: every process reads and writes the cache. Not the CPU programs of
# several devices with a collective in a loop: zaya_jax/runtime/compile_cache.py keeps them out
# (they can deadlock read back).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zaya_jax_test_xla_cache")
)
# Programs of 0.2 s of compile or more are written (jax writes from 1 s): the CLI runs' eval steps
# and initializers (0.2 to 0.9 s each) were compiled again in every process.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import gc

import jax

from zaya_jax.runtime import python_gc

# The CLIs' garbage-collector setting (zaya_jax/runtime/python_gc.py): tracing collects less often.
python_gc.collect_rarely()

# The test files that keep one worker longest, longest first: the files whose tests took 40 s or
# more in a whole-suite run (`make test ARGS=--durations=0`, docs/performance.md "Test suite").
# pytest-xdist hands whole files out in collection order (`make test`: --dist loadfile
# --no-loadscope-reorder), so these start first and no long file starts last, alone at the end.
# The other files follow, most tests first.
HEAVIEST_FIRST = (
    "test_zero1.py",
    "test_benchmarks.py",
    "test_zero1_master.py",
    "test_gpu_compile.py",
    "test_train.py",
    "test_lm_eval_backend.py",
    "test_context_parallel.py",
    "test_cli_errors.py",
    "test_dry_run.py",
    "test_checkpoint.py",
    "test_train_state.py",
    "test_remat.py",
    "test_train_start.py",
    "test_expert_exchange.py",
    "test_reshard.py",
    "test_parallel.py",
    "test_mixture_ramp.py",
    "test_kernels_blockwise_attention.py",
    "test_hf.py",
    "test_export.py",
)


def pytest_collection_modifyitems(items):
    """Orders the files heaviest first (HEAVIEST_FIRST); a file's own tests keep their order."""
    counts = collections.Counter(item.path.name for item in items)
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(
        key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], str(item.path))
    )


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    """Frees a test file's compiled programs when the file ends: its functools caches and those of
    the shared helpers (tests/support/), then jax's caches.

    Every live XLA:CPU executable holds about three memory mappings per LLVM module of its code
    (code, constants, data), released when the executable is freed. A process that keeps every
    program of the suite alive reaches the kernel's vm.max_map_count (65,530) and the next compile
    cannot map its code: XLA:CPU then crashes the process (docs/xla-cpu-map-count.md). A later file
    compiling the same program reads it back from the persistent cache."""
    yield
    modules = [request.module, *(m for name, m in list(sys.modules.items()) if name.startswith("support."))]
    for module in modules:
        for value in vars(module).values():
            # the tests' own functools caches (a package's cache may be a singleton it relies on)
            if hasattr(value, "cache_info") and getattr(value, "__module__", None) == module.__name__:
                value.cache_clear()
    jax.clear_caches()
    gc.collect()
