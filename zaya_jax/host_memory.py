"""Host memory that a long-running step loop reuses instead of faulting in again (glibc malloc).

XLA:CPU allocates each run's temporary buffer (201 MiB for configs/tiny.py's train step, about
1.6 GB for configs/mid.py's) from a worker thread. glibc gives worker threads their own arenas,
whose heaps hold at most 64 MiB, so such a buffer is always a fresh `mmap`, unmapped when the run
ends: the next step page-faults all of it back in, and the kernel zeroes every page on the way.
Measured on the 2-core CPU: 52k minor faults and 0.11 s of kernel time per tiny step, 407k and
0.76 s per mid step. One arena (the main one), no mmap and no trimming keep the freed buffer in the
heap, and the next run reuses it: 0 faults per step (benchmarks/README.md, "Page faults").

The price is the usual one of these settings: memory freed by the process goes back to the heap,
not to the system, so resident memory stays at its peak (what a training process reaches anyway
after its first step).
"""

from __future__ import annotations

import ctypes

# mallopt parameters, glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim (mallopt takes a C int; glibc reads it unsigned)

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER))


def reuse_freed_memory() -> bool:
    """Applies SETTINGS with glibc's `mallopt`; True if the C library took them all, False where
    it has no `mallopt` (musl, macOS: nothing changes). Call it before jax creates its thread pool
    (the first device query): a thread keeps the arena it first allocated from."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
