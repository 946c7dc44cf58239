"""Python's cyclic garbage collector set for a process that traces large programs.

Tracing and lowering a train step allocates millions of short-lived Python objects (tracers, jaxpr
equations, MLIR operations). With Python's default thresholds the collector runs every 700 net
allocations and, every 100 of those runs, walks every live object: the imported modules of jax,
flax, optax and orbax among them. `collect_rarely` freezes what exists when it is first called (the
imported modules, never scanned again) and raises the young generation's threshold. The
measurements: docs/performance.md, "Choices inside the code".
"""

from __future__ import annotations

import gc

# Net allocations between two collections of the young generation (Python's default: 700). The
# older generations keep their defaults: they are collected every 10 collections of the one below.
YOUNG_THRESHOLD = 50_000


_set = False


def collect_rarely() -> None:
    """Freezes the objects alive at the first call (gc.freeze) and sets the young generation's
    threshold; later calls do nothing (what a long process made since may still become garbage).
    Explicit `gc.collect()` calls still collect everything not frozen."""
    global _set
    if _set:
        return
    _set = True
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD)
