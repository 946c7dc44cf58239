"""Host memory of a long-running step loop: glibc malloc's settings and releasing what compiling
left behind.

XLA:CPU maps each step's temporary buffers afresh, and with 4 KiB pages every step page-faults
them back in. Two cures, best first (`mode()` says which one a process has): "huge_pages" (glibc's
`glibc.malloc.hugetlb=1` tunable; `python -m zaya_jax.train` re-executes itself once with it, and a
one-device CPU step keeps its temporaries in the main heap: `keep_step_buffers`) and "reuse" (one
arena, no mmap, no trimming). `release_freed_memory` hands back what a compile freed; `lean_compile`
sets XLA:CPU's leaner fusion emitter and memory-optimized scheduler (LEAN_FLAGS). The design and
its measurements: docs/design/host-memory.md, docs/performance.md.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zaya_jax.runtime import xla_flags

# mallopt parameters, glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim (mallopt takes a C int; glibc reads it unsigned)

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER))
# Huge pages' complement: mmap and trimming off, one arena per thread kept (with SETTINGS' one shared
# arena the step's worker threads contend for the arena's lock; docs/performance.md).
KEEP_SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER))
ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"

HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
SCHEDULER_FLAG = "--xla_cpu_scheduler_type"
LEAN_FLAGS = ((FUSION_EMITTERS_FLAG, "false"), (SCHEDULER_FLAG, "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"))
THP_MODES = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# What this process applied (SETTINGS, run_cpu_programs_inline, KEEP_SETTINGS): the C library's
# malloc state is process-wide and cannot be read back, so it is mirrored here.
_APPLIED: dict[str, bool] = {"reuse": False, "inline": False, "keep": False}


def _glibc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None)
        lib.mallopt, lib.malloc_trim  # noqa: B018 (glibc's, absent from musl / macOS)
    except (OSError, AttributeError):
        return None
    return lib


def glibc_version() -> tuple[int, int] | None:
    """(2, 36) under glibc 2.36; None under another C library."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else None


def kernel_has_huge_pages(modes: Path | None = None) -> bool:
    """True when transparent huge pages are on for memory that asks (mode [always] or [madvise])."""
    try:
        text = (modes or THP_MODES).read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def huge_pages_possible() -> bool:
    """glibc >= 2.35 (the hugetlb tunable) on a kernel with transparent huge pages."""
    version = glibc_version()
    return version is not None and version >= (2, 35) and kernel_has_huge_pages()


def has_huge_pages_tunable(tunables: str) -> bool:
    """Whether a GLIBC_TUNABLES value ("name=value:name=value") holds the huge-page tunable."""
    return HUGE_PAGES_TUNABLE in tunables.split(":")


def huge_pages_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """`env` with the huge-page tunable added to GLIBC_TUNABLES, or None when there is nothing to
    re-execute for: the tunable is already there (this is the re-executed process), glibc is older
    than 2.35 or absent, or the kernel has no transparent huge pages."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if has_huge_pages_tunable(tunables) or not huge_pages_possible():
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE}


def reexec_with_huge_pages() -> None:
    """Replaces this process by the same command line with the huge-page tunable set (returns only
    when `huge_pages_env` says there is nothing to do). Call it first thing in a command's main:
    the process is started again, as the user started it (sys.orig_argv), same pid."""
    env = huge_pages_env(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """glibc's `mallopt` for each (param, value); True if the C library took them all, False where
    it has no `mallopt` (musl, macOS: nothing changes)."""
    lib = _glibc()
    if lib is None:
        return False
    lib.mallopt.argtypes, lib.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(lib.mallopt(param, value) == 1 for param, value in settings)


def reuse_freed_memory() -> bool:
    """Applies SETTINGS (`_mallopt`). Call it before jax creates its thread pool (the first device
    query): a thread keeps the arena it first allocated from."""
    applied = _mallopt(SETTINGS)
    _APPLIED["reuse"] = _APPLIED["reuse"] or applied
    return applied


def run_cpu_programs_inline() -> None:
    """jax's CPU client runs one-device programs on the thread that calls them (async dispatch
    off; programs over several devices, and GPU programs, are not affected). Call it before jax
    creates its CPU backend, which reads the flag then: configure does, in "huge_pages" mode."""
    import jax  # deferred: host_memory is set up before anything else, and is imported without jax

    jax.config.update(ASYNC_DISPATCH, False)
    _APPLIED["inline"] = True


def keep_step_buffers(devices: Sequence[Any]) -> bool:
    """Huge pages' complement (module docstring): where the step's mesh (`devices`: all of them,
    over every process) is one CPU device and `run_cpu_programs_inline` came first, KEEP_SETTINGS
    (`_mallopt`) keep what the step frees in the calling thread's heap. Elsewhere nothing changes:
    a GPU step's host memory would not gain, and a CPU mesh's programs run on worker threads, whose
    temporaries above 64 MiB would then be mapped in 4 KiB pages. True if the settings were applied."""
    one_cpu = len(devices) == 1 and devices[0].platform == "cpu"
    if not (_APPLIED["inline"] and one_cpu):
        return False
    applied = _mallopt(KEEP_SETTINGS)
    _APPLIED["keep"] = _APPLIED["keep"] or applied
    return applied


def keeps_step_buffers() -> bool:
    """Whether this process applied `keep_step_buffers` (the run summary's `keep_step_buffers`)."""
    return _APPLIED["keep"]


def lean_compile(on: bool = True) -> bool:
    """Sets os.environ's XLA_FLAGS for the leaner CPU compile (`on`: LEAN_FLAGS; a value the user
    gave a flag stands): for this process if jax has not created a backend yet, and for every
    process started from now on. Returns whether the fusion emitters are off (`compiles_lean`)."""
    if on:
        for flag, setting in LEAN_FLAGS:
            xla_flags.set_flag(flag, setting)
    return compiles_lean()


def compiles_lean() -> bool:
    """Whether XLA_FLAGS turns XLA:CPU's fusion emitters off (the run summary's `lean_cpu_compile`)."""
    given = xla_flags.current(FUSION_EMITTERS_FLAG)
    return given is not None and given.lower() in ("false", "0")


def configure(reuse: bool, reexec: bool = True, lean: bool = False) -> str:
    """What `python -m zaya_jax.train` does with `train.reuse_host_memory` and
    `train.lean_cpu_compile` (`lean`, set first: a re-executed process inherits it): huge pages where
    the kernel and glibc have them (re-executing the process unless `reexec` is False) with
    `run_cpu_programs_inline` (the trainer then calls `keep_step_buffers` with its mesh's devices),
    else the "reuse" settings; nothing when `reuse` is False. Returns mode()."""
    lean_compile(lean)
    if reuse:
        if reexec:
            reexec_with_huge_pages()
        if mode() == "huge_pages":
            run_cpu_programs_inline()
        else:
            reuse_freed_memory()
    return mode()


def huge_pages_for_children(on: bool = True) -> None:
    """Adds the tunable to os.environ (`on`, where possible) or takes it out, for the processes
    started from now on; this one keeps what it started with (glibc has read its tunables)."""
    env = huge_pages_env(os.environ) if on else None
    if env is not None:
        os.environ["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]
    elif not on and "GLIBC_TUNABLES" in os.environ:
        kept = [t for t in os.environ["GLIBC_TUNABLES"].split(":") if t and t != HUGE_PAGES_TUNABLE]
        os.environ["GLIBC_TUNABLES"] = ":".join(kept)


def started_with_huge_pages() -> bool:
    """Whether this process was started with the tunable: glibc read its tunables then, and a
    later change to os.environ reaches only the processes started afterwards. Linux keeps the
    environment a process started with in /proc/self/environ."""
    try:
        start = Path("/proc/self/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    tunables = next((v[len(b"GLIBC_TUNABLES=") :] for v in start if v.startswith(b"GLIBC_TUNABLES=")), b"")
    return has_huge_pages_tunable(tunables.decode(errors="replace"))


def mode() -> str:
    """"huge_pages", "reuse" or "default": how this process' malloc serves a step's buffers."""
    if started_with_huge_pages() and huge_pages_possible():
        return "huge_pages"
    return "reuse" if _APPLIED["reuse"] else "default"


def release_freed_memory() -> bool:
    """Returns the heap's free pages to the system (glibc `malloc_trim(0)`); False without glibc.
    Worth a call after compiling a program: the compiler's freed memory is otherwise kept."""
    lib = _glibc()
    return lib is not None and bool(lib.malloc_trim(0))
