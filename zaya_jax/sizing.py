"""Parameter counts, FLOPs per token and the MFU formula the trainer reports.

FLOPs count multiply-adds as 2. A training step is 3x the forward (backward = 2x forward); the
causal attention core sees on average S/2 keys per query. Rematerialisation's recomputation is
not counted (MFU measures useful work, as in the PaLM paper's definition).
"""

from __future__ import annotations

import dataclasses

import jax

from zaya_jax.model.config import ZayaConfig

# Dense bf16 peak per device, FLOP/s (vendor numbers, no sparsity).
PEAK_BF16_FLOPS = {
    "MI300X": 1307e12, "MI325X": 1307e12, "MI250X": 383e12,
    "H200": 989e12, "H100": 989e12, "A100": 312e12,
}


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int
  embedding: int  # the (tied) embedding table
  active: int  # per token, without embedding: one routed expert per block


def param_counts(cfg: ZayaConfig) -> ParamCounts:
  d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  e, i, r = cfg.num_experts, cfg.moe_intermediate_size, cfg.router_hidden_size
  c = cfg.conv_channels
  attn = d * nq * hd + d * nkv * hd + d * nkv * hd + nq * hd * d + nkv  # q, k, v (two halves), o, temp
  attn += c * cfg.cca_time0 + c + c * hd * cfg.cca_time1 + c  # convs with biases
  if cfg.attention_bias:
    attn += nq * hd + nkv * hd + nkv * hd + d
  router = d * r + r + r + r + 2 * (r * r + r) + r * (e + 1)  # down(+b), EDA scale, norm, fc1/2, out
  expert = 3 * d * i
  norms_scales = 2 * d + 2 * 4 * d
  per_block_shared = attn + router + norms_scales
  embedding = cfg.vocab_size * d
  head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
  top = embedding + head + 3 * d + (cfg.vocab_size if cfg.lm_head_bias else 0)  # + final norm, input scale/bias
  n = cfg.num_hidden_layers
  total = top + n * (per_block_shared + e * expert)
  # Block 0 has no EDA scale in the released model; we keep one (it multiplies zeros).
  total -= r
  active = n * (per_block_shared + expert) - r
  return ParamCounts(total=total, embedding=embedding, active=active)


def flops_per_token(cfg: ZayaConfig, seq_len: int, training: bool = True) -> float:
  """Model FLOPs per token: matmuls of one routed expert per block, attention core, the head."""
  d, nq, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
  matmul_params = param_counts(cfg).active + cfg.vocab_size * d  # + the output head matmul
  attention_core = cfg.num_hidden_layers * 2 * 2 * nq * hd * (seq_len / 2)  # QK^T and PV
  forward = 2 * matmul_params + attention_core
  return 3 * forward if training else forward


def peak_flops_per_device(device: jax.Device | None = None) -> float | None:
  """Vendor bf16 peak of `device` (default: the first device), None when unknown (e.g. CPU)."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "").upper()
  for name, peak in PEAK_BF16_FLOPS.items():
    if name in kind.replace(" ", ""):
      return peak
  return None


def mfu(tokens_per_second: float, cfg: ZayaConfig, seq_len: int, num_devices: int,
        peak_per_device: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak. None if peak unknown."""
  if not peak_per_device:
    return None
  return tokens_per_second * flops_per_token(cfg, seq_len) / (num_devices * peak_per_device)
