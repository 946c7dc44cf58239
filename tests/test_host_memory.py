"""zaya_jax/runtime/host_memory.py: with glibc's malloc set by reuse_freed_memory, a jit-compiled program's
temporary buffer comes from the heap and, freed, stays there for the next run instead of going back
to the system (to be mapped and page-faulted in again by the next run).

Checked with glibc's own accounting (mallinfo2) rather than by counting page faults: this machine's
kernel also reclaims idle heap pages now and then (DAMON), so fault counts are not exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zaya_jax.runtime import host_memory

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# A program whose temporary (the [4096, 4096] fp32 product, 64 MiB) dwarfs its inputs and is above
# glibc's largest automatic mmap threshold (32 MiB): by default it is mapped for each run and
# unmapped after it.
PROGRAM = """
import ctypes, json, sys, time, types
from zaya_jax.runtime import host_memory
if sys.argv[1] == "keep":
    host_memory.run_cpu_programs_inline()  # as configure does, before jax's backend
applied = host_memory.reuse_freed_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp
others = None
if sys.argv[1] == "keep":  # a mesh of two CPUs, a GPU, then one CPU: the trainer's mesh here
    two, gpu = [types.SimpleNamespace(platform="cpu")] * 2, [types.SimpleNamespace(platform="gpu")]
    others = [host_memory.keep_step_buffers(two), host_memory.keep_step_buffers(gpu)]
    applied = host_memory.keep_step_buffers(jax.local_devices()[:1])

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
# The runtime frees a run's temporary after its result is ready, on its own threads: on a busy
# machine that came after block_until_ready returned (the suite once read 5 MB free), so with the
# settings applied the freed temporary gets up to 10 s to show up in the heap.
deadline = time.monotonic() + 10
while applied and info.fordblks < (64 << 20) and time.monotonic() < deadline:
    time.sleep(0.05)
    info = mallinfo2()
out = {"applied": applied, "others": others, "mapped": info.hblkhd, "free_in_heap": info.fordblks}
print(json.dumps({**out, "async_dispatch": jax.config._read("jax_cpu_enable_async_dispatch")}))
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
    assert default["async_dispatch"] is reuse["async_dispatch"] is True


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt and mallinfo2")
def test_kept_step_buffers_come_from_the_calling_threads_heap_and_stay():
    """keep_step_buffers: the program runs on the calling thread (async dispatch off), whose arena
    serves the 64 MiB temporary from the heap and keeps it there when freed; with the other threads'
    arenas (no ARENA_MAX) a worker thread's temporary of that size would be mapped for each run."""
    keep = _malloc_state("keep")
    assert keep["applied"] is True and keep["async_dispatch"] is False
    assert keep["others"] == [False, False]  # not for a step over two devices, nor a GPU's
    assert keep["mapped"] < 64 * MIB, keep
    assert keep["free_in_heap"] >= 64 * MIB, keep


def test_huge_pages_env_adds_the_tunable_once(monkeypatch):
    tunable = host_memory.HUGE_PAGES_TUNABLE
    monkeypatch.setattr(host_memory, "huge_pages_possible", lambda: True)
    assert host_memory.huge_pages_env({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": tunable}
    kept = host_memory.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert kept == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{tunable}"}
    # the re-executed process: nothing more to do (no second re-execution)
    assert host_memory.huge_pages_env({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{tunable}"}) is None
    monkeypatch.setattr(host_memory, "huge_pages_possible", lambda: False)
    assert host_memory.huge_pages_env({}) is None


def test_kernel_has_huge_pages_reads_the_selected_mode(tmp_path):
    modes = tmp_path / "enabled"
    for text, on in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                     ("always madvise [never]\n", False)):
        modes.write_text(text)
        assert host_memory.kernel_has_huge_pages(modes) is on
    assert host_memory.kernel_has_huge_pages(tmp_path / "missing") is False


# The 64 MiB temporary's page faults per run (steady state), under the default settings or with the tunable.
FAULTS = """
import json, os, resource, sys
from zaya_jax.runtime import host_memory
if sys.argv[1:] == ["configure"]:
    host_memory.configure(True, reexec=False)  # as the trainer, once re-executed
import jax, jax.numpy as jnp
if sys.argv[1:] == ["configure"]:
    host_memory.keep_step_buffers(jax.local_devices()[:1])  # the trainer's mesh of one device
f = jax.jit(lambda a, b: jnp.sum((a @ b) * (a @ b)[::-1]))
a, b = jnp.full((4096, 64), 1e-2), jnp.full((64, 4096), 1e-2)
def faults_per_run(runs=5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(runs):
        f(a, b).block_until_ready()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / runs
faults_per_run()  # warm-up: the thread pool's workers first fault in their own arenas (up to ~60 a run)
faults = min(faults_per_run() for _ in range(3))  # the steady state: the quietest of three windows
mode = host_memory.mode()
os.environ["GLIBC_TUNABLES"] = host_memory.HUGE_PAGES_TUNABLE  # too late for this process' glibc
keep = host_memory.keeps_step_buffers()
print(json.dumps({"mode": mode, "later": host_memory.mode(), "faults": faults, "keep": keep}))
"""


def _faults(tunables: str, *args: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": tunables}
    proc = subprocess.run([sys.executable, "-c", FAULTS, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not host_memory.huge_pages_possible(), reason="glibc >= 2.35 and a kernel with THP")
def test_huge_pages_fault_a_temporary_in_2_mib_at_a_time():
    default, huge = _faults(""), _faults(host_memory.HUGE_PAGES_TUNABLE)
    assert default["mode"] == default["later"] == "default" and huge["mode"] == "huge_pages"
    assert default["faults"] >= 64 * MIB / 4096 / 2, default  # 4 KiB pages: ~16k faults a run
    assert huge["faults"] < default["faults"] / 8, (default, huge)
    # configure (the trainer's set-up) adds keep_step_buffers: the temporary is faulted in once
    kept = _faults(host_memory.HUGE_PAGES_TUNABLE, "configure")
    assert kept["mode"] == "huge_pages" and kept["keep"] is True and huge["keep"] is False
    assert kept["faults"] < huge["faults"] / 4, (huge, kept)


TRIM = """
import ctypes, json
from zaya_jax.runtime import host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
blocks = [libc.malloc(64 << 10) for _ in range(4096)]  # 256 MiB in 64 KiB blocks, below mmap's threshold
for p in blocks:
    ctypes.memset(p, 1, 64 << 10)
for p in blocks[:-1]:  # the last one pins the heap's top: plain trimming cannot give the rest back
    libc.free(p)
held = rss()
released = host_memory.release_freed_memory()
print(json.dumps({"released": released, "held": held, "after": rss()}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_release_freed_memory_hands_the_heap_back():
    proc = subprocess.run([sys.executable, "-c", TRIM], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["released"] is True
    assert out["held"] - out["after"] >= 200 * MIB, out


def test_lean_compile_sets_the_flags_once_and_a_users_flag_stands(monkeypatch):
    flag, count = host_memory.FUSION_EMITTERS_FLAG, "--xla_force_host_platform_device_count=2"
    scheduler = f"{host_memory.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    monkeypatch.setenv("XLA_FLAGS", count)
    assert host_memory.compiles_lean() is False
    assert host_memory.lean_compile(False) is False and host_memory.compiles_lean() is False
    lean = f"{count} {flag}=false {scheduler}"
    assert host_memory.lean_compile() is True and os.environ["XLA_FLAGS"] == lean
    assert host_memory.lean_compile() is True and os.environ["XLA_FLAGS"] == lean
    for users in (f"{count} {flag}=true", f"{flag}=1", f"{flag}"):
        monkeypatch.setenv("XLA_FLAGS", users)
        assert host_memory.lean_compile() is False and os.environ["XLA_FLAGS"] == f"{users} {scheduler}"
    users = f"{host_memory.SCHEDULER_FLAG}=CPU_SCHEDULER_TYPE_DEFAULT"
    monkeypatch.setenv("XLA_FLAGS", users)
    assert host_memory.lean_compile() is True and os.environ["XLA_FLAGS"] == f"{users} {flag}=false"
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=false {flag}=True")  # XLA takes the last
    assert host_memory.compiles_lean() is False and host_memory.lean_compile() is False


# Twenty distinct tanh / sin / mean fusions between dots and their gradients: the compile's own
# peak, in a fresh process, with the flag set by lean_compile (before jax's backend) or not.
COMPILE = """
import json, sys
from zaya_jax.runtime import host_memory
lean = host_memory.lean_compile(sys.argv[1] == "lean")
import jax, jax.numpy as jnp

def high_water_mb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) / 1024

def f(x, w):
    for i in range(20):
        x = jnp.tanh(x @ w) * (i + 1.5) + jnp.sin(x).mean(0)
    return x.sum()

args = (jnp.ones((32, 32)), jnp.ones((32, 32)))
jax.jit(lambda a: a + 1)(args[0]).block_until_ready()  # the runtime's own memory, before
before = high_water_mb()
jax.jit(jax.grad(f)).lower(*args).compile()
print(json.dumps({"lean": lean, "compile_mb": high_water_mb() - before}))
"""


@pytest.mark.skipif(host_memory.glibc_version() is None, reason="reads /proc (Linux)")
def test_lean_compile_lowers_the_compilers_peak():
    """Measured 35 against 103 MB here (tiny's train step: 485 against 880 MB)."""
    # no persistent cache: a hit (a second run of the suite) would skip the very compile measured
    unset = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    runs = {}
    for mode in ("lean", "default"):
        proc = subprocess.run(
            [sys.executable, "-c", COMPILE, mode], capture_output=True, text=True, cwd=ROOT, env=env, check=True
        )
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["lean"]["lean"] is True and runs["default"]["lean"] is False
    assert runs["lean"]["compile_mb"] < 0.6 * runs["default"]["compile_mb"]
