"""`python -m zaya_jax.train --config CONFIG --dry_run [--dry_run_devices N]`: compile the real train
step of any config at full size on simulated CPU devices, without allocating it.

The step is the one the trainer jits (`train_state.train_program`: same optimizer, schedule,
balancing, shardings and donation), traced from abstract shapes (`jax.eval_shape` of the initial
state, `jax.ShapeDtypeStruct`s carrying the mesh's NamedShardings), lowered and compiled for a mesh of
N CPU devices. It prints

  Memory per device   XLA's buffer assignment of the compiled per-device program
                      (`compiled.memory_analysis()`) next to `zaya_jax.sizing`'s estimate
  Collectives         every all-reduce / all-gather / reduce-scatter / all-to-all /
                      collective-permute in the compiled HLO with its result bytes (per device), as
                      written and as executed per step (ops inside the scanned layers run once per
                      trip of their while loop; `zaya_jax.hlo` reads the HLO). Ops that run only in a
                      conditional's non-default branch (the expert exchange's spill round, taken
                      only when a bucket overflowed) get their own "(spill, only if taken)" rows,
                      counted as if taken: "total (every step)" leaves them out, "total (with
                      spill taken)" adds them
  Compile             tracing + lowering and XLA compile times

Devices: N = `--dry_run_devices`, else the config's mesh size when no mesh axis is -1, else 8 (one
node). The CPU platform is made to simulate N devices by setting
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (and JAX_PLATFORMS=cpu) in this process before
jax creates its backends: jax reads both when the first device is requested, not at import, so this
works from `main()` without re-executing the process (jax 0.10.2). The numbers are those of XLA:CPU's
program: GPU/TPU compilers fuse and schedule differently (temporaries most of all), and kernels that
only lower for GPU (`*_impl="pallas"`) cannot be compiled here. Nothing is written to disk (the
persistent compilation cache is switched off for the dry run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import ml_collections

from zaya_jax import config as config_lib
from zaya_jax import hlo as hlo_lib
from zaya_jax import sizing
from zaya_jax.hlo import COLLECTIVES
from zaya_jax.parallel.mesh import MESH_AXES, mesh_from_config
from zaya_jax.train_state import abstract_batch, check_batch_divides, train_program

DEFAULT_DEVICES = 8  # a -1 mesh axis: one node, as `python -m zaya_jax.sizing` assumes
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


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
        flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={n}"])
        jax.config.update("jax_platforms", "cpu")
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise ValueError(
            f"--dry_run needs {n} CPU devices but jax already started with {len(cpus)}: run it in a "
            f"fresh process, or with XLA_FLAGS={_DEVICE_COUNT_FLAG}={n}"
        )
    return cpus[:n]


# ------------------------------------------------------------------------------------ collectives
@dataclasses.dataclass
class CollectiveStats:
    """One collective kind: ops as written in the HLO and as executed per step, result bytes."""

    ops: int = 0
    bytes: int = 0
    ops_per_step: int = 0
    bytes_per_step: int = 0


SPILL = " (spill, only if taken)"  # row suffix: ops in a conditional's non-default branch


def collectives(hlo: str) -> dict[str, CollectiveStats]:
    """The collectives of a compiled (per-device) HLO module by kind: those on the main path under
    their op's name, those only in a conditional's non-default branch (the expert exchange's spill
    round, run only when a bucket overflowed) under `op + SPILL`, counted once per step as if taken.
    Bytes are result bytes per device."""
    out: dict[str, CollectiveStats] = {}
    for c in hlo_lib.collectives(hlo):
        for key, times in ((c.op, c.runs.main), (c.op + SPILL, c.runs.branch)):
            if times or (key == c.op and not c.runs.branch):  # unreached ops stay in the main row
                s = out.setdefault(key, CollectiveStats())
                s.ops += 1
                s.bytes += c.bytes
                s.ops_per_step += times
                s.bytes_per_step += c.bytes * times
    return out


# ------------------------------------------------------------------------------------------ report
def memory_rows(stats: Any, est: sizing.MemoryEstimate) -> list[str]:
    """XLA's per-device buffers next to sizing's estimate of the same parts (GiB, or MiB when small).

    XLA's total is arguments + outputs - alias + temporaries: the donated state's buffers are
    reused for the new state. (XLA:CPU's own `peak_memory_in_bytes` leaves the temporaries out.)"""
    unit, scale = ("GiB", sizing.GIB) if est.total >= sizing.GIB else ("MiB", 2.0**20)
    state = est.params + est.optimizer
    xla_total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    rows = [
        ("arguments (state + batch)", stats.argument_size_in_bytes, state, "params + optimizer"),
        ("outputs (new state + metrics)", stats.output_size_in_bytes, state, "params + optimizer"),
        ("alias (outputs in donated arguments)", stats.alias_size_in_bytes, state, "params + optimizer"),
        ("temporaries", stats.temp_size_in_bytes, est.grads + est.activations, "grads + activations"),
        ("generated code", stats.generated_code_size_in_bytes, None, ""),
        ("total (arguments + outputs - alias + temp)", xla_total, est.total, "sizing total"),
    ]
    out = [f"  {'(' + unit + ' per device)':<44}{'XLA':>11}{'sizing':>11}"]
    for name, xla, ours, what in rows:
        ours_s = f"{ours / scale:>11.3f}   ({what})" if ours is not None else ""
        out.append(f"  {name:<44}{xla / scale:>11.3f}{ours_s}")
    # With mesh.context = R a device holds S/R positions of each of its sequences.
    positions = est.seq_len // est.mesh.get("context", 1)
    out.append(
        f"  (sizing: remat {est.remat}, micro-batch {est.micro_batch} x {positions} tokens per device)"
    )
    return out


def _total(stats: list[CollectiveStats]) -> CollectiveStats:
    return CollectiveStats(
        *(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(CollectiveStats))
    )


def collective_rows(stats: dict[str, CollectiveStats]) -> list[str]:
    """One row per op on the main path, then the spill rows, then the totals: every step's, and with
    the spill taken."""
    if not stats:
        return ["  none (nothing crosses devices)"]
    main = [(op, stats[op]) for op in COLLECTIVES if op in stats]
    spill = [(op + SPILL, stats[op + SPILL]) for op in COLLECTIVES if op + SPILL in stats]
    rows = [*main, ("total (every step)", _total([s for _, s in main]))]
    if spill:
        rows = [*main, *spill, rows[-1], ("total (with spill taken)", _total([*stats.values()]))]
    width = max(22, *(len(op) + 2 for op, _ in rows))
    out = [f"  {'op':<{width}}{'in HLO':>8}{'MiB':>12}{'per step':>10}{'MiB/step':>12}"]
    for op, s in rows:
        mib, mib_step = s.bytes / 2**20, s.bytes_per_step / 2**20
        out.append(f"  {op:<{width}}{s.ops:>8}{mib:>12.2f}{s.ops_per_step:>10}{mib_step:>12.2f}")
    if spill:
        out.append(
            "  (spill: only in a conditional's non-default branch, e.g. the expert exchange's overflow "
            "round; per step as if taken)"
        )
    return out


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """Config `c`'s train step compiled for a mesh from abstract shapes, and how long that took."""

    compiled: Any  # jax.stages.Compiled
    mesh: jax.sharding.Mesh
    cfg: Any  # the validated ZayaConfig
    lower_s: float
    compile_s: float


def compile_step(c: ml_collections.ConfigDict, devices: list[jax.Device]) -> CompiledStep:
    """The step the trainer jits (`train_state.train_program`), lowered from abstract state and batch
    on a mesh of `devices` and compiled; nothing is allocated."""
    cfg = config_lib.validate(c)
    mesh = mesh_from_config(c, devices=devices)
    check_batch_divides(c, len(devices))
    program = train_program(c, cfg, mesh)
    t0 = time.perf_counter()
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, mesh)
    lowered = program.train_step.lower(program.abstract_state(), batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return CompiledStep(compiled, mesh, cfg, t1 - t0, time.perf_counter() - t1)


def dry_run(c: ml_collections.ConfigDict, num_devices: int | None = None, name: str = "") -> str:
    """Compiles config `c`'s train step on simulated CPU devices; returns the report (see module)."""
    n = device_count(c, num_devices)
    devices = simulated_devices(n)  # first: validate's backend check would start jax with 1 device
    # Nothing is written, and the compile time is XLA's: no persistent compilation cache.
    jax.config.update("jax_enable_compilation_cache", False)
    step = compile_step(c, devices)
    compiled, mesh, cfg = step.compiled, step.mesh, step.cfg
    batch_size, seq_len, accum = c.train.batch_size, c.train.seq_len, c.train.grad_accum

    shape = {a: int(mesh.shape[a]) for a in MESH_AXES}
    micro_batch = sizing.config_micro_batch(c, n)
    est = sizing.config_memory_per_device(c, cfg, shape)
    pc = sizing.param_counts(cfg)
    lines = [
        f"dry run: {name or 'config'} on {n} simulated CPU devices, mesh "
        + " ".join(f"{a}={s}" for a, s in shape.items())
        + f", ZeRO-1 {'on' if c.mesh.zero1 else 'off'}",
        f"  {pc.total / 1e6:,.1f}M parameters ({pc.active / 1e6:,.1f}M active), global batch {batch_size} x "
        f"{seq_len} tokens, grad_accum {accum}: {micro_batch} sequences per device per microbatch, "
        f"remat {cfg.remat}, compute {cfg.dtype}, params {cfg.param_dtype}",
        "",
        "Memory per device (XLA: compiled.memory_analysis(); sizing: zaya_jax.sizing's estimate)",
        *memory_rows(compiled.memory_analysis(), est),
        "",
        "Collectives per device (result bytes; per step: x while-loop trips)",
        *collective_rows(collectives(compiled.as_text())),
        "",
        f"Compile: trace + lower {step.lower_s:.1f} s, XLA compile {step.compile_s:.1f} s, "
        f"total {step.lower_s + step.compile_s:.1f} s",
    ]
    return "\n".join(lines)
