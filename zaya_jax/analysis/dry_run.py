"""`python -m zaya_jax.train --config CONFIG --dry_run [--dry_run_devices N] [--dry_run_target T]
[--dry_run_fit] [--dry_run_hardware FILE] [--dry_run_json FILE]`: compile the real train step of
any config at full size for N devices, without allocating it.

The step is the one the trainer jits (`train_state.train_program`), traced from abstract shapes and
compiled for N simulated CPU devices or N deviceless GPUs (`mi300x`, `h100`, or a GpuTargetConfig
file: zaya_jax/runtime/gpu_target.py). It prints memory per device (against sizing and the device, or this machine's RAM for the CPU
target), the
remat policy with the least recompute that fits and the largest microbatch that fits with it
(--dry_run_fit; if none, the first layout that does), the collectives with their bytes, Muon's
Newton-Schulz FLOPs, the compiled kernels and dot FLOPs and the predicted step time (GPU targets:
zaya_jax/analysis/timeline.py) and compile times; nothing is written to disk but --dry_run_json's report.
What each table means: docs/guides/dry-run.md.
XLA's own log records while compiling are kept from the terminal (ZAYA_DEBUG=1 shows them).
"""

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
from zaya_jax import sizing
from zaya_jax.analysis import hardware, prediction
from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.analysis.hlo import COLLECTIVES
from zaya_jax.kernels import attention_choice, ns_choice
from zaya_jax.model.moe import resolve_moe_impl
from zaya_jax.model.transformer import resolve_scan_layers
from zaya_jax.parallel import zero1
from zaya_jax.parallel.context import config_context
from zaya_jax.parallel.mesh import MESH_AXES, device_platform, mesh_from_config, mesh_platform
from zaya_jax.runtime import cli, device_memory, gpu_plugins, gpu_target, xla_flags
from zaya_jax.training.train_state import OPTIMIZER_SCOPE, abstract_batch, check_batch_divides, train_program

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


# ------------------------------------------------------------------------------------ collectives
@dataclasses.dataclass
class CollectiveStats:
    """One collective kind: ops as written in the HLO and as executed per step, result bytes."""

    ops: int = 0
    bytes: int = 0
    ops_per_step: int = 0
    bytes_per_step: int = 0


SPILL = " (spill, only if taken)"  # row suffix: ops in a conditional's non-default branch


def moving(ops: list[hlo_lib.Collective]) -> list[hlo_lib.Collective]:
    """The collectives that move data: groups of one device (an all-reduce XLA leaves over a mesh
    axis of size 1) move nothing and are left out of every count."""
    return [c for c in ops if c.groups is None or any(len(g) > 1 for g in c.groups)]


def in_model(c: hlo_lib.Collective) -> bool:
    """Whether a collective belongs to the model's forward / backward (runs per microbatch)."""
    return "ZayaForCausalLM" in c.op_name


def axis_rows(hlo: str, mesh: jax.sharding.Mesh) -> list[str]:
    """Collective bytes per step by the mesh axes they span and where they run: in the model (per
    microbatch: the expert exchange, context halo / K-V gather, fsdp's gathers, and GSPMD's
    reductions over the axes that stay automatic) or once per step (outside the model: the ZeRO-1
    reduce-scatter and gather, distributed Muon, the loss sums)."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    rows: dict[tuple[str, str, str], int] = {}
    for c in moving(hlo_lib.collectives(hlo)):
        axes = hlo_lib.group_axes(c.groups, names, shape)
        key = ("+".join(axes) if axes else "?", "model" if in_model(c) else "step", c.op)
        rows[key] = rows.get(key, 0) + c.bytes * c.runs.main
    out = [f"  {'mesh axes':<24}{'where':<8}{'op':<20}{'MiB/step':>12}"]
    for (axes, where, op), nbytes in sorted(rows.items()):
        out.append(f"  {axes:<24}{where:<8}{op:<20}{nbytes / 2**20:>12.2f}")
    return out


def zero1_rows(hlo: str, step: CompiledStep) -> list[str]:
    """The data-parallel traffic against the formula of docs/architecture.md (zero1.step_bytes)."""
    once, looped = data_parallel_bytes(hlo, step.mesh)
    args = (step.state.params, step.mesh, step.zero1, step.grad_accum, step.grad_reduce)
    dtypes = dict(compute_dtype=step.cfg.compute_dtype, grad_reduce_dtype=step.grad_reduce_dtype)
    formula = zero1.step_bytes(*args, **dtypes)
    wire = zero1.step_bytes(*args, **dtypes, wire=True)
    ratio = f" ({once / formula:.2f}x)" if formula else ""
    each = zero1.reduces_per_microbatch(step.grad_reduce, step.mesh)
    where = f"in each of the {step.grad_accum} microbatches" if each else "once into the ZeRO-1 shards"
    master = zero1.shards_master(step.cfg.params_dtype, step.cfg.compute_dtype, step.zero1)
    gathered = f"the {step.cfg.dtype} compute weights" if master else "the fp32 updates"
    return [
        (f"  data-parallel (spanning the data axis): outside the model {once / 2**20:.2f} MiB{ratio}, in the "
        f"model {looped / 2**20:.2f} MiB (result bytes); formula {formula / 2**20:.2f} MiB, "
        f"{wire / 2**20:.2f} MiB on the wire (ring): {step.grad_reduce_dtype} gradients reduce-scattered "
        f"{where}, {gathered} all-gathered (docs/design/zero1.md)")
    ]


def newton_schulz_rows(hlo: str, c: ml_collections.ConfigDict, cfg: Any, n: int) -> list[str]:
    """Muon's once-per-step Newton-Schulz dot FLOPs per device (the optimizer update's dots) against
    sizing's total over the devices (distributed Muon: each matrix on one rank)."""
    works = hlo_lib.work(hlo)
    compiled = flops_per_step(works, is_optimizer)
    ideal = sizing.newton_schulz_flops(cfg, c.optim.muon.ns_steps) / n
    triton = any(w.kind == "triton" and "zaya_ns" in w.name for w in works)
    ratio = f" ({compiled / ideal:.2f}x)" if ideal else ""
    declared = " (Pallas kernels: their declared FLOPs)" if triton else ""
    return [
        (f"Newton-Schulz per device (the optimizer's dots, once per step): {_flops(compiled)}FLOP{ratio}; "
        f"sizing's total / {n} devices: {_flops(ideal)}FLOP{declared}")
    ]


def data_parallel_bytes(hlo: str, mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """(once per step, inside the model) collective result bytes per device per step spanning the
    data axis: the ZeRO-1 traffic outside the model, and what runs per microbatch (none: the
    gradients are reduced after the microbatch loop, zaya_jax/parallel/zero1.py)."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    step = model = 0
    for c in moving(hlo_lib.collectives(hlo)):
        if "data" in (hlo_lib.group_axes(c.groups, names, shape) or ("data",)):
            if in_model(c):
                model += c.bytes * c.runs.main
            else:
                step += c.bytes * c.runs.main
    return step, model


def collectives(hlo: str) -> dict[str, CollectiveStats]:
    """The collectives of a compiled (per-device) HLO module by kind: those on the main path under
    their op's name, those only in a conditional's non-default branch (the expert exchange's spill
    round, run only when a bucket overflowed) under `op + SPILL`, counted once per step as if taken.
    Bytes are result bytes per device."""
    out: dict[str, CollectiveStats] = {}
    for c in moving(hlo_lib.collectives(hlo)):
        for key, times in ((c.op, c.runs.main), (c.op + SPILL, c.runs.branch)):
            if times or (key == c.op and not c.runs.branch):  # unreached ops stay in the main row
                s = out.setdefault(key, CollectiveStats())
                s.ops += 1
                s.bytes += c.bytes
                s.ops_per_step += times
                s.bytes_per_step += c.bytes * times
    return out


# ------------------------------------------------------------------------------------------ report
def memory_unit(nbytes: float) -> tuple[str, float]:
    """("GiB", 2**30), or ("MiB", 2**20) below a GiB: the memory table's unit."""
    return ("GiB", sizing.GIB) if nbytes >= sizing.GIB else ("MiB", 2.0**20)


def memory_total(stats: Any) -> int:
    """Bytes a compiled step needs per device: arguments + outputs - alias + temporaries."""
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def memory_rows(stats: Any, est: sizing.MemoryEstimate, in_place: bool = True) -> list[str]:
    """XLA's per-device buffers next to sizing's estimate of the same parts (GiB, or MiB when small).

    XLA's total is arguments + outputs - alias + temporaries: the donated state's buffers are
    reused for the new state. (XLA:CPU's own `peak_memory_in_bytes` leaves the temporaries out.)
    Sizing's temporaries are the larger of the backward pass' (gradients, one buffer or two when
    several microbatches are summed, and activations) and, where the compiler does not update the
    state in place (`in_place` False: XLA:CPU inside the skip guard's lax.cond), the update's
    (MemoryEstimate.update_temporaries); both are listed then."""
    unit, scale = memory_unit(est.total)
    state = est.params + est.optimizer
    xla_total = memory_total(stats)
    backward = est.grads + est.activations
    update = 0.0 if in_place else est.update_temporaries
    temp, what = max(backward, update), "grads + activations"
    rows = [
        ("arguments (state + batch)", stats.argument_size_in_bytes, state, "params + optimizer"),
        ("outputs (new state + metrics)", stats.output_size_in_bytes, state, "params + optimizer"),
        ("alias (outputs in donated arguments)", stats.alias_size_in_bytes, state, "params + optimizer"),
        ("temporaries", stats.temp_size_in_bytes, temp, "the larger below" if update else what),
    ]
    if update:
        rows += [
            ("  backward pass", None, backward, what),
            ("  update, not in place (XLA:CPU)", None, update, "new state + largest update + grad shards"),
        ]
    rows += [
        ("generated code", stats.generated_code_size_in_bytes, None, ""),
        ("total (arguments + outputs - alias + temp)", xla_total, state + temp, "sizing total"),
    ]
    out = [f"  {'(' + unit + ' per device)':<44}{'XLA':>11}{'sizing':>11}"]
    for name, xla, ours, what in rows:
        xla_s = f"{xla / scale:>11.3f}" if xla is not None else f"{'':>11}"
        ours_s = f"{ours / scale:>11.3f}   ({what})" if ours is not None else ""
        out.append(f"  {name:<44}{xla_s}{ours_s}")
    # With mesh.context = R a device holds S/R positions of each of its sequences.
    positions = est.seq_len // est.mesh.get("context", 1)
    grads = "; 2 gradient buffers: the sum so far and the microbatch's" if est.grad_buffers > 1 else ""
    grads += "; gradients: the microbatch's + the sum as this rank's ZeRO-1 shard" if est.sharded_sum else ""
    out.append(
        f"  (sizing: remat {est.remat}, micro-batch {est.micro_batch} x {positions} tokens per device{grads})"
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
    state: Any = None  # the abstract train state it was compiled for
    zero1: bool = True  # mesh.zero1
    grad_accum: int = 1  # train.grad_accum
    grad_reduce: str = "step"  # train.grad_reduce
    grad_reduce_dtype: str = "float32"  # train.grad_reduce_dtype
    xla_log: tuple[str, ...] = ()  # XLA's log records of the compile (`captured_xla_log`)


def compile_step(c: ml_collections.ConfigDict, devices: list[jax.Device]) -> CompiledStep:
    """The step the trainer jits (`train_state.train_program`), lowered from abstract state and batch
    on a mesh of `devices` and compiled; nothing is allocated. The persistent compilation cache is
    off for it: the compile time reported is XLA's, a deviceless GPU executable cannot be read back
    without its client, and XLA:CPU (jax 0.10.2) aborts serializing test_zero1's data=4 x fsdp=2
    step into the cache late in the full test process (twice in CI)."""
    cfg = config_lib.validate(c, device_platform(devices[0]))
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
            compiled = lowered.compile()
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


def device_rows(
    total: int, target: gpu_target.GpuTarget, scale: float, remedies: str = "add devices"
) -> tuple[list[str], str | None]:
    """The device-memory row (in the memory table's unit: bytes / `scale`) and, when the step does
    not fit, the one-line error naming the overshoot and `remedies` (`memory_remedies`)."""
    label = f"  {'device memory (' + target.name + ')':<44}{target.memory_bytes / scale:>11.3f}   "
    if total <= target.memory_bytes:
        return [label + f"fits: {100 * total / target.memory_bytes:.1f}% used"], None
    size = lambda x: f"{x / memory_unit(x)[1]:.2f} {memory_unit(x)[0]}"
    row = label + f"DOES NOT FIT: {size(total - target.memory_bytes)} over"
    error = (
        f"the train step needs {size(total)} per device, {size(total - target.memory_bytes)} more than "
        f"the {target.name}'s {size(target.memory_bytes)} (XLA: arguments + outputs - alias + "
        f"temporaries): {remedies}"
    )
    return [row], error


def memory_remedies(c: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> str:
    """What lowers a step's memory per device, for the "does not fit" errors (the dry run's and the
    trainer's start-up check): fewer sequences per microbatch (train.grad_accum), attention without
    the dense [S, S] scores, remat, ZeRO-2's gradient sum (train.grad_reduce=microbatch) where the
    step sums whole gradients (grad_accum > 1, reduced once per step, the loop per data rank),
    fsdp's split parameters."""
    out = []
    micro = sizing.config_micro_batch(c, mesh.size)
    if micro > 1:
        out.append(
            f"raise train.grad_accum (now {c.train.grad_accum}: {micro} sequences per device per microbatch)"
        )
    platform = mesh_platform(mesh)
    dense = attention_choice(c.model.attention_impl, platform, c.train.seq_len) == "xla"
    if dense and attention_choice("auto", platform, c.train.seq_len) != "xla":
        out.append(
            f"set model.attention_impl=auto (now {c.model.attention_impl}: the dense [S, S] attention scores)"
        )
    if c.model.remat != "full":
        out.append("set model.remat=full")
    if c.train.grad_accum > 1 and c.train.grad_reduce == "step" and zero1.loop_per_rank(mesh):
        out.append(
            "set train.grad_reduce=microbatch (the gradient sum kept as this rank's 1/n shard, "
            "reduce-scattered every microbatch)"
        )
    if mesh.size > 1:
        out.append("split the parameters over mesh.fsdp")
    return ", ".join(out + ["or add devices"])


@dataclasses.dataclass(frozen=True)
class Report:
    """The dry run's printout, and the one-line error it ends with (None when the step fits)."""

    text: str
    error: str | None = None
    data: dict | None = None  # the --dry_run_json report


def report_data(c, name: str, target: str, n: int, shape: dict, hw: dict | None, **parts) -> dict:
    """The --dry_run_json report: what was compiled, then `parts` (memory, collectives, prediction,
    error); the `hardware` object is a valid --dry_run_hardware file."""
    run = {"config": name, "target": target, "devices": n, "mesh": shape}
    run |= {"global_batch": c.train.batch_size, "seq_len": c.train.seq_len, "grad_accum": c.train.grad_accum}
    return {"run": run, "hardware": hw, **parts}


def dry_run(
    c: ml_collections.ConfigDict,
    num_devices: int | None = None,
    name: str = "",
    target: str = "cpu",
    fit: bool = False,
    hardware_override: dict | None = None,
) -> Report:
    """Compiles config `c`'s train step for `num_devices` devices of `target` ("cpu": simulated
    CPU devices; "mi300x", "h100", "h200" or a target config file: deviceless GPUs); returns the
    report (see module), its step predicted on the target's figures (`hardware_override`'s keys
    replacing them)."""
    n = device_count(c, num_devices)
    gpu = None if target == "cpu" else limited(gpu_target.load_target(target))
    if (fit or hardware_override) and gpu is None:
        flag = "--dry_run_fit" if fit else "--dry_run_hardware"
        raise ValueError(f"{flag} needs a GPU --dry_run_target (mi300x, h100, h200 or a file): CPU has none")
    hw = gpu and hardware.for_target(target, gpu.arch, gpu.name, gpu.memory_bytes, hardware_override)
    if hw:
        gpu = dataclasses.replace(gpu, memory_bytes=int(hw["memory_bytes"]))  # the figures' memory
    if gpu is None:
        devices = simulated_devices(n)  # first: validate's backend check would start jax with 1 device
    else:
        gpu_target.prepare_process()
        devices = gpu_target.target_devices(gpu, n)
    print(f"dry run: compiling the train step of {name or 'the config'} for {n} {target} devices", flush=True)
    try:
        step = compile_step(c, devices)
    except jax.errors.JaxRuntimeError as e:
        if gpu is None:
            raise
        return refused(c, devices, gpu, name, fit, e, hw, target)
    compiled, mesh, cfg = step.compiled, step.mesh, step.cfg
    shape = {a: int(mesh.shape[a]) for a in MESH_AXES}
    est = sizing.config_memory_per_device(c, cfg, shape, mesh_platform(mesh))
    stats, hlo = compiled.memory_analysis(), compiled.as_text()
    lines = [
        *_header(c, cfg, shape, gpu, n, name),
        "",
        "Memory per device (XLA: compiled.memory_analysis(); sizing: zaya_jax.sizing's estimate)",
    ]
    lines += memory_rows(stats, est, in_place=gpu is not None)
    error, total = None, memory_total(stats)
    if gpu is not None:
        remedies = memory_remedies(c, mesh)
        rows, error = device_rows(total, gpu, memory_unit(est.total)[1], remedies)
        lines += rows + xla_remat_rows(step.xla_log)
    else:
        lines += host_rows(memory_total(stats), n)
    if fit:
        lines += ["", *fit_report(c, devices, gpu, step)]
    elif error:
        error += " (--dry_run_fit finds a microbatch or a layout that fits)"
    lines += ["", "Collectives per device (result bytes; per step: x while-loop trips)"]
    lines += collective_rows(collectives(hlo))
    lines += ["", "Collectives by mesh axes (model: per microbatch; step: once per optimizer step)"]
    lines += [*axis_rows(hlo, mesh), *zero1_rows(hlo, step)]
    lines += newton_schulz_rows(hlo, c, cfg, n)
    predicted = prediction.predict(hlo, c, cfg, n, hw) if hw else None
    if predicted:
        lines += ["", *prediction.rows(predicted, hw)]
    if gpu is not None:
        lines += ["", *work_rows(hlo, c, cfg, n)]
        code = gpu_target.device_code(compiled, gpu)
        lines.append(
            f"  device code: {code['cubin']} cubin, {code['hsaco']} HSACO object(s) in the executable, "
            f"{gpu.arch} named {code['arch']} time(s)"
        )
    lines += [
        "",
        (f"Compile: trace + lower {step.lower_s:.1f} s, XLA compile {step.compile_s:.1f} s, "
        f"total {step.lower_s + step.compile_s:.1f} s"),
    ]
    data = report_data(
        c, name, target, n, shape, hw,
        memory=prediction.memory_json(stats, total, gpu and gpu.memory_bytes),
        collectives={op: dataclasses.asdict(s) for op, s in collectives(hlo).items()},
        prediction=predicted, error=error,
    )  # fmt: skip
    return Report("\n".join(lines), error, data)


def refused(c, devices: list, gpu: gpu_target.GpuTarget, name: str, fit: bool, e, hw=None, target=""):
    """The report of a step XLA's GPU compiler refused (the fit search still runs: a smaller
    microbatch may compile), ending with the one-line error naming XLA's reason; when XLA's log
    says its rematerialization could not fit the step under its memory limit (XLA:CUDA then fails
    with "Error loading CUDA libraries"), the error says it is memory: how much, against what."""
    cfg = config_lib.validate(c, gpu.platform)
    mesh = mesh_from_config(c, devices=devices)
    shape = {a: int(s) for a, s in mesh.shape.items()}
    reason = str(e).strip().splitlines()[0][:300]
    log = getattr(e, "xla_log", ())
    lines = [
        *_header(c, cfg, shape, gpu, len(devices), name),
        "",
        f"XLA's GPU compiler refused the step: {reason}",
        *xla_remat_rows(log),
    ]
    shortfall = remat_shortfall(log)
    if fit:
        over = f"over XLA's limit: at least {device_memory.size(shortfall[1])}" if shortfall else reason
        lines += ["", *fit_report(c, devices, gpu, own_error=over)]
    if shortfall is not None:
        limit, reached = shortfall
        size = device_memory.size
        cuda = "Error loading CUDA libraries" in reason  # XLA:CUDA's end for it: not a broken install
        then = "the CUDA-libraries error that follows is this, not the install" if cuda else f"XLA: {reason}"
        error = (
            f"the train step does not fit the {gpu.name}'s memory: its buffers need at least "
            f"{size(reached)} per device, over the {size(limit)} XLA allows of the {size(gpu.memory_bytes)} "
            f"device (its rematerialization could not go lower; {then}): {memory_remedies(c, mesh)}"
        )
    else:
        exceeded = "Error loading CUDA libraries" in reason  # XLA:CUDA's end for buffers past the device
        hint = " (XLA:CUDA ends so when the buffers exceed the device: try --dry_run_fit)" if exceeded else ""
        error = f"XLA's {gpu.name} compiler did not compile the train step: {reason}{hint}"
    data = report_data(
        c, name, target, len(devices), shape, hw, memory=None, collectives=None, prediction=None, error=error
    )
    return Report("\n".join(lines), error, data)


def xla_remat_rows(log) -> list[str]:
    """XLA's own word when its rematerialization could not fit the step under its memory limit."""
    shortfall = remat_shortfall(log)
    if shortfall is None:
        return []
    limit, reached = shortfall
    return [
        (f"  XLA's rematerialization could not bring the buffers under its {device_memory.size(limit)} "
        f"limit: only to {device_memory.size(reached)}")
    ]


def limited(gpu: gpu_target.GpuTarget) -> gpu_target.GpuTarget:
    """The target, with its memory replaced by ZAYA_JAX_MEMORY_LIMIT_BYTES when that is set."""
    override = device_memory.limit_override()
    if override is None:
        return gpu
    return dataclasses.replace(gpu, name=f"{gpu.name} [{device_memory.LIMIT_ENV}]", memory_bytes=override)


def host_rows(total: int, n: int) -> list[str]:
    """The CPU target's verdict: the simulated devices of one process share this machine's RAM
    (MemAvailable, the cgroup's room if lower, or ZAYA_JAX_MEMORY_LIMIT_BYTES), as they would
    training this config here."""
    have = device_memory.host_budget(n)
    if have is None:
        return ["  this machine's RAM: unknown (no /proc/meminfo): no verdict"]
    size = lambda x: f"{x / sizing.GIB:,.2f} GiB"
    shared = f", shared by the {n} simulated devices" if n > 1 else ""
    head = f"  {have.what}{shared}: {size(have.bytes)}: "
    need = total * n
    if need <= have.bytes:
        return [head + f"fits ({100 * need / have.bytes:.1f}% used)"]
    return [head + f"DOES NOT FIT here: the step needs {size(need)} ({size(need - have.bytes)} over)"]


def impl_summary(c: ml_collections.ConfigDict, cfg: Any, platform: str) -> str:
    """The impls the step was built with on `platform` (each `auto` resolved, as the model does)."""
    attention = lambda impl: attention_choice(impl, platform, c.train.seq_len)
    ns = c.optim.muon.ns_impl
    chosen = {
        "attention": (cfg.attention_impl, attention(cfg.attention_impl)),
        "experts": (cfg.moe_impl, resolve_moe_impl(cfg.moe_impl, platform)),
        "Newton-Schulz": (ns, ns_choice(ns, platform)),
        "layers": (cfg.scan_layers, resolve_scan_layers(cfg.scan_layers, cfg.num_hidden_layers, platform)),
    }
    shown = [
        f"{part} {got}" + (f" ({given})" if given != got else "") for part, (given, got) in chosen.items()
    ]
    return f"on {platform}: " + ", ".join(shown)


def _header(c, cfg, shape: dict[str, int], gpu: gpu_target.GpuTarget | None, n: int, name: str) -> list[str]:
    where = (
        f"{n} simulated CPU devices"
        if gpu is None
        else f"{n} x {gpu.name} ({gpu.platform.upper()}, {gpu.arch}; deviceless, XLA's GPU compiler)"
    )
    pc = sizing.param_counts(cfg)
    micro_batch = sizing.config_micro_batch(c, n)
    platform = "cpu" if gpu is None else gpu.platform
    return [
        f"dry run: {name or 'config'} on {where}, mesh "
        + " ".join(f"{a}={s}" for a, s in shape.items())
        + f", ZeRO-1 {'on' if c.mesh.zero1 else 'off'}",
        (f"  {pc.total / 1e6:,.1f}M parameters ({pc.active / 1e6:,.1f}M active), global batch "
        f"{c.train.batch_size} x {c.train.seq_len} tokens, grad_accum {c.train.grad_accum} (grad_reduce "
        f"{c.train.grad_reduce}): {micro_batch} "
        f"sequences per device per microbatch, remat {cfg.remat}, compute {cfg.dtype}, "
        f"params {cfg.param_dtype}"),
        "  " + impl_summary(c, cfg, platform),
    ]


# ------------------------------------------------------------------------------------ fit search
@dataclasses.dataclass(frozen=True)
class FitTry:
    """One compile of the fit search: sequences per device per microbatch, its grad_accum, and
    the bytes per device it needs (None when XLA did not compile it, `note` says why)."""

    micro: int
    grad_accum: int
    total: int | None
    fits: bool
    note: str = ""


def microbatch_sizes(c: ml_collections.ConfigDict, devices: int) -> list[int]:
    """Sequences per device per microbatch that train.batch_size allows, smallest first: the
    divisors m of the per-device batch (so grad_accum = per-device batch / m is whole)."""
    rows = devices // config_context(c.mesh, devices)
    per_device = c.train.batch_size // rows
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


def with_microbatch(c: ml_collections.ConfigDict, micro: int, devices: int) -> ml_collections.ConfigDict:
    """A copy of `c` whose train.grad_accum gives `micro` sequences per device per microbatch."""
    out = c.copy_and_resolve_references()
    rows = devices // config_context(c.mesh, devices)
    out.train.grad_accum = c.train.batch_size // (rows * micro)
    return out


def fit_search(
    c, devices: list, gpu: gpu_target.GpuTarget, done: CompiledStep | None = None, own_error: str = ""
) -> list[FitTry]:
    """The compiles that find the largest microbatch that fits, smallest first: a binary search
    over 1, 2, 4, ... sequences per device (the powers of two that divide the per-device batch, and
    the whole per-device batch), memory growing with the microbatch. `done`, the config's own step,
    is reused at its size (`own_error`: XLA refused it); a compile XLA refuses counts as not fitting."""
    sizes = microbatch_sizes(c, len(devices))
    ladder = [m for m in sizes if m & (m - 1) == 0] + ([sizes[-1]] if sizes[-1] & (sizes[-1] - 1) else [])
    tried: dict[int, FitTry] = {}

    def attempt(i: int) -> bool:
        trial = with_microbatch(c, ladder[i], len(devices))
        try:
            if done is not None and trial.train.grad_accum == c.train.grad_accum:
                compiled = done.compiled
            else:
                compiled = compile_step(trial, devices).compiled
            total = memory_total(compiled.memory_analysis())
            tried[i] = FitTry(ladder[i], trial.train.grad_accum, total, total <= gpu.memory_bytes)
        except Exception as e:
            over = remat_shortfall(getattr(e, "xla_log", ()))  # at least this much: does not fit
            note = "over XLA's limit" if over else str(e).splitlines()[0][:120]
            tried[i] = FitTry(ladder[i], trial.train.grad_accum, over[1] if over else None, False, note)
        return tried[i].fits

    lo, hi = -1, len(ladder)  # ladder[lo] fits (or lo = -1), ladder[hi] does not (or hi = len)
    own = [i for i, m in enumerate(ladder) if m == sizing.config_micro_batch(c, len(devices))]
    for i in own if done is not None else ():  # free: already compiled
        lo, hi = (i, hi) if attempt(i) else (lo, i)
    for i in own if own_error else ():
        tried[i], hi = FitTry(ladder[i], c.train.grad_accum, None, False, own_error[:120]), i
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if attempt(mid) else (lo, mid)
    return [tried[i] for i in sorted(tried)]


def fit_rows(tries: list[FitTry]) -> list[str]:
    best = [t for t in tries if t.fits]
    head = "Largest microbatch that fits: " + (
        f"{best[-1].micro} sequences per device (train.grad_accum={best[-1].grad_accum})"
        if best
        else "none (not even 1 sequence per device)"
    )
    out = [head, f"  {'sequences/device':>18}{'grad_accum':>12}{'GiB/device':>12}   verdict"]
    for t in tries:
        gib = f"{t.total / sizing.GIB:>12.2f}" if t.total is not None else f"{'-':>12}"
        verdict = (
            "fits" if t.fits else ("does not fit" if t.total is not None else f"did not compile: {t.note}")
        )
        out.append(f"  {t.micro:>18}{t.grad_accum:>12}{gib}   {verdict}")
    return out


def fit_report(
    c, devices: list, gpu: gpu_target.GpuTarget, done: CompiledStep | None = None, own_error: str = ""
) -> list[str]:
    """--dry_run_fit's section: the remat policy with the least recompute that fits at the config's
    microbatch (`remat_search`), then the largest microbatch that fits with it (`fit_search`; with
    full remat when none fits) and, when not even one sequence per device does, the layouts that
    lower the memory per device, tried in turn (`layout_search`) until one fits."""
    remats = remat_search(c, devices, gpu, done, own_error)
    out = [*remat_rows(remats, c, len(devices)), ""]
    chosen = next((t for t in remats if t.fits), remats[-1])
    if chosen.remat != c.model.remat:
        c, done, own_error = with_remat(c, chosen.remat), chosen.step, chosen.note
    tries = fit_search(c, devices, gpu, done, own_error)
    out += fit_rows(tries)
    if not any(t.fits for t in tries):
        out += ["", *layout_rows(layout_search(c, devices, gpu), c, len(devices))]
    return out


@dataclasses.dataclass(frozen=True)
class RematTry:
    """One compile of the remat search: the policy (model.remat), the bytes per device it needs and
    its compiled model dot FLOPs per step (None when XLA did not compile it, `note` says why), and
    the compiled step (reused by the microbatch search)."""

    remat: str
    total: int | None
    fits: bool
    flops: float | None = None
    note: str = ""
    step: CompiledStep | None = dataclasses.field(default=None, compare=False, repr=False)


def with_remat(c: ml_collections.ConfigDict, remat: str) -> ml_collections.ConfigDict:
    """A copy of `c` with model.remat = `remat`."""
    out = c.copy_and_resolve_references()
    out.model.remat = remat
    return out


def sizing_flops(c: ml_collections.ConfigDict, devices: int) -> float:
    """The model's dot FLOPs per device per step without remat (sizing.flops_per_token x tokens)."""
    tokens = c.train.batch_size * c.train.seq_len / devices
    return sizing.flops_per_token(config_lib.model_config(c), c.train.seq_len) * tokens


def remat_search(
    c, devices: list, gpu: gpu_target.GpuTarget, done: CompiledStep | None = None, own_error: str = ""
) -> list[RematTry]:
    """The remat policies (sizing.REMAT_CHOICES: least recompute first) compiled in turn at the
    config's microbatch, up to the first whose compiled step fits the device: the memory is XLA's
    for the step as compiled (arguments + outputs - alias + temporaries), so whatever lowers it is
    counted. `done`, the config's own step, is reused (`own_error`: XLA refused it); a compile XLA
    refuses counts as not fitting."""
    tries: list[RematTry] = []
    for remat in sizing.REMAT_CHOICES:
        own = remat == c.model.remat
        if own and own_error:
            tries.append(RematTry(remat, None, False, note=own_error[:120]))
            continue
        try:
            step = done if own and done is not None else compile_step(with_remat(c, remat), devices)
        except Exception as e:
            over = remat_shortfall(getattr(e, "xla_log", ()))
            note = "over XLA's limit" if over else str(e).strip().splitlines()[0][:120]
            tries.append(RematTry(remat, over[1] if over else None, False, note=note))
            continue
        total = memory_total(step.compiled.memory_analysis())
        flops = flops_per_step(hlo_lib.work(step.compiled.as_text()), is_model) or None
        tries.append(RematTry(remat, total, total <= gpu.memory_bytes, flops, step=step))
        if tries[-1].fits:
            break
    return tries


def remat_rows(tries: list[RematTry], c: ml_collections.ConfigDict, devices: int) -> list[str]:
    micro = sizing.config_micro_batch(c, devices)
    best = [t for t in tries if t.fits]
    at = f"{micro} sequences per device (train.grad_accum={c.train.grad_accum})"
    chosen = f"--config.model.remat={best[0].remat}" if best else "none"
    head = f"Least recompute that fits at {at}: {chosen}"
    none = next((t.flops for t in tries if t.remat == "none" and t.flops), None)
    model = sizing_flops(c, devices)
    ratio = lambda a, b: f"{a / b:>12.2f}x" if a and b else f"{'-':>13}"
    columns = f"{'GiB/device':>12}{'FLOP/step':>12}{'x none':>13}{'x model':>13}"
    out = [head, f"  {'model.remat':<16}{columns}   verdict"]
    for t in tries:
        gib = f"{t.total / sizing.GIB:>12.2f}" if t.total is not None else f"{'-':>12}"
        flops = f"{_flops(t.flops):>12}" if t.flops else f"{'-':>12}"
        failed = f"did not compile: {t.note}"
        verdict = "fits" if t.fits else ("does not fit" if t.total is not None else failed)
        out.append(f"  {t.remat:<16}{gib}{flops}{ratio(t.flops, none)}{ratio(t.flops, model)}   {verdict}")
    out.append(
        "  (FLOP/step: the compiled model dot FLOPs per device; x none: over remat none's compiled; "
        "x model: over sizing's model FLOPs without remat)"
    )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_ladder(c: ml_collections.ConfigDict, devices: list) -> list[dict[str, Any]]:
    """Config changes that lower a step's memory per device, the least disruptive to the run first,
    each adding to the one before (dotted keys): full remat (the blocks recomputed in the backward),
    the experts split over mesh.expert (the largest size the devices and model.num_experts allow),
    the parameters over mesh.fsdp (the devices left; the whole row when the experts took them all),
    bf16 parameters (the state each data rank holds whole, in half the bytes). mesh.data=-1 takes
    what is left."""
    shape = dict(mesh_from_config(c, devices=devices).shape)
    rows = shape["data"] * shape["fsdp"] * shape["expert"]  # the devices of one context group
    ladder: list[dict[str, Any]] = []
    layout: dict[str, Any] = {}

    def add(**changes: Any) -> None:
        layout.update({k.replace("__", "."): v for k, v in changes.items()})
        ladder.append(dict(layout))

    if c.model.remat != "full":
        add(model__remat="full")
    experts = max(d for d in _divisors(rows // shape["fsdp"]) if c.model.num_experts % d == 0)
    if experts > shape["expert"]:
        add(mesh__expert=experts, mesh__data=-1)
    expert = layout.get("mesh.expert", shape["expert"])
    if rows // expert > shape["fsdp"]:
        add(mesh__fsdp=rows // expert, mesh__data=-1)
    elif rows // shape["expert"] > shape["fsdp"]:  # the experts took every device: fsdp instead
        add(mesh__expert=shape["expert"], mesh__fsdp=rows // shape["expert"], mesh__data=-1)
    if c.model.param_dtype == "float32":
        add(model__param_dtype="bfloat16")
    return ladder


def with_layout(
    c: ml_collections.ConfigDict, layout: dict[str, Any], devices: int
) -> ml_collections.ConfigDict:
    """A copy of `c` at one sequence per device per microbatch with `layout`'s changes."""
    out = with_microbatch(c, 1, devices)
    for key, value in layout.items():
        section, field = key.split(".")
        out[section][field] = value
    return out


def layout_flags(c: ml_collections.ConfigDict, layout: dict[str, Any]) -> str:
    """The command-line flags of a layout (mesh.data=-1 only where the config fixes the data axis)."""
    shown = {k: v for k, v in layout.items() if k != "mesh.data" or c.mesh.data != -1}
    return " ".join(f"--config.{k}={v}" for k, v in shown.items())


@dataclasses.dataclass(frozen=True)
class LayoutTry:
    """One compile of the layout search: the config changes and the bytes per device (None when
    XLA did not compile it, `note` says why)."""

    layout: dict[str, Any]
    total: int | None
    fits: bool
    note: str = ""


def layout_search(c: ml_collections.ConfigDict, devices: list, gpu: gpu_target.GpuTarget) -> list[LayoutTry]:
    """The ladder's layouts (`layout_ladder`) compiled in turn at one sequence per device, up to the
    first that fits."""
    tries = []
    for layout in layout_ladder(c, devices):
        try:
            stats = compile_step(with_layout(c, layout, len(devices)), devices).compiled.memory_analysis()
            total = memory_total(stats)
            tries.append(LayoutTry(layout, total, total <= gpu.memory_bytes))
        except Exception as e:
            shortfall = remat_shortfall(getattr(e, "xla_log", ()))
            note = "over XLA's limit" if shortfall else str(e).strip().splitlines()[0][:120]
            tries.append(LayoutTry(layout, shortfall[1] if shortfall else None, False, note))
        if tries[-1].fits:
            break
    return tries


def layout_rows(tries: list[LayoutTry], c: ml_collections.ConfigDict, devices: int) -> list[str]:
    grad_accum = with_microbatch(c, 1, devices).train.grad_accum
    best = [t for t in tries if t.fits]
    head = (
        f"First layout that fits: {layout_flags(c, best[0].layout)} --config.train.grad_accum={grad_accum}"
        if best
        else f"No layout tried fits{' (none to try)' if not tries else ''}: add devices"
    )
    out = [
        head,
        f"  (one sequence per device, train.grad_accum={grad_accum}; each layout adds to the one before)",
        f"  {'GiB/device':>12}   {'verdict':<17}layout",
    ]
    for t in tries:
        gib = f"{t.total / sizing.GIB:>12.2f}" if t.total is not None else f"{'-':>12}"
        verdict = "fits" if t.fits else ("does not fit" if t.total is not None else "did not compile")
        note = f" ({t.note})" if t.note else ""
        out.append(f"  {gib}   {verdict:<17}{layout_flags(c, t.layout)}{note}")
    return out


# --------------------------------------------------------------------------------- compiled work
def is_model(w: hlo_lib.Work) -> bool:
    """Work of the model's forward / backward (the loss head included), by jax's op_name."""
    return "ZayaForCausalLM" in w.op_name


def is_optimizer(w: hlo_lib.Work) -> bool:
    """Work of the optimizer update (Muon's Newton-Schulz), by its named scope."""
    return OPTIMIZER_SCOPE in w.op_name


def is_expert(w: hlo_lib.Work) -> bool:
    return "/experts/" in w.op_name


def flops_per_step(works: list[hlo_lib.Work], keep=lambda w: True) -> float:
    """Dot FLOPs of the kept work per step on the main path (trip counts included)."""
    return sum(w.flops * w.runs.main for w in works if keep(w))


def kernel_rows(works: list[hlo_lib.Work]) -> list[str]:
    """One row per (kind, name): instructions in the HLO, runs per step, TFLOP per step."""
    groups: dict[tuple[str, str], list[hlo_lib.Work]] = {}
    for w in works:
        groups.setdefault((w.kind, w.name), []).append(w)
    out = [f"  {'kind':<15}{'name':<34}{'in HLO':>8}{'per step':>10}{'FLOP/step':>12}"]
    for (kind, name), ws in sorted(groups.items()):
        flops = flops_per_step(ws)
        shown = f"{_flops(flops):>12}" if flops else f"{'-':>12}"
        out.append(f"  {kind:<15}{name[:33]:<34}{len(ws):>8}{sum(w.runs.main for w in ws):>10}{shown}")
    return out


def _flops(x: float) -> str:
    """FLOPs with an SI prefix: 1.234 T, 56.7 G, ..."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}"
    return f"{x:.4g} "


def work_rows(hlo: str, c: ml_collections.ConfigDict, cfg: Any, n: int) -> list[str]:
    """What XLA:GPU made of the step (kernels) and its dot FLOPs against sizing's model FLOPs."""
    works = hlo_lib.work(hlo)
    tokens = c.train.batch_size * c.train.seq_len / n  # per device per step
    remat = sizing.REMAT_DOT_FACTOR[cfg.remat]
    breakdown = sizing.flops_breakdown(cfg, c.train.seq_len)
    model = sizing.flops_per_token(cfg, c.train.seq_len) * tokens * remat
    routed = 3 * breakdown.moe_active * tokens * remat
    compiled, experts = flops_per_step(works, is_model), flops_per_step(works, is_expert)
    ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
    return [
        "Compiled work per device (trip counts included; Triton kernels: the FLOPs they declare)",
        *kernel_rows(works),
        f"  model dot FLOPs per step: compiled {_flops(compiled)}FLOP, sizing {_flops(model)}FLOP "
        f"(6 x active params x tokens + attention, x remat {remat:.2f}): useful share "
        f"{model / compiled:.0%}"
        if compiled
        else "  model dot FLOPs per step: none found",
        (f"  experts: compiled {_flops(experts)}FLOP vs routed {_flops(routed)}FLOP "
        f"(tokens x one expert, x3 fwd+bwd, x remat): {ratio(experts, routed)} (grouped kernels count "
        "their tiles' worst-case padding; with mesh.expert the exchange's slots)"),
    ]
