"""Map between our variables and Hugging Face tensor names (docs/model.md §3).

One `TensorMap` per HF tensor: its name, our variable path, the index into our stacked leading
axes ([l] for blocks, [l, e] for legacy per-expert tensors) and a named layout transform. The
names, layouts and presence conditions of both the native `transformers` layout and the legacy
ZAYA1-base layout are read from the parameter registry (zaya_jax/params.py); this module expands
them per block and `hf/__init__.py` only walks the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from zaya_jax.model.config import ZayaConfig
from zaya_jax.params import PARAMS, Param, is_listed


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


# Layouts and presence conditions the registry names (zaya_jax/params.py: Param.layout, Param.when).
LAYOUTS = {t.name: t for t in (IDENTITY, LINEAR, DEPTHWISE_CONV, GROUPED_CONV)}
CONDITIONS: dict[str, Callable[[ZayaConfig, int], bool]] = {
    "always": lambda cfg, k: True,
    "attention_bias": lambda cfg, k: cfg.attention_bias,
    "after_first_block": lambda cfg, k: k > 0,
    "untied": lambda cfg, k: not cfg.tie_word_embeddings,
    "lm_head_bias": lambda cfg, k: cfg.lm_head_bias,
}


def _is_block(p: Param) -> bool:
    return p.path.startswith("layers/")


def _tensor(name: str, p: Param, index: tuple[int, ...]) -> TensorMap:
    return TensorMap(name, tuple(p.full_path.split("/")), index, LAYOUTS[p.layout])


def native_map(cfg: ZayaConfig) -> list[TensorMap]:
    """Every tensor of a transformers `ZayaForCausalLM` checkpoint for `cfg`, in checkpoint order."""
    out = [_tensor(p.hf, p, ()) for p in PARAMS if not _is_block(p) and CONDITIONS[p.when](cfg, -1)]
    for k in range(cfg.num_hidden_layers):
        out += [
            _tensor(p.hf.format(k=k), p, (k,)) for p in PARAMS if _is_block(p) and CONDITIONS[p.when](cfg, k)
        ]
    return out


def _legacy_names(p: Param, k: int, num_layers: int, num_experts: int) -> list[tuple[str, tuple[int, ...]]]:
    """(legacy name, index into our stacked axes) of block k's share of `p`. Legacy ZAYA1-base has
    2l half-layers: attention at 2k, MoE at 2k+1; per-expert tensors instead of stacked ones."""
    after_moe = f"model.layers.{2 * k + 2}." if k + 1 < num_layers else "model."
    name = p.legacy.replace("{after_moe}", after_moe).replace("{attn}", str(2 * k))
    name = name.replace("{moe}", str(2 * k + 1))
    if "{e}" in name:
        return [(name.replace("{e}", str(e)), (k, e)) for e in range(num_experts)]
    return [(name, (k,))]


def legacy_map(cfg: ZayaConfig) -> list[TensorMap]:
    """Every tensor of a legacy ZAYA1-base checkpoint (docs/model.md §3, 'legacy names in full')."""
    listed = [p for p in PARAMS if p.legacy is not None]
    out = [_tensor(p.legacy, p, ()) for p in listed if not _is_block(p) and CONDITIONS[p.when](cfg, -1)]
    for k in range(cfg.num_hidden_layers):
        for p in listed:
            if _is_block(p) and CONDITIONS[p.when](cfg, k):
                num_layers, num_experts = cfg.num_hidden_layers, cfg.num_experts
                out += [_tensor(n, p, i) for n, i in _legacy_names(p, k, num_layers, num_experts)]
    return out


def check_registered(flat: dict[tuple[str, ...], Any], who: str = "hf") -> None:
    """ValueError naming the first variable ({(collection, *path): array}) that the parameter
    registry does not list: it has no HF name, so a checkpoint would silently lack it."""
    for key in flat:
        if not is_listed("/".join(key[1:]), key[0]):
            raise ValueError(
                f"{who}: variable {'/'.join(key)} is not in the parameter registry (zaya_jax.params), "
                "so it has no Hugging Face name"
            )


def is_legacy(names) -> bool:
    """A legacy checkpoint is recognised by names only it has."""
    return any(".zaya_block." in n or n == "model.final_norm.weight" for n in names)
