"""zaya_jax/host_memory.py: with glibc's malloc set by reuse_freed_memory, a jit-compiled program's
temporary buffer comes from the heap and, freed, stays there for the next run instead of going back
to the system (to be mapped and page-faulted in again by the next run).

Checked with glibc's own accounting (mallinfo2) rather than by counting page faults: this machine's
kernel also reclaims idle heap pages now and then (DAMON), so fault counts are not exact."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# A program whose temporary (the [4096, 4096] fp32 product, 64 MiB) dwarfs its inputs and is above
# glibc's largest automatic mmap threshold (32 MiB): by default it is mapped for each run and
# unmapped after it.
PROGRAM = """
import ctypes, json, sys
from zaya_jax import host_memory
applied = host_memory.reuse_freed_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
f = jax.jit(lambda a, b: jnp.sum((a @ b) * (a @ b)[::-1]))  # the reversal makes XLA keep a @ b
a, b = jnp.full((4096, 64), 1e-2), jnp.full((64, 4096), 1e-2)
for _ in range(5):
    f(a, b).block_until_ready()
info = mallinfo2()
print(json.dumps({"applied": applied, "mapped": info.hblkhd, "free_in_heap": info.fordblks}))
"""


def _malloc_state(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt and mallinfo2")
def test_freed_temporaries_stay_in_the_heap_for_the_next_run():
    default, reuse = _malloc_state("default"), _malloc_state("reuse")
    assert default["applied"] is None and reuse["applied"] is True
    # by default the 64 MiB temporary went back to the system after each run
    assert default["free_in_heap"] < 64 * MIB, default
    # set: no temporary is mapped on its own (what is, was allocated before the settings), and the
    # freed temporary waits in the heap
    assert reuse["mapped"] < 64 * MIB, reuse
    assert reuse["free_in_heap"] >= 64 * MIB, reuse
