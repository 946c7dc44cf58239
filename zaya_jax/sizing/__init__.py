"""Sizing of a ZAYA1 run: parameter counts, FLOPs per token, memory per device, and the GEMM sizing
rules of the MI300X (docs/model.md §4). Also the MFU formula the trainer reports.

    python -m zaya_jax.sizing --config configs/zaya1_base.py[:phase] [--config.key=value ...]
        [--mesh data=8,fsdp=1,expert=1] [--num-devices 8] [--remat full|dots_saveable|matmuls|none]
        [--micro-batch B] [--device-memory-gib 192] [--zero1=true] [--json PATH]

One module per concern:
  counts    parameter counts and the model's leaves with their optimizer (zaya_jax/params.py)
  flops     FLOPs per token, device peaks, MFU
  memory    memory per device (params, grads, optimizer state, activations) on a mesh
  rules     the GEMM sizing rules (widths, head_dim, expert GEMM work) and their warnings
  report    the printout of `python -m zaya_jax.sizing` (__main__)
"""

from zaya_jax.sizing.counts import ParamCounts, param_counts, param_leaves
from zaya_jax.sizing.flops import (
    PEAK_BF16_FLOPS,
    PEAK_FP32_FLOPS,
    REMAT_DOT_FACTOR,
    FlopsBreakdown,
    flops_breakdown,
    flops_per_token,
    mean_keys_per_query,
    mfu,
    newton_schulz_flops,
    newton_schulz_flops_of,
    peak_flops_per_device,
)
from zaya_jax.sizing.memory import (
    GIB,
    MI300X_MEMORY_GIB,
    REMAT_CHOICES,
    MemoryEstimate,
    activation_bytes,
    activation_terms,
    config_memory_per_device,
    config_micro_batch,
    kv_all_gather_bytes,
    memory_per_device,
    param_mesh_axes,
    parse_mesh,
    state_bytes_per_device,
)
from zaya_jax.sizing.report import report
from zaya_jax.sizing.rules import GEMM_FAR_BELOW_FRACTION, GEMM_PEAK_WORK_FLOPS, gemm_shapes, sizing_warnings

__all__ = [
    "GEMM_FAR_BELOW_FRACTION",
    "GEMM_PEAK_WORK_FLOPS",
    "GIB",
    "MI300X_MEMORY_GIB",
    "PEAK_BF16_FLOPS",
    "PEAK_FP32_FLOPS",
    "REMAT_CHOICES",
    "REMAT_DOT_FACTOR",
    "FlopsBreakdown",
    "MemoryEstimate",
    "ParamCounts",
    "activation_bytes",
    "activation_terms",
    "config_memory_per_device",
    "config_micro_batch",
    "flops_breakdown",
    "flops_per_token",
    "gemm_shapes",
    "kv_all_gather_bytes",
    "mean_keys_per_query",
    "memory_per_device",
    "mfu",
    "newton_schulz_flops",
    "newton_schulz_flops_of",
    "param_counts",
    "param_leaves",
    "param_mesh_axes",
    "parse_mesh",
    "peak_flops_per_device",
    "report",
    "sizing_warnings",
    "state_bytes_per_device",
]
