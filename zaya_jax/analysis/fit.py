"""The dry run's fit search: the largest microbatch that fits, else the first layout of a
ladder that does, and the remedies an out-of-memory step is told."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from zaya_jax import config as config_lib
from zaya_jax import sizing
from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.analysis.compiled import (
    CompiledStep,
    compile_step,
    remat_shortfall,
)
from zaya_jax.analysis.report import (
    _flops,
    flops_per_step,
    is_model,
    memory_total,
)
from zaya_jax.kernels import attention_choice
from zaya_jax.parallel import zero1
from zaya_jax.parallel.context import config_context
from zaya_jax.parallel.mesh import mesh_from_config, mesh_platform
from zaya_jax.runtime import gpu_target


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
            tried[i] = FitTry(ladder[i], trial.train.grad_accum, *_refusal(e))
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
    """The remat policies (sizing.REMAT_CHOICES: least recompute first) compiled at the config's
    microbatch. The leanest (full) goes first: when it does not fit, no policy does and the others
    are not compiled. Otherwise the policies are compiled in turn, least recompute first, up to the
    first that fits. The memory is XLA's for the step as compiled (arguments + outputs - alias +
    temporaries), so whatever lowers it is counted. `done`, the config's own step, is reused
    (`own_error`: XLA refused it); a compile XLA refuses counts as not fitting. Tries are returned
    least recompute first."""
    choices = list(sizing.REMAT_CHOICES)
    own = [choices.index(c.model.remat)] if c.model.remat in choices and (done is not None or own_error) else []
    return _leanest_first(choices, lambda remat: _remat_try(c, remat, devices, gpu, done, own_error), own)


def _refusal(e: Exception) -> tuple[int | None, bool, str]:
    """(bytes, fits, note) of a compile XLA refused: over its memory limit (at least the bytes its
    rematerialization could reach: does not fit), or failed for another reason (its first line)."""
    over = remat_shortfall(getattr(e, "xla_log", ()))
    return (over[1], False, "over XLA's limit") if over else (None, False, str(e).strip().splitlines()[0][:120])


def _over(t: RematTry | LayoutTry) -> bool:
    """True when a try is known not to fit: compiled too large, or refused by XLA for memory (a
    compile that failed for another reason says nothing about memory: its bytes are None)."""
    return not t.fits and t.total is not None


def _leanest_first(candidates: list, attempt: Callable[[Any], Any], free: list[int]) -> list:
    """The tries of a search over `candidates` ordered by memory, the least last: the indices in
    `free` (already compiled) first, then the last; when it is known not to fit, none does and the
    search ends. Otherwise the candidates in turn up to the first that fits. Each is tried at most
    once; the tries are returned in `candidates` order."""
    tried: dict[int, Any] = {}

    def one(i: int):
        if i not in tried:
            tried[i] = attempt(candidates[i])
        return tried[i]

    for i in free:
        one(i)
    if candidates and not _over(one(len(candidates) - 1)):
        for i in range(len(candidates)):
            if one(i).fits:
                break
    return [tried[i] for i in sorted(tried)]


def _remat_try(c, remat: str, devices: list, gpu, done: CompiledStep | None, own_error: str) -> RematTry:
    """One policy of `remat_search`: its compiled step's memory and model dot FLOPs."""
    own = remat == c.model.remat
    if own and own_error:
        return RematTry(remat, None, False, note=own_error[:120])
    try:
        step = done if own and done is not None else compile_step(with_remat(c, remat), devices)
    except Exception as e:
        total, fits, note = _refusal(e)
        return RematTry(remat, total, fits, note=note)
    total = memory_total(step.compiled.memory_analysis())
    flops = flops_per_step(hlo_lib.work(step.compiled.as_text()), is_model) or None
    return RematTry(remat, total, total <= gpu.memory_bytes, flops, step=step)


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
    if not best and tries and _over(tries[-1]):
        out.append(f"  ({tries[-1].remat} needs the least memory: as it does not fit, the rest were not compiled)")
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
    """The ladder's layouts (`layout_ladder`) compiled at one sequence per device. The last (every
    change together, the least memory) goes first: when it does not fit, none does and the others
    are not compiled. Otherwise the layouts are compiled in turn up to the first that fits. Tries
    are returned in ladder order."""
    return _leanest_first(layout_ladder(c, devices), lambda layout: _layout_try(c, layout, devices, gpu), [])


def _layout_try(c, layout: dict[str, Any], devices: list, gpu: gpu_target.GpuTarget) -> LayoutTry:
    """One layout of `layout_search`: its compiled step's memory per device."""
    try:
        stats = compile_step(with_layout(c, layout, len(devices)), devices).compiled.memory_analysis()
    except Exception as e:
        return LayoutTry(layout, *_refusal(e))
    total = memory_total(stats)
    return LayoutTry(layout, total, total <= gpu.memory_bytes)


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
    if not best and tries and _over(tries[-1]):
        out.append("  (the last layout needs the least memory: as it does not fit, the rest were not compiled)")
    return out
