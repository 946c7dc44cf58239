"""The dry run's compiled step: simulated CPU devices, the real train step compiled from
abstract shapes, XLA's log records kept while compiling."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from typing import Any

import jax
import ml_collections
from jax._src import config as jax_config  # enable_compilation_cache as a context: not public

from zaya_jax import config as config_lib
from zaya_jax.parallel.mesh import MESH_AXES, device_platform, mesh_from_config
from zaya_jax.runtime import cli, device_memory, gpu_plugins, gpu_target, xla_flags
from zaya_jax.training.gradients import DataParallel
from zaya_jax.training.train_state import abstract_batch, check_batch_divides, train_program

DEFAULT_DEVICES = 8  # a -1 mesh axis: one node, as `python -m zaya_jax.sizing` assumes


def device_count(c: ml_collections.ConfigDict, requested: int | None = None) -> int:
    """Devices to simulate: `requested`, else the mesh's size if every axis is fixed, else 8."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--dry_run_devices={requested}: must be >= 1")
        return requested
    sizes = [c.mesh[a] for a in MESH_AXES]
    fixed = all(isinstance(s, int) and s >= 1 for s in sizes)  # else -1, or an error validate names
    return math.prod(sizes) if fixed else DEFAULT_DEVICES


def simulated_devices(n: int) -> list[jax.Device]:
    """`n` CPU devices. Before jax's backends exist, XLA_FLAGS is set to simulate exactly `n`
    (replacing any device count already there) and the platform pinned to CPU; afterwards the
    process' CPU devices are used if there are enough."""
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        xla_flags.set_flag(xla_flags.DEVICE_COUNT, n, replace=True)
        jax.config.update("jax_platforms", "cpu")
        gpu_plugins.register_plugins()  # now, the CUDA plugin's "no driver" notice dropped
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise ValueError(
            f"--dry_run needs {n} CPU devices but jax already started with {len(cpus)}: run it in a "
            f"fresh process, or with XLA_FLAGS={xla_flags.DEVICE_COUNT}={n}"
        )
    return cpus[:n]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """Config `c`'s train step compiled for a mesh from abstract shapes, and how long that took."""

    compiled: Any  # jax.stages.Compiled
    mesh: jax.sharding.Mesh
    cfg: Any  # the validated ZayaConfig
    lower_s: float
    compile_s: float
    state: Any = None  # the abstract train state it was compiled for
    zero1: bool = True  # mesh.zero1
    grad_accum: int = 1  # train.grad_accum
    grad_reduce: str = "step"  # train.grad_reduce
    grad_reduce_dtype: str = "float32"  # train.grad_reduce_dtype
    # (gradients reduced in the backward, weights gathered in the forward): gradients.DataParallel.overlaps
    overlaps: tuple[bool, bool] = (False, False)
    xla_log: tuple[str, ...] = ()  # XLA's log records of the compile (`captured_xla_log`)


def compile_step(c: ml_collections.ConfigDict, devices: list[jax.Device]) -> CompiledStep:
    """The step the trainer jits (`train_state.train_program`), lowered from abstract state and batch
    on a mesh of `devices` and compiled; nothing is allocated. The persistent compilation cache is
    off for it: the compile time reported is XLA's, a deviceless GPU executable cannot be read back
    without its client, and a CPU mesh's step read back can deadlock (zaya_jax/runtime/compile_cache.py).
    A GPU compile reuses the kernels earlier compiles made (`gpu_target.kernel_cache_options`)."""
    platform = device_platform(devices[0])
    cfg = config_lib.validate(c, platform)
    mesh = mesh_from_config(c, devices=devices)
    check_batch_divides(c, len(devices))
    program = train_program(c, cfg, mesh)
    t0 = time.perf_counter()
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, mesh)
    lowered = program.train_step.lower(program.abstract_state(), batch)
    t1 = time.perf_counter()
    # enable_compilation_cache is read once per process (jax memoizes whether the cache is used),
    # so after any earlier cached compile it no longer stops the write; the minimum compile time is
    # read at every write.
    no_cache_write = jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    log: list[str] = []
    try:
        with jax_config.enable_compilation_cache(False), no_cache_write, captured_xla_log(log):
            compiled = lowered.compile(gpu_target.kernel_cache_options(platform, devices[0].device_kind) or None)
    except Exception as e:
        e.xla_log = tuple(log)  # the refusal's report reads XLA's own account (`remat_shortfall`)
        raise
    elapsed = time.perf_counter() - t1
    return CompiledStep(
        compiled,
        mesh,
        cfg,
        t1 - t0,
        elapsed,
        program.abstract_state(),
        c.mesh.zero1,
        c.train.grad_accum,
        c.train.grad_reduce,
        c.train.grad_reduce_dtype,
        DataParallel.from_config(c).overlaps(cfg, mesh),
        tuple(log),
    )


# ------------------------------------------------------------------------------------- XLA's log
# A record of XLA's C++ log (glog / absl format): severity, MMDD, time, thread, file:line].
XLA_LOG_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")

REMAT_SHORTFALL = re.compile(
    r"Can't reduce memory use below \S+ \((\d+) bytes\) by rematerialization; only reduced to \S+ \((\d+) bytes\)"
)


@contextlib.contextmanager
def captured_xla_log(log: list[str]):
    """XLA's log records written to stderr meanwhile (its "Constant folding ... is taking a while"
    alarms, the GPU compiler's rematerialization warnings) go to `log` instead of the terminal: the
    report states what they mean. Other output (before the first record, or Python's) passes on.
    The capture is an unnamed temporary file: nothing is left on disk. ZAYA_DEBUG=1 shows it all."""
    if cli.debug():
        yield log
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            in_record = False
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if XLA_LOG_RECORD.match(line):
                    in_record = True
                    log.append(line)
                elif in_record:  # a record's continuation lines
                    log[-1] += line
                else:
                    sys.stderr.write(line)


def remat_shortfall(log: tuple[str, ...] | list[str]) -> tuple[int, int] | None:
    """(XLA's memory limit, the bytes it could bring the step down to) when the GPU compiler's
    rematerialization logged that it could not fit the step under its limit, else None."""
    for record in log:
        m = REMAT_SHORTFALL.search(record)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def limited(gpu: gpu_target.GpuTarget) -> gpu_target.GpuTarget:
    """The target, with its memory replaced by ZAYA_JAX_MEMORY_LIMIT_BYTES when that is set."""
    override = device_memory.limit_override()
    if override is None:
        return gpu
    return dataclasses.replace(gpu, name=f"{gpu.name} [{device_memory.LIMIT_ENV}]", memory_bytes=override)
