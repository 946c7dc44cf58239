"""`config.json` <-> ZayaConfig, for the native `transformers` layout and the legacy ZAYA1-base one."""

from __future__ import annotations

import re
from typing import Any

from zaya_jax.model.config import ZayaConfig

TRANSFORMERS_VERSION = "5.23.0"
# Fields copied verbatim between transformers' ZayaConfig and ours.
SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "cca_time0",
    "cca_time1",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "router_hidden_size",
    "hidden_act",
    "rms_norm_eps",
    "sliding_window",
    "attention_bias",
    "lm_head_bias",
    "tie_word_embeddings",
    "initializer_range",
    "max_position_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
HF_DEFAULTS = dict(
    vocab_size=262272,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    cca_time0=2,
    cca_time1=2,
    num_experts=16,
    num_experts_per_tok=1,
    moe_intermediate_size=2048,
    router_hidden_size=256,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    sliding_window=None,
    attention_bias=False,
    lm_head_bias=False,
    tie_word_embeddings=True,
    initializer_range=0.02,
    max_position_embeddings=131072,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=106,
)


def _rope(params: dict, where: str) -> tuple[float, float]:
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.json {where}: rope_type {rope_type!r} is not supported (only 'default')")
    return float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0))


def from_native(d: dict[str, Any], **overrides) -> ZayaConfig:
    """A transformers `ZayaConfig` dict -> ZayaConfig (missing fields take transformers' defaults)."""
    if d.get("model_type") != "zaya":
        raise ValueError(f"config.json: model_type is {d.get('model_type')!r}, expected 'zaya'")
    fields = {k: d.get(k, HF_DEFAULTS[k]) for k in SHARED_FIELDS}
    if isinstance(fields["eos_token_id"], list):
        fields["eos_token_id"] = fields["eos_token_id"][0] if fields["eos_token_id"] else None
    rope = d.get("rope_parameters") or {
        "hybrid": {"rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        "hybrid_sliding": {"rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    }
    if "rope_theta" in rope:  # a flat dict applies to every layer type
        rope = {"hybrid": rope, "hybrid_sliding": rope}
    theta, factor = _rope(rope["hybrid"], "rope_parameters.hybrid")
    sliding = rope.get("hybrid_sliding")
    sliding_theta, sliding_factor = (
        _rope(sliding, "rope_parameters.hybrid_sliding") if sliding else (10_000.0, factor)
    )
    layer_types = d.get("layer_types")
    if layer_types and "hybrid_sliding" in layer_types and sliding_factor != factor:
        raise ValueError("config.json: different partial_rotary_factor per layer type is not supported")
    if layer_types and all(t == "hybrid" for t in layer_types):
        layer_types = None
    return ZayaConfig(
        **{
            **fields,
            "rope_theta": theta,
            "sliding_rope_theta": sliding_theta,
            "partial_rotary_factor": factor,
            "layer_types": tuple(layer_types) if layer_types else None,
            **overrides,
        }
    )


def to_native(cfg: ZayaConfig, torch_dtype: str) -> dict[str, Any]:
    """ZayaConfig -> the config.json transformers writes for ZayaForCausalLM."""
    rope = lambda theta: {
        "rope_type": "default",
        "rope_theta": theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }
    d = {k: getattr(cfg, k) for k in SHARED_FIELDS}
    d.update(
        architectures=["ZayaForCausalLM"],
        model_type="zaya",
        dtype=torch_dtype,
        layer_types=list(cfg.resolved_layer_types),
        attention_dropout=0.0,
        use_cache=True,
        output_router_logits=False,
        transformers_version=TRANSFORMERS_VERSION,
        rope_parameters={"hybrid": rope(cfg.rope_theta), "hybrid_sliding": rope(cfg.sliding_rope_theta)},
    )
    return d


def from_legacy(d: dict[str, Any], shapes: dict[str, tuple[int, ...]], **overrides) -> ZayaConfig:
    """A legacy ZAYA1-base config.json + tensor shapes -> ZayaConfig.

    The legacy config's per-half-layer lists and `num_hidden_layers` are unreliable (docs/model.md §3.2), so
    every size that the tensors determine is read off their shapes; the config supplies only what no
    tensor carries: eps, RoPE, head_dim (hidden / num_attention_heads there) and token ids.
    """

    def shape(name):
        if name not in shapes:
            raise ValueError(f"legacy checkpoint: tensor {name!r} is missing")
        return shapes[name]

    vocab, hidden = shape("model.embed_tokens.weight")
    head_dim = d.get("kv_channels") or d.get("head_dim") or hidden // d["num_attention_heads"]
    q_out = shape("model.layers.0.self_attn.qkv.linear_q.weight")[0]
    k_out = shape("model.layers.0.self_attn.qkv.linear_k.weight")[0]
    half_layers = {int(m.group(1)) for n in shapes if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    experts = {
        int(m.group(1))
        for n in shapes
        if (m := re.match(r"model\.layers\.1\.zaya_block\.experts\.local_experts\.(\d+)\.", n))
    }
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=(max(half_layers) + 1) // 2,
        num_attention_heads=q_out // head_dim,
        num_key_value_heads=k_out // head_dim,
        head_dim=head_dim,
        cca_time0=shape("model.layers.0.self_attn.qkv.conv_qk.0.weight")[2],
        cca_time1=shape("model.layers.0.self_attn.qkv.conv_qk.1.weight")[2],
        num_experts=len(experts),
        moe_intermediate_size=shape("model.layers.1.zaya_block.experts.local_experts.0.linear_fc2.weight")[1],
        router_hidden_size=shape("model.layers.1.zaya_block.router.down_proj.weight")[0],
        rms_norm_eps=float(d.get("norm_epsilon", d.get("rms_norm_eps", 1e-5))),
        rope_theta=float(d.get("rope_theta", 10_000.0)),
        partial_rotary_factor=float(d.get("partial_rotary_factor", 0.5)),
        tie_word_embeddings=True,
        max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
        pad_token_id=d.get("pad_token_id", 0),
        bos_token_id=d.get("bos_token_id", 2),
        eos_token_id=d.get("eos_token_id", 106),
        skip_expert_output="weighted_input",
    )
    return ZayaConfig(**{**fields, **overrides})
