"""FLOPs per token of a ZAYA1 config (forward and training), device peaks and MFU.

FLOPs count multiply-adds as 2. A training step is 3x the forward (backward = 2x forward); the
causal attention core sees on average S/2 keys per query (a sliding-window layer min(S, w) with the
window's ramp-up). Rematerialisation's recomputation is not counted (MFU measures useful work, as in
the PaLM paper's definition); `REMAT_DOT_FACTOR` is what it adds to the dots a compiled step runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax

from zaya_jax.model.config import ZayaConfig
from zaya_jax.sizing.counts import param_counts, param_leaves

# Dense bf16 peak per device, FLOP/s (vendor numbers, no sparsity).
PEAK_BF16_FLOPS = {
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI250X": 383e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}
# Dense fp32 matrix peak per device, FLOP/s. AMD: FP32 matrix cores. NVIDIA: TF32 tensor cores,
# which XLA uses for float32 dots at the default matmul precision.
PEAK_FP32_FLOPS = {
    "MI300X": 163.4e12,
    "MI325X": 163.4e12,
    "MI250X": 95.7e12,
    "H200": 494.7e12,
    "H100": 494.7e12,
    "A100": 156e12,
}


@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token, by part. Training = 3x forward (`training_total`)."""

    dense: float  # attention projections, CCA convs, router, norms/scales: 2 x non-expert active params
    attention_core: float  # QK^T and PV over the causal keys
    moe_active: float  # the one routed expert of every block (SwiGLU: gate, up, down)
    head: float  # the output projection onto the vocabulary

    @property
    def forward_total(self) -> float:
        return self.dense + self.attention_core + self.moe_active + self.head

    @property
    def training_total(self) -> float:
        return 3.0 * self.forward_total

    def as_dict(self, training: bool = False) -> dict[str, float]:
        k = 3.0 if training else 1.0
        return {
            "dense": k * self.dense,
            "attention_core": k * self.attention_core,
            "moe_active": k * self.moe_active,
            "head": k * self.head,
            "total": k * self.forward_total,
        }


def mean_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Average keys a causal query attends to: S/2 (the usual convention), or for a sliding window w
    < S the exact mean of min(i, w) over positions i = 1..S."""
    if not window or window >= seq_len:
        return seq_len / 2
    w, s = window, seq_len
    return (w * (w + 1) / 2 + (s - w) * w) / s


def flops_breakdown(cfg: ZayaConfig, seq_len: int) -> FlopsBreakdown:
    """Forward model FLOPs per token at sequence length `seq_len`, split by part."""
    nq, hd = cfg.num_attention_heads, cfg.head_dim
    n = cfg.num_hidden_layers
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe = 2.0 * n * expert * cfg.num_experts_per_tok
    dense = 2.0 * (param_counts(cfg).active - n * expert)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    keys = sum(
        mean_keys_per_query(seq_len, cfg.sliding_window if t == "hybrid_sliding" else None)
        for t in cfg.resolved_layer_types
    )
    attention_core = 2 * 2 * nq * hd * keys  # QK^T and PV, per layer summed over the layers
    return FlopsBreakdown(dense=dense, attention_core=attention_core, moe_active=moe, head=head)


def flops_per_token(cfg: ZayaConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: matmuls of one routed expert per block, attention core, the head."""
    b = flops_breakdown(cfg, seq_len)
    return b.training_total if training else b.forward_total


# Dot work of a training step relative to forward + backward: "full" remat runs the forward
# twice (4 forward-sized passes instead of 3); "dots_saveable" keeps every XLA dot's output and
# "matmuls" our kernels' too, so only elementwise work is recomputed (dots_saveable recomputes the
# Pallas kernels' forward: flash attention, the grouped expert matmuls, on GPUs).
REMAT_DOT_FACTOR = {"none": 1.0, "matmuls": 1.0, "dots_saveable": 1.0, "full": 4.0 / 3.0}


def newton_schulz_flops(cfg: ZayaConfig, ns_steps: int = 5) -> float:
    """Matmul FLOPs of one Muon update's Newton-Schulz iterations over every Muon-routed matrix of
    the model (`newton_schulz_flops_of` their shapes).

    Paid once per optimizer step whatever the batch, so at a small batch it can outweigh the model:
    configs/mid.py's 16 experts of 512 x 1024 per block cost 1.08 TFLOP a step against 0.13 TFLOP of
    forward + backward at 2,048 tokens."""
    muon = [shape for _, shape, label in param_leaves(cfg) if label == "muon"]
    return newton_schulz_flops_of(muon, ns_steps)


def newton_schulz_flops_of(shapes: Sequence[tuple[int, ...]], ns_steps: int = 5) -> float:
    """Matmul FLOPs of `ns_steps` Newton-Schulz iterations on every [m, n] slice of each [..., rows,
    cols] shape (zaya_jax.kernels.newton_schulz.orthogonalize): m <= n, each iteration forms
    A = X X^T (2 m^2 n), A^2 (2 m^3) and (b A + c A^2) X (2 m^2 n)."""
    total = 0.0
    for *batch, rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += math.prod(batch) * ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return total


def _peak_from_table(table: Mapping[str, float], device: jax.Device | None) -> float | None:
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "").upper().replace(" ", "")
    for name, peak in table.items():
        if name in kind:
            return peak
    return None


def peak_flops_per_device(device: jax.Device | None = None, dtype: str = "bfloat16") -> float | None:
    """Vendor dense peak of `device` (default: the first device) for `dtype` matmuls (float32: the
    fp32 table; bfloat16 / float16: the bf16 table), None when unknown (e.g. CPU)."""
    import jax.numpy as jnp

    table = PEAK_FP32_FLOPS if jnp.dtype(dtype).name == "float32" else PEAK_BF16_FLOPS
    return _peak_from_table(table, device)


def mfu(
    tokens_per_second: float, cfg: ZayaConfig, seq_len: int, num_devices: int, peak_per_device: float | None
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak. None if peak unknown."""
    if not peak_per_device:
        return None
    return tokens_per_second * flops_per_token(cfg, seq_len) / (num_devices * peak_per_device)
