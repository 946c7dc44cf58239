"""Parameter counts of a ZAYA1 config: total / embedding / active (analytic), and the model's
actual parameter leaves with their optimizer (from the parameter registry, zaya_jax/params.py)."""

from __future__ import annotations

import dataclasses

import jax

from zaya_jax.model.config import ZayaConfig
from zaya_jax.params import optimizer_rule, param_path


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the (tied) embedding table
    active: int  # per token, without embedding: one routed expert per block

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


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
    top = (
        embedding + head + 3 * d + (cfg.vocab_size if cfg.lm_head_bias else 0)
    )  # + final norm, input scale/bias
    n = cfg.num_hidden_layers
    total = top + n * (per_block_shared + e * expert)
    # Block 0 has no EDA scale in the released model; we keep one (it multiplies zeros).
    total -= r
    active = n * (per_block_shared + expert) - r
    return ParamCounts(total=total, embedding=embedding, active=active)


def param_leaves(cfg: ZayaConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """[(path, shape, optimizer label "muon"|"adamw"), ...] of the model's params (no allocation);
    ValueError for a parameter of ndim >= 2 that the registry does not list."""
    from zaya_jax.model import init_variables  # the model is only needed here

    shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0)))["params"]
    return [
        (path, tuple(x.shape), optimizer_rule(path, len(x.shape)).label)
        for kp, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
        for path in [param_path(kp)]
    ]
