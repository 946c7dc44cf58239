"""jax's persistent compilation cache, kept away from programs of more than one CPU device.

An XLA:CPU executable of several devices read back from the persistent cache (what
JAX_COMPILATION_CACHE_DIR turns on) can deadlock in its collectives: the devices reach two
all-gathers in different orders, wait for each other, and XLA ends the process after 40 s
(docs/xla-cpu-cache-deadlock.md). The same program compiled in the process runs. `install` keeps
such programs out of the cache (neither read nor written); every other program (one CPU device, any
GPU) is cached as jax does it.
"""

from __future__ import annotations

import functools

from jax._src import compiler  # the cache key's resolution: not public


def uncached(devices) -> bool:
    """True for the programs the cache must not hold: compiled for more than one CPU device."""
    return devices.size > 1 and {device.platform for device in devices.flat} == {"cpu"}


def install() -> None:
    """Wraps jax's choice of a program's cache key so that `uncached` programs get none (jax then
    compiles them as with the cache off). Idempotent."""
    resolve = compiler._resolve_compilation_strategy
    if getattr(resolve, "zaya_uncached_cpu_meshes", False):
        return

    @functools.wraps(resolve)
    def resolve_without_cpu_meshes(computation, devices, compile_options, *args, **kwargs):
        if uncached(devices):
            return None, compile_options
        return resolve(computation, devices, compile_options, *args, **kwargs)

    resolve_without_cpu_meshes.zaya_uncached_cpu_meshes = True
    compiler._resolve_compilation_strategy = resolve_without_cpu_meshes
