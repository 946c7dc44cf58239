"""jax's persistent compilation cache, kept away from the XLA:CPU programs that deadlock read back.

XLA:CPU orders a program's collectives by one shared resource. An executable read back from the
cache gets one such resource per thunk sequence (the entry, each loop body, each branch), so a
loop's collectives are no longer ordered against the collectives around the loop: devices can
reach the two in different orders, wait for each other, and XLA ends the process
(docs/xla-cpu-cache-deadlock.md). `install` writes no such program: a CPU program of several
devices with a collective outside its entry computation. A program that is not written is never
read back; every other program (one device, collectives only in the entry, any GPU) is cached as
jax does it.
"""

from __future__ import annotations

import functools
import re

from jax._src import compiler  # the cache write: not public

# An HLO instruction line of a collective (synchronous or the start of an asynchronous one).
COLLECTIVE = re.compile(
    r" (?:all-gather|all-reduce|all-to-all|ragged-all-to-all|reduce-scatter|collective-permute"
    r"|collective-broadcast)(?:-start)?\("
)


def nested_collectives(hlo_text: str) -> list[str]:
    """The computations other than the entry that hold a collective, in the order of `hlo_text`
    (an HLO module's text: computations start at column 0, instructions are indented)."""
    found, computation, entry = [], "", False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.endswith("{"):
            entry = line.startswith("ENTRY ")
            computation = line.split()[1 if entry else 0].lstrip("%")
        elif not entry and COLLECTIVE.search(line) and computation not in found:
            found.append(computation)
    return found


def deadlocks_read_back(executable, platform: str) -> bool:
    """True for a program the cache must not hold: an XLA:CPU executable (jax's LoadedExecutable) of
    several devices with a collective in a called computation (a loop body or condition, a
    conditional's branch). A one-device program holds no collective that could wait."""
    if platform != "cpu" or len(executable.local_devices()) < 2:
        return False
    return any(nested_collectives(module.to_string()) for module in executable.hlo_modules())


def install() -> None:
    """Wraps jax's cache write so that a program `deadlocks_read_back` calls true is not written
    (the next process compiles it again). Idempotent."""
    write = compiler._cache_write
    if getattr(write, "zaya_cpu_guard", False):
        return

    @functools.wraps(write)
    def write_unless_it_deadlocks(cache_key, compile_time_secs, module_name, backend, executable, *rest):
        if deadlocks_read_back(executable, backend.platform):
            return None
        return write(cache_key, compile_time_secs, module_name, backend, executable, *rest)

    write_unless_it_deadlocks.zaya_cpu_guard = True
    compiler._cache_write = write_unless_it_deadlocks
