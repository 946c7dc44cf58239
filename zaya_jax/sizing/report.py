"""The sizing printout of `python -m zaya_jax.sizing` and the same numbers as a JSON-able dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zaya_jax.model.config import ZayaConfig
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.sizing.counts import ParamCounts, param_counts
from zaya_jax.sizing.flops import FlopsBreakdown, flops_breakdown, newton_schulz_flops
from zaya_jax.sizing.memory import GIB, MI300X_MEMORY_GIB, MemoryEstimate, memory_per_device
from zaya_jax.sizing.rules import GEMM_PEAK_WORK_FLOPS, gemm_shapes, sizing_warnings


def _fmt_count(n: float) -> str:
    return f"{n / 1e9:.3f}B"


def _fmt_flops(x: float) -> str:
    return f"{x / 1e9:10.3f} GFLOP"


def _gib(x: float) -> str:
    return f"{x / GIB:10.2f}"


def report(
    cfg: ZayaConfig,
    *,
    seq_len: int,
    micro_batch: int,
    mesh: Mapping[str, int],
    remat: str,
    zero1: bool = True,
    device_memory_gib: float = MI300X_MEMORY_GIB,
    header: str = "",
    muon_mu_bytes: int = 4,
    step_tokens: int | None = None,
    ns_steps: int = 5,
    accumulate: bool = False,
    grad_reduce: str = "step",
    attention: str = "xla",
) -> tuple[str, dict[str, Any]]:
    """The sizing printout and the same numbers as a JSON-able dict. `step_tokens`: the global
    batch in tokens, to compare Muon's Newton-Schulz with the step's model FLOPs (with `ns_steps`
    iterations); `accumulate`, `grad_reduce`: a step of several microbatches, the gradients reduced
    once per step or every microbatch; `attention` the resolved attention impl (memory_per_device)."""
    pc = param_counts(cfg)
    fb = flops_breakdown(cfg, seq_len)
    ns = newton_schulz_flops(cfg, ns_steps)
    mem = memory_per_device(
        cfg,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mesh=mesh,
        remat=remat,
        zero1=zero1,
        muon_mu_bytes=muon_mu_bytes,
        accumulate=accumulate,
        grad_reduce=grad_reduce,
        attention=attention,
    )
    devices = math.prod(mesh.values())
    tokens = micro_batch * seq_len // mesh["context"]
    warnings = sizing_warnings(cfg, tokens_per_device=tokens, mesh=mesh)
    if mem.total > device_memory_gib * GIB:
        warnings.append(
            f"WARNING estimated {mem.total / GIB:.1f} GiB per device exceeds the device's "
            f"{device_memory_gib:g} GiB: lower the micro-batch (raise train.grad_accum), "
            f"rematerialise, or shard more (fsdp / ZeRO-1 / expert)"
            + (
                ", or set train.grad_reduce=microbatch (the gradient sum as this rank's shard)"
                if mem.grad_buffers > 1
                else ""
            )
        )
    gemms = gemm_shapes(cfg, tokens, mesh.get("expert", 1), head_tokens=micro_batch * min(512, seq_len))
    lines = [header] if header else []
    lines.append(
        f"mesh {' '.join(f'{a}={mesh[a]}' for a in MESH_AXES)} ({devices} devices), "
        f"micro-batch {micro_batch} sequences x {seq_len} tokens"
        + (f" / {mesh['context']} context ranks" if mesh["context"] > 1 else "")
        + f" = {tokens:,} tokens/device, "
        f"remat {remat}, ZeRO-1 {'on' if zero1 else 'off'}, attention {attention}"
    )
    lines += _param_lines(pc)
    lines += _flops_lines(cfg, pc, fb, seq_len)
    lines += _muon_lines(ns, ns_steps, step_tokens and step_tokens * fb.training_total)
    lines += _memory_lines(cfg, mem, devices, remat, device_memory_gib)
    lines += _gemm_lines(gemms, tokens)
    lines += ["", "Sizing rules" + (":" if warnings else ": all dimensions follow them")]
    lines += [f"  {w}" for w in warnings]
    data = {
        "params": {
            "total": pc.total,
            "embedding": pc.embedding,
            "non_embedding": pc.non_embedding,
            "active": pc.active,
        },
        "flops_per_token": {"seq_len": seq_len, "forward": fb.as_dict(False), "training": fb.as_dict(True)},
        "newton_schulz_flops_per_step": ns,
        "memory_per_device_bytes": mem.as_dict(),
        "gemms": [
            {"name": g[0], "m": g[1], "n": g[2], "k": g[3], "flops": 2 * g[1] * g[2] * g[3]} for g in gemms
        ],
        "warnings": warnings,
    }
    return "\n".join(lines), data


def _param_lines(pc: ParamCounts) -> list[str]:
    return [
        "",
        "Parameters",
        f"  total            {_fmt_count(pc.total):>9}  ({pc.total:,})",
        f"  embedding        {_fmt_count(pc.embedding):>9}  ({pc.embedding:,})",
        f"  non-embedding    {_fmt_count(pc.non_embedding):>9}  ({pc.non_embedding:,})",
        (f"  active           {_fmt_count(pc.active):>9}  ({pc.active:,}; non-embedding, one routed "
        f"expert per block)"),
    ]


_FLOPS_ROWS = {
    "dense": "dense (attn proj, conv, router)",
    "attention_core": "attention core (QK^T, PV)",
    "moe_active": "MoE (one active expert)",
    "head": "head (lm head)",
    "total": "total",
}


def _flops_lines(cfg: ZayaConfig, pc: ParamCounts, fb: FlopsBreakdown, seq_len: int) -> list[str]:
    lines = ["", f"FLOPs per token (seq_len {seq_len})          forward          training (3x)"]
    fwd, trn = fb.as_dict(False), fb.as_dict(True)
    for key, name in _FLOPS_ROWS.items():
        lines.append(f"  {name:<34}{_fmt_flops(fwd[key])}  {_fmt_flops(trn[key])}")
    lines.append(
        f"  (6 x (active + head params) = {6 * (pc.active + cfg.vocab_size * cfg.hidden_size) / 1e9:.3f} "
        f"GFLOP: the attention core is the rest)"
    )
    return lines


def _muon_lines(ns: float, ns_steps: int, step_flops: float | None) -> list[str]:
    """Muon's Newton-Schulz is paid once per optimizer step, so its share falls as the batch grows."""
    line = f"  Muon Newton-Schulz ({ns_steps} iterations)  {ns / 1e12:.3f} TFLOP per optimizer step"
    if step_flops:
        line += f", {ns / step_flops:.2%} of the step's {step_flops / 1e12:,.3f} TFLOP of model FLOPs"
    return [line]


def _memory_lines(
    cfg: ZayaConfig, mem: MemoryEstimate, devices: int, remat: str, device_memory_gib: float
) -> list[str]:
    return [
        "",
        f"Memory per device (GiB; {devices} devices)",
        f"  {'params (' + cfg.param_dtype + ')':<30}{_gib(mem.params)}",
        f"  {'grads (' + cfg.param_dtype + ')':<30}{_gib(mem.grads)}" + _grads_note(mem),
        f"  {'optimizer: Muon momentum':<30}{_gib(mem.optimizer_muon)}   ({mem.muon_params / 1e9:.3f}B params)",
        f"  {'optimizer: AdamW m, v':<30}{_gib(mem.optimizer_adamw)}   ({mem.adamw_params / 1e9:.3f}B params)",
        f"  {'activations (remat ' + remat + ')':<30}{_gib(mem.activations)}",
        f"  {'total':<30}{_gib(mem.total)}   (device: {device_memory_gib:g} GiB)",
        "  activations by remat policy: "
        + ", ".join(f"{r} {v / GIB:.2f}" for r, v in mem.activations_by_remat.items()),
    ]


def _grads_note(mem: MemoryEstimate) -> str:
    if mem.grad_buffers > 1:
        return "   (x2: the sum over microbatches and the microbatch's own)"
    if mem.sharded_sum:
        return "   (the microbatch's own + the sum as this rank's ZeRO-1 shard: grad_reduce microbatch)"
    return ""


def _gemm_lines(gemms: list[tuple[str, int, int, int]], tokens: int) -> list[str]:
    lines = [
        "",
        (f"GEMMs per call at {tokens:,} tokens/device (forward; rule: ~{GEMM_PEAK_WORK_FLOPS / 1e9:.0f} "
        "GFLOP for peak on MI300X)"),
        f"  {'gemm':<20}{'M':>10}{'N':>8}{'K':>7}{'GFLOP':>10}",
    ]
    for name, m, n, k in gemms:
        lines.append(f"  {name:<20}{m:>10,}{n:>8,}{k:>7,}{2 * m * n * k / 1e9:>10.1f}")
    return lines
