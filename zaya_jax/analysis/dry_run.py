"""`python -m zaya_jax.train --config CONFIG --dry_run [--dry_run_devices N] [--dry_run_target T]
[--dry_run_fit] [--dry_run_hardware FILE] [--dry_run_json FILE]`: compile the real train step of
any config at full size for N devices, without allocating it.

The step is the one the trainer jits (`train_state.train_program`), traced from abstract shapes and
compiled for N simulated CPU devices or N deviceless GPUs (`mi300x`, `h100`, or a GpuTargetConfig
file: zaya_jax/runtime/gpu_target.py). It prints memory per device (against sizing and the
device, or this machine's RAM for the CPU target), the remat policy with the least recompute that
fits and the largest microbatch that fits with it (--dry_run_fit; if none, the first layout that
does), the collectives with their bytes, Muon's Newton-Schulz FLOPs, the compiled kernels and dot
FLOPs and the predicted step time (GPU targets: zaya_jax/analysis/timeline.py) and compile times;
nothing is written to disk but --dry_run_json's report. The compiled step is compiled.py's, the
tables report.py's, the fit and remat searches fit.py's.
What each table means: docs/guides/dry-run.md.
XLA's own log records while compiling are kept from the terminal (ZAYA_DEBUG=1 shows them).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.analysis import hardware, prediction
from zaya_jax.analysis.compiled import (
    compile_step,
    device_count,
    limited,
    remat_shortfall,
    simulated_devices,
)
from zaya_jax.analysis.fit import fit_report, memory_remedies
from zaya_jax.analysis.report import (
    _header,
    axis_rows,
    collective_rows,
    collectives,
    device_rows,
    host_rows,
    memory_rows,
    memory_total,
    memory_unit,
    newton_schulz_rows,
    work_rows,
    xla_remat_rows,
    zero1_rows,
)
from zaya_jax.parallel.mesh import MESH_AXES, mesh_from_config, mesh_platform
from zaya_jax.runtime import device_memory, gpu_target


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
    predicted = prediction.predict(hlo, c, cfg, n, hw, mesh) if hw else None
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
