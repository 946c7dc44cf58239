"""The dry run's tables: memory, collectives and their bytes, the device and host rows, the
compiled kernels and FLOPs, the header."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections

from zaya_jax import sizing
from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.analysis.compiled import (
    CompiledStep,
    remat_shortfall,
)
from zaya_jax.analysis.hlo import COLLECTIVES
from zaya_jax.kernels import attention_choice, ns_choice
from zaya_jax.model.moe import resolve_moe_impl
from zaya_jax.model.transformer import resolve_scan_layers
from zaya_jax.parallel import overlap, zero1
from zaya_jax.runtime import device_memory, gpu_target
from zaya_jax.training.train_state import OPTIMIZER_SCOPE


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


# The model's name scope in jax's op names: its forward and backward.
MODEL = "ZayaForCausalLM"


def in_model(c: hlo_lib.Collective) -> bool:
    """Whether a collective belongs to the model's forward / backward (runs per microbatch); the
    blocks' gradient reduce-scatters in the last microbatch's backward run once per step
    (train.overlap_grad_reduce: overlap.BLOCK_REDUCE_SCOPE), and so do the blocks' weight gathers in
    the first microbatch's forward (train.overlap_param_gather: overlap.BLOCK_GATHER_SCOPE)."""
    once = (overlap.BLOCK_REDUCE_SCOPE, overlap.BLOCK_GATHER_SCOPE)
    return MODEL in c.op_name and not any(scope in c.op_name for scope in once)


def wire_bytes(c: hlo_lib.Collective) -> float:
    """Bytes a collective moves through each device's links per run (`hlo.ring_bytes` over its
    group)."""
    return hlo_lib.ring_bytes(c.op, c.bytes, len(c.groups[0]) if c.groups else 1)


def data_parallel_timing(hlo: str, mesh: jax.sharding.Mesh, by_name: dict[str, list[float]]) -> dict:
    """The ZeRO-1 collectives (spanning the data axis, outside the model: `data_parallel_bytes`'
    first part) on the timeline (`timeline.Cost.by_name`): their bytes on the wire per device per
    step (`wire_bytes`), seconds, exposed seconds, and the share of those bytes hidden behind compute
    (each collective's bytes x the part of its time not exposed)."""
    wire = hidden = seconds = exposed = 0.0
    for c in spanning_data(hlo, mesh):
        if in_model(c):
            continue
        s, e = by_name.get(c.key, (0.0, 0.0))
        nbytes = wire_bytes(c) * c.runs.main
        wire, seconds, exposed = wire + nbytes, seconds + s, exposed + e
        hidden += nbytes * (1 - e / s) if s else 0.0
    share = hidden / wire if wire else None
    return {"wire_bytes": wire, "seconds": seconds, "exposed_seconds": exposed, "hidden_share": share}


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
    blocks, gathers = step.overlaps
    where = f"in each of the {step.grad_accum} microbatches" if each else "once into the ZeRO-1 shards"
    where += ", each block's in the last microbatch's backward" if blocks else ""
    master = zero1.shards_master(step.cfg.params_dtype, step.cfg.compute_dtype, step.zero1)
    gathered = f"the {step.cfg.dtype} compute weights" if master else "the fp32 updates"
    gathered += ", each block's in the first microbatch's forward" if gathers else ""
    return [
        (f"  data-parallel (spanning the data axis): outside the model {once / 2**20:.2f} MiB{ratio}, in the "
        f"model {looped / 2**20:.2f} MiB (result bytes); formula {formula / 2**20:.2f} MiB, "
        f"{wire / 2**20:.2f} MiB on the wire (ring): {step.grad_reduce_dtype} gradients reduce-scattered "
        f"{where}, {gathered} all-gathered (docs/design/zero1.md)"),
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
    step = model = 0
    for c in spanning_data(hlo, mesh):
        if in_model(c):
            model += c.bytes * c.runs.main
        else:
            step += c.bytes * c.runs.main
    return step, model


def spanning_data(hlo: str, mesh: jax.sharding.Mesh) -> list[hlo_lib.Collective]:
    """The collectives that move data over the data axis (`moving`; groups spanning it, or groups
    not given: every device)."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    return [c for c in moving(hlo_lib.collectives(hlo)) if "data" in (hlo_lib.group_axes(c.groups, names, shape) or ("data",))]


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


# --------------------------------------------------------------------------------- compiled work
def is_model(w: hlo_lib.Work) -> bool:
    """Work of the model's forward / backward (the loss head included), by jax's op_name."""
    return MODEL in w.op_name


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
