"""Declarative map between our variables and Hugging Face tensor names (SPEC §3).

One `TensorMap` per HF tensor: its name, our variable path, the index into our stacked leading
axes ([L] for blocks, [L, E] for legacy per-expert tensors) and a named layout transform. Both the
native `transformers` layout and the legacy ZAYA1-base layout are tables here; `hf/__init__.py`
only walks them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from zaya_jax.model.config import ZayaConfig


@dataclasses.dataclass(frozen=True)
class Transform:
    """A layout change: `to_hf(ours) -> hf` and its inverse `from_hf(hf) -> ours`."""

    name: str
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]


IDENTITY = Transform("identity", lambda a: a, lambda a: a)
# torch Linear weights are [out, in]; flax kernels [in, out]. Also per-expert [E, out, in] tensors.
LINEAR = Transform("linear", lambda a: np.swapaxes(a, -1, -2), lambda a: np.swapaxes(a, -1, -2))
# Depthwise Conv1d weight [C, 1, t0] <-> ours [t0, C].
DEPTHWISE_CONV = Transform("depthwise_conv", lambda a: a.T[:, None, :], lambda a: a[:, 0, :].T)
# Grouped Conv1d weight [C_out, h_in, t1] <-> ours [t1, h_in, C_out].
GROUPED_CONV = Transform("grouped_conv", lambda a: a.transpose(2, 1, 0), lambda a: a.transpose(2, 1, 0))


@dataclasses.dataclass(frozen=True)
class TensorMap:
    hf: str
    path: tuple[str, ...]  # e.g. ("params", "layers", "self_attn", "q_proj", "kernel")
    index: tuple[int, ...]  # into our leading (stacked) axes; () for unstacked tensors
    transform: Transform


def _p(path: str) -> tuple[str, ...]:
    return tuple(path.split("/"))


# (HF suffix under model.layers.{k}., our path under params/layers/ or balancing/layers/, transform,
#  condition on (cfg, block index)).
_always = lambda cfg, k: True
_attn_bias = lambda cfg, k: cfg.attention_bias
NATIVE_BLOCK = [
    ("input_layernorm.weight", "params/layers/input_layernorm/scale", IDENTITY, _always),
    ("post_attention_layernorm.weight", "params/layers/post_attention_layernorm/scale", IDENTITY, _always),
    *[
        (f"self_attn.qkv_proj.{n}.weight", f"params/layers/self_attn/{n}/kernel", LINEAR, _always)
        for n in ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")
    ],
    *[
        (f"self_attn.qkv_proj.{n}.bias", f"params/layers/self_attn/{n}/bias", IDENTITY, _attn_bias)
        for n in ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")
    ],
    (
        "self_attn.qkv_proj.conv_qk_depthwise.weight",
        "params/layers/self_attn/conv_qk_depthwise/kernel",
        DEPTHWISE_CONV,
        _always,
    ),
    (
        "self_attn.qkv_proj.conv_qk_depthwise.bias",
        "params/layers/self_attn/conv_qk_depthwise/bias",
        IDENTITY,
        _always,
    ),
    (
        "self_attn.qkv_proj.conv_qk_grouped.weight",
        "params/layers/self_attn/conv_qk_grouped/kernel",
        GROUPED_CONV,
        _always,
    ),
    (
        "self_attn.qkv_proj.conv_qk_grouped.bias",
        "params/layers/self_attn/conv_qk_grouped/bias",
        IDENTITY,
        _always,
    ),
    ("self_attn.qk_norm.temp", "params/layers/self_attn/temp", IDENTITY, _always),
    ("self_attn.o_proj.weight", "params/layers/self_attn/o_proj/kernel", LINEAR, _always),
    ("self_attn.o_proj.bias", "params/layers/self_attn/o_proj/bias", IDENTITY, _attn_bias),
    ("mlp.gate.down_proj.weight", "params/layers/mlp/gate/down_proj/kernel", LINEAR, _always),
    ("mlp.gate.down_proj.bias", "params/layers/mlp/gate/down_proj/bias", IDENTITY, _always),
    # Block 0 has no EDA input in transformers, so no scale (ours exists but multiplies zeros).
    (
        "mlp.gate.router_states_scale",
        "params/layers/mlp/gate/router_states_scale",
        IDENTITY,
        lambda cfg, k: k > 0,
    ),
    ("mlp.gate.router_mlp.norm.weight", "params/layers/mlp/gate/router_mlp/norm/scale", IDENTITY, _always),
    ("mlp.gate.router_mlp.fc1.weight", "params/layers/mlp/gate/router_mlp/fc1/kernel", LINEAR, _always),
    ("mlp.gate.router_mlp.fc1.bias", "params/layers/mlp/gate/router_mlp/fc1/bias", IDENTITY, _always),
    ("mlp.gate.router_mlp.fc2.weight", "params/layers/mlp/gate/router_mlp/fc2/kernel", LINEAR, _always),
    ("mlp.gate.router_mlp.fc2.bias", "params/layers/mlp/gate/router_mlp/fc2/bias", IDENTITY, _always),
    (
        "mlp.gate.router_mlp.out_proj.weight",
        "params/layers/mlp/gate/router_mlp/out_proj/kernel",
        LINEAR,
        _always,
    ),
    ("mlp.gate.balancing_biases", "balancing/layers/mlp/gate/balancing_biases", IDENTITY, _always),
    ("mlp.experts.gate_up_proj", "params/layers/mlp/experts/gate_up_proj", LINEAR, _always),
    ("mlp.experts.down_proj", "params/layers/mlp/experts/down_proj", LINEAR, _always),
    *[
        (f"{r}_residual_scale.{n}", f"params/layers/{r}_residual_scale/{n}", IDENTITY, _always)
        for r in ("post_attention", "post_mlp")
        for n in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")
    ],
]

NATIVE_TOP = [
    ("model.embed_tokens.weight", "params/embed_tokens/embedding", lambda cfg: True),
    ("model.input_hidden_states_scale", "params/input_hidden_states_scale", lambda cfg: True),
    ("model.input_hidden_states_bias", "params/input_hidden_states_bias", lambda cfg: True),
    ("model.norm.weight", "params/norm/scale", lambda cfg: True),
    ("lm_head.weight", "params/lm_head/kernel", lambda cfg: not cfg.tie_word_embeddings),
    ("lm_head.bias", "params/lm_head/bias", lambda cfg: cfg.lm_head_bias),
]


def native_map(cfg: ZayaConfig) -> list[TensorMap]:
    """Every tensor of a transformers `ZayaForCausalLM` checkpoint for `cfg`, in checkpoint order."""
    out = [TensorMap(hf, _p(path), (), IDENTITY) for hf, path, cond in NATIVE_TOP if cond(cfg)]
    for k in range(cfg.num_hidden_layers):
        out += [
            TensorMap(f"model.layers.{k}.{hf}", _p(path), (k,), t)
            for hf, path, t, cond in NATIVE_BLOCK
            if cond(cfg, k)
        ]
    return out


# Legacy ZAYA1-base layout: 2L half-layers, attention at even i = 2k, MoE at odd i = 2k + 1.
LEGACY_ATTN = [
    ("self_attn.qkv.linear_q.weight", "params/layers/self_attn/q_proj/kernel", LINEAR),
    ("self_attn.qkv.linear_k.weight", "params/layers/self_attn/k_proj/kernel", LINEAR),
    ("self_attn.qkv.val_proj1.weight", "params/layers/self_attn/v_proj_current/kernel", LINEAR),
    ("self_attn.qkv.val_proj2.weight", "params/layers/self_attn/v_proj_delayed/kernel", LINEAR),
    ("self_attn.qkv.conv_qk.0.weight", "params/layers/self_attn/conv_qk_depthwise/kernel", DEPTHWISE_CONV),
    ("self_attn.qkv.conv_qk.0.bias", "params/layers/self_attn/conv_qk_depthwise/bias", IDENTITY),
    ("self_attn.qkv.conv_qk.1.weight", "params/layers/self_attn/conv_qk_grouped/kernel", GROUPED_CONV),
    ("self_attn.qkv.conv_qk.1.bias", "params/layers/self_attn/conv_qk_grouped/bias", IDENTITY),
    ("self_attn.qkv.temp", "params/layers/self_attn/temp", IDENTITY),
    ("self_attn.o_proj.weight", "params/layers/self_attn/o_proj/kernel", LINEAR),
    ("input_norm.weight", "params/layers/input_layernorm/scale", IDENTITY),
]
LEGACY_MOE = [
    ("input_norm.weight", "params/layers/post_attention_layernorm/scale", IDENTITY),
    ("zaya_block.router.down_proj.weight", "params/layers/mlp/gate/down_proj/kernel", LINEAR),
    ("zaya_block.router.down_proj.bias", "params/layers/mlp/gate/down_proj/bias", IDENTITY),
    ("zaya_block.router.rmsnorm_eda.weight", "params/layers/mlp/gate/router_mlp/norm/scale", IDENTITY),
    ("zaya_block.router.router_mlp.0.weight", "params/layers/mlp/gate/router_mlp/fc1/kernel", LINEAR),
    ("zaya_block.router.router_mlp.0.bias", "params/layers/mlp/gate/router_mlp/fc1/bias", IDENTITY),
    ("zaya_block.router.router_mlp.2.weight", "params/layers/mlp/gate/router_mlp/fc2/kernel", LINEAR),
    ("zaya_block.router.router_mlp.2.bias", "params/layers/mlp/gate/router_mlp/fc2/bias", IDENTITY),
    ("zaya_block.router.router_mlp.4.weight", "params/layers/mlp/gate/router_mlp/out_proj/kernel", LINEAR),
    ("zaya_block.router.balancing_biases", "balancing/layers/mlp/gate/balancing_biases", IDENTITY),
]
RES_SCALE_NAMES = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")


def legacy_map(cfg: ZayaConfig) -> list[TensorMap]:
    """Every tensor of a legacy ZAYA1-base checkpoint (SPEC §3, 'legacy names in full')."""
    num_layers = cfg.num_hidden_layers
    out = [
        TensorMap("model.embed_tokens.weight", _p("params/embed_tokens/embedding"), (), IDENTITY),
        TensorMap("model.final_norm.weight", _p("params/norm/scale"), (), IDENTITY),
    ]
    # Half-layer 0's res_scale scales the embedding; half-layer 2k+1's is block k's post-attention
    # scaling and half-layer 2k+2's (the final model.res_scale after the last) its post-MoE scaling.
    for n in ("hidden_states_scale", "hidden_states_bias"):
        out.append(TensorMap(f"model.layers.0.res_scale.{n}", _p(f"params/input_{n}"), (), IDENTITY))
    for k in range(num_layers):
        a, m = 2 * k, 2 * k + 1
        out += [TensorMap(f"model.layers.{a}.{hf}", _p(path), (k,), t) for hf, path, t in LEGACY_ATTN]
        out += [TensorMap(f"model.layers.{m}.{hf}", _p(path), (k,), t) for hf, path, t in LEGACY_MOE]
        if k > 0:
            out.append(
                TensorMap(
                    f"model.layers.{m}.zaya_block.router.router_states_scale",
                    _p("params/layers/mlp/gate/router_states_scale"),
                    (k,),
                    IDENTITY,
                )
            )
        for e in range(cfg.num_experts):
            prefix = f"model.layers.{m}.zaya_block.experts.local_experts.{e}"
            out.append(
                TensorMap(
                    f"{prefix}.linear_fc1.weight",
                    _p("params/layers/mlp/experts/gate_up_proj"),
                    (k, e),
                    LINEAR,
                )
            )
            out.append(
                TensorMap(
                    f"{prefix}.linear_fc2.weight", _p("params/layers/mlp/experts/down_proj"), (k, e), LINEAR
                )
            )
        post_mlp = f"model.layers.{m + 1}.res_scale" if k + 1 < num_layers else "model.res_scale"
        for n in RES_SCALE_NAMES:
            out.append(
                TensorMap(
                    f"model.layers.{m}.res_scale.{n}",
                    _p(f"params/layers/post_attention_residual_scale/{n}"),
                    (k,),
                    IDENTITY,
                )
            )
            out.append(
                TensorMap(f"{post_mlp}.{n}", _p(f"params/layers/post_mlp_residual_scale/{n}"), (k,), IDENTITY)
            )
    return out


def is_legacy(names) -> bool:
    """A legacy checkpoint is recognised by names only it has."""
    return any(".zaya_block." in n or n == "model.final_norm.weight" for n in names)
