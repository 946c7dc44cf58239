"""Builds random `transformers` ZayaForCausalLM models to compare against (tests only).

Every parameter HF initialises to a constant (residual scales and biases, temps, norm weights,
router state scales, balancing biases) is randomised too, so that no term can be silently dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers import ZayaConfig as HFZayaConfig
from transformers import ZayaForCausalLM as HFZayaForCausalLM


def randomize_weights(model, seed: int):
    """Draws every constant-initialised parameter and the balancing biases at random (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("scale", "bias", "temp", "norm")):
                base = 1.0 if ("scale" in name or "norm" in name or "temp" in name) else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("balancing_biases"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


@dataclasses.dataclass(frozen=True)
class Case:
    """One randomised model + input configuration."""

    seed: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    t0: int
    t1: int
    experts: int
    theta: float
    batch: int
    seq: int
    padded: bool
    hidden: int = 48
    vocab: int = 97
    intermediate: int = 40
    router_hidden: int = 24
    attention_bias: bool = False


def random_case(seed: int) -> Case:
    """A reproducible point of the acceptance grid: layers 1-4, kv 1/2/4, q <= 8, head_dim 16-64,
    t0/t1 in {2, 3}, experts 2-8, theta, batch 1-3, seq 1-40, with and without padding."""
    r = np.random.default_rng(1000 + seed)
    kv = int(r.choice([1, 2, 4]))
    q = kv * int(r.choice([g for g in (1, 2, 4, 8) if kv * g <= 8]))
    return Case(
        seed=seed,
        layers=int(r.integers(1, 5)),
        q_heads=q,
        kv_heads=kv,
        head_dim=int(r.choice([16, 32, 48, 64])),
        t0=int(r.choice([2, 3])),
        t1=int(r.choice([2, 3])),
        experts=int(r.integers(2, 9)),
        theta=float(r.choice([1e4, 1e6, 5e6])),
        batch=int(r.integers(1, 4)),
        seq=int(r.integers(1, 41)),
        padded=bool(seed % 2),
    )


def hf_config(case: Case, **overrides) -> HFZayaConfig:
    kw = dict(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        num_hidden_layers=case.layers,
        num_attention_heads=case.q_heads,
        num_key_value_heads=case.kv_heads,
        head_dim=case.head_dim,
        cca_time0=case.t0,
        cca_time1=case.t1,
        num_experts=case.experts,
        moe_intermediate_size=case.intermediate,
        router_hidden_size=case.router_hidden,
        attention_bias=case.attention_bias,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        rope_parameters={
            t: {"rope_type": "default", "rope_theta": case.theta, "partial_rotary_factor": 0.5}
            for t in ("hybrid", "hybrid_sliding")
        },
        initializer_range=0.2,
    )
    kw.update(overrides)
    return HFZayaConfig(**kw)


def random_hf_model(case: Case, **config_overrides) -> HFZayaForCausalLM:
    torch.manual_seed(case.seed)
    return randomize_weights(HFZayaForCausalLM(hf_config(case, **config_overrides)).eval(), case.seed)


def random_inputs(case: Case) -> tuple[np.ndarray, np.ndarray | None]:
    """ids [B, S] and, for padded cases, a left-padding mask [B, S] (row 0 keeps >= 1 token)."""
    r = np.random.default_rng(case.seed)
    ids = r.integers(3, case.vocab, size=(case.batch, case.seq))
    if not case.padded:
        return ids, None
    mask = np.ones((case.batch, case.seq), np.int64)
    for b in range(case.batch):
        mask[b, : int(r.integers(0, case.seq))] = 0  # left padding, at least one real token
    return ids, mask


def hf_logits(model: HFZayaForCausalLM, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(ids), attention_mask=None if mask is None else torch.as_tensor(mask))
    return out.logits.float().numpy()
