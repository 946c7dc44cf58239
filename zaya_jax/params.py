"""The parameter registry: every variable of `ZayaForCausalLM`, listed once.

For each variable path (under its collection, "params" or "balancing") one `Param` says

  axes       its logical axes, one per dimension (None: small, replicated on every device); the
             rules from logical to mesh axes are in zaya_jax/parallel/sharding.py
  optimizer  the `Rule` routing it to Muon or AdamW, with the reason (None: not trained by the
             optimizer chain, e.g. the balancing biases, which their own controller moves)
  hf         its tensor name in a transformers `ZayaForCausalLM` checkpoint (docs/model.md §3;
             "{k}" = block index), `layout` the named transform between the two layouts and `when`
             the condition under which the checkpoint has it (both resolved in zaya_jax/hf/names.py)
  legacy     its name in the legacy ZAYA1-base checkpoint (None: absent there); placeholders {attn}
             / {moe} = the half-layers 2k / 2k+1 of block k, {after_moe} = the half-layer after
             them ("model.layers.{2k+2}." or "model." after the last block), {e} = expert index

Sharding (zaya_jax.parallel.sharding), the optimizer chain (zaya_jax.optim.chain), the HF mapping
(zaya_jax.hf.names) and sizing (zaya_jax.sizing) all read this table. A parameter of two or more
dimensions that is not in it is an error in every one of them (`lookup`), so a new parameter can
never be silently replicated, sent to the wrong optimizer or left out of a checkpoint. Scalars and
vectors not in it are replicated and go to AdamW without decay: they can never be orthogonalised.

Block parameters live under `layers/` with a leading l axis (the blocks are one nn.scan, docs/model.md
§2); expert weights add an e axis. Every vector the HF mapping needs is listed too: a checkpoint
would silently lack an unlisted one, so zaya_jax.hf rejects any unlisted variable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

MUON = "muon"
ADAMW = "adamw"


@dataclasses.dataclass(frozen=True)
class Rule:
    """The optimizer of a parameter: ``label`` MUON | ADAMW, whether its decoupled weight decay
    applies, and why."""

    label: str
    weight_decay: bool
    why: str


EMBEDDING = Rule(
    ADAMW,
    True,
    "token embedding [v, d]: a lookup table whose rows receive sparse, token-frequency-skewed "
    "gradients; orthogonalising it would couple unrelated tokens. Embeddings stay on AdamW in the "
    "reference Muon.",
)
LM_HEAD = Rule(
    ADAMW,
    True,
    "untied output head [v, d]: a classifier over the vocabulary whose per-logit scale matters; "
    "kept on AdamW as in the reference Muon.",
)
CONV = Rule(
    ADAMW,
    True,
    "CCA causal conv filters ([l, t0, C] depthwise, [l, t1, h, C] grouped): the last two axes are "
    "(time/head-dim, channel) filter taps, not an (in, out) linear map, so Newton-Schulz on them "
    "has no meaning. This is why routing is by path and not by ndim.",
)
ROUTER_HEAD = Rule(
    ADAMW,
    True,
    "router output layer [l, r, e+1]: a tiny classifier head over the experts (+1 skip). With "
    "fan_out e+1 << r an orthogonalised update has all e+1 singular values equal, overriding the "
    "learned per-expert logit scale that load balancing depends on; like an lm head it gets "
    "AdamW's per-entry adaptivity.",
)
ATTENTION_MATRIX = Rule(
    MUON,
    True,
    "attention projections [l, in, out]: hidden linear maps, Muon's target; l is a batch axis "
    "(one orthogonalisation per layer).",
)
ROUTER_MATRIX = Rule(
    MUON,
    True,
    "router down-projection [l, d, r] and router MLP hidden layers [l, r, r]: hidden linear maps.",
)
EXPERT_MATRIX = Rule(
    MUON,
    True,
    "expert weights [l, e, d, 2f] / [l, e, f, d]: l and e are batch axes, each expert's matrix is "
    "orthogonalised on its own (gate|up halves of the fused gate_up_proj together, as one [d, 2f] "
    "map).",
)
VECTOR = Rule(
    ADAMW,
    False,
    "biases, norm scales, residual / hidden-state scales and biases, router state scale, CCA "
    "per-head temperature ([d] or scanned [l, d]): per-channel vectors; ndim cannot tell [l, d] "
    "from a matrix. No weight decay: it would pull gains towards 0.",
)
SMALL_UNLISTED = Rule(
    ADAMW,
    False,
    "safety: scalars and vectors can never be orthogonalised, whatever their path.",
)


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # under the collection root, e.g. "layers/self_attn/q_proj/kernel"
    axes: tuple[str, ...] | None  # logical axes; None = replicated (small)
    optimizer: Rule | None
    hf: str
    layout: str = "identity"  # "identity" | "linear" | "depthwise_conv" | "grouped_conv"
    when: str = "always"  # "always" | "attention_bias" | "after_first_block" | "untied" | "lm_head_bias"
    legacy: str | None = None
    collection: str = "params"

    @property
    def full_path(self) -> str:
        return f"{self.collection}/{self.path}"


_QKV = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")
_LEGACY_QKV = dict(zip(_QKV, ("linear_q", "linear_k", "val_proj1", "val_proj2")))
_RES_SCALES = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")
_ROUTER_MLP = ("fc1", "fc2")
_LEGACY_ROUTER_MLP = {"fc1": "0", "fc2": "2", "out_proj": "4"}
_BLOCK = "model.layers.{k}."
_ATTN = "model.layers.{attn}."
_ROUTER = "model.layers.{moe}.zaya_block.router."

# Checkpoint order of the transformers model: top-level tensors, then each block's.
PARAMS: tuple[Param, ...] = (
    Param("embed_tokens/embedding", ("vocab", "embed"), EMBEDDING, "model.embed_tokens.weight",
          legacy="model.embed_tokens.weight"),
    Param("input_hidden_states_scale", None, VECTOR, "model.input_hidden_states_scale",
          legacy="model.layers.0.res_scale.hidden_states_scale"),
    Param("input_hidden_states_bias", None, VECTOR, "model.input_hidden_states_bias",
          legacy="model.layers.0.res_scale.hidden_states_bias"),
    Param("norm/scale", None, VECTOR, "model.norm.weight", legacy="model.final_norm.weight"),
    Param("lm_head/kernel", ("vocab", "embed"), LM_HEAD, "lm_head.weight", when="untied"),
    Param("lm_head/bias", None, VECTOR, "lm_head.bias", when="lm_head_bias"),
    # ---- blocks
    Param("layers/input_layernorm/scale", None, VECTOR, _BLOCK + "input_layernorm.weight",
          legacy=_ATTN + "input_norm.weight"),
    Param("layers/post_attention_layernorm/scale", None, VECTOR, _BLOCK + "post_attention_layernorm.weight",
          legacy="model.layers.{moe}.input_norm.weight"),
    *(
        Param(f"layers/self_attn/{n}/kernel", ("layers", "embed", "heads"), ATTENTION_MATRIX,
              _BLOCK + f"self_attn.qkv_proj.{n}.weight", "linear",
              legacy=_ATTN + f"self_attn.qkv.{_LEGACY_QKV[n]}.weight")
        for n in _QKV
    ),
    *(
        Param(f"layers/self_attn/{n}/bias", None, VECTOR, _BLOCK + f"self_attn.qkv_proj.{n}.bias",
              when="attention_bias")
        for n in _QKV
    ),
    Param("layers/self_attn/conv_qk_depthwise/kernel", None, CONV,
          _BLOCK + "self_attn.qkv_proj.conv_qk_depthwise.weight", "depthwise_conv",
          legacy=_ATTN + "self_attn.qkv.conv_qk.0.weight"),
    Param("layers/self_attn/conv_qk_depthwise/bias", None, VECTOR,
          _BLOCK + "self_attn.qkv_proj.conv_qk_depthwise.bias", legacy=_ATTN + "self_attn.qkv.conv_qk.0.bias"),
    Param("layers/self_attn/conv_qk_grouped/kernel", None, CONV,
          _BLOCK + "self_attn.qkv_proj.conv_qk_grouped.weight", "grouped_conv",
          legacy=_ATTN + "self_attn.qkv.conv_qk.1.weight"),
    Param("layers/self_attn/conv_qk_grouped/bias", None, VECTOR,
          _BLOCK + "self_attn.qkv_proj.conv_qk_grouped.bias", legacy=_ATTN + "self_attn.qkv.conv_qk.1.bias"),
    Param("layers/self_attn/temp", None, VECTOR, _BLOCK + "self_attn.qk_norm.temp",
          legacy=_ATTN + "self_attn.qkv.temp"),
    Param("layers/self_attn/o_proj/kernel", ("layers", "heads", "embed"), ATTENTION_MATRIX,
          _BLOCK + "self_attn.o_proj.weight", "linear", legacy=_ATTN + "self_attn.o_proj.weight"),
    Param("layers/self_attn/o_proj/bias", None, VECTOR, _BLOCK + "self_attn.o_proj.bias", when="attention_bias"),
    Param("layers/mlp/gate/down_proj/kernel", ("layers", "embed", "router"), ROUTER_MATRIX,
          _BLOCK + "mlp.gate.down_proj.weight", "linear", legacy=_ROUTER + "down_proj.weight"),
    Param("layers/mlp/gate/down_proj/bias", None, VECTOR, _BLOCK + "mlp.gate.down_proj.bias",
          legacy=_ROUTER + "down_proj.bias"),
    # Block 0 has no EDA input in transformers, so no scale (ours exists but multiplies zeros).
    Param("layers/mlp/gate/router_states_scale", None, VECTOR, _BLOCK + "mlp.gate.router_states_scale",
          when="after_first_block", legacy=_ROUTER + "router_states_scale"),
    Param("layers/mlp/gate/router_mlp/norm/scale", None, VECTOR, _BLOCK + "mlp.gate.router_mlp.norm.weight",
          legacy=_ROUTER + "rmsnorm_eda.weight"),
    *(
        p
        for n in _ROUTER_MLP
        for p in (
            Param(f"layers/mlp/gate/router_mlp/{n}/kernel", None, ROUTER_MATRIX,
                  _BLOCK + f"mlp.gate.router_mlp.{n}.weight", "linear",
                  legacy=_ROUTER + f"router_mlp.{_LEGACY_ROUTER_MLP[n]}.weight"),
            Param(f"layers/mlp/gate/router_mlp/{n}/bias", None, VECTOR, _BLOCK + f"mlp.gate.router_mlp.{n}.bias",
                  legacy=_ROUTER + f"router_mlp.{_LEGACY_ROUTER_MLP[n]}.bias"),
        )
    ),
    Param("layers/mlp/gate/router_mlp/out_proj/kernel", None, ROUTER_HEAD,
          _BLOCK + "mlp.gate.router_mlp.out_proj.weight", "linear", legacy=_ROUTER + "router_mlp.4.weight"),
    Param("layers/mlp/gate/balancing_biases", None, None, _BLOCK + "mlp.gate.balancing_biases",
          legacy=_ROUTER + "balancing_biases", collection="balancing"),
    Param("layers/mlp/experts/gate_up_proj", ("layers", "expert", "embed", "mlp"), EXPERT_MATRIX,
          _BLOCK + "mlp.experts.gate_up_proj", "linear",
          legacy="model.layers.{moe}.zaya_block.experts.local_experts.{e}.linear_fc1.weight"),
    Param("layers/mlp/experts/down_proj", ("layers", "expert", "mlp", "embed"), EXPERT_MATRIX,
          _BLOCK + "mlp.experts.down_proj", "linear",
          legacy="model.layers.{moe}.zaya_block.experts.local_experts.{e}.linear_fc2.weight"),
    # Legacy: half-layer 2k+1's res_scale is block k's post-attention scaling, the next
    # half-layer's (the final model.res_scale after the last block) its post-MoE scaling.
    *(
        Param(f"layers/{r}_residual_scale/{n}", None, VECTOR, _BLOCK + f"{r}_residual_scale.{n}",
              legacy=(f"model.layers.{{moe}}.res_scale.{n}" if r == "post_attention"
                      else f"{{after_moe}}res_scale.{n}"))
        for r in ("post_attention", "post_mlp")
        for n in _RES_SCALES
    ),
)  # fmt: skip

_BY_PATH: dict[tuple[str, str], Param] = {(p.collection, p.path): p for p in PARAMS}


def is_listed(path: str, collection: str = "params") -> bool:
    return (collection, path) in _BY_PATH


def lookup(path: str, ndim: int, collection: str = "params") -> Param | None:
    """The registry entry of the variable at `path` (under `collection`); None for an unlisted
    scalar or vector; ValueError for an unlisted array of two or more dimensions."""
    param = _BY_PATH.get((collection, path))
    if param is None and ndim >= 2:
        raise ValueError(
            f"parameter {path!r} (ndim={ndim}) is not in the parameter registry; add it to "
            "zaya_jax.params.PARAMS with its logical axes, its optimizer (Muon or AdamW, and why) "
            "and its Hugging Face name."
        )
    if param is not None and param.axes is not None and len(param.axes) != ndim:
        raise ValueError(f"parameter registry: {path} has {ndim} dims, the registry says {param.axes}")
    return param


def optimizer_rule(path: str, ndim: int) -> Rule:
    """The optimizer rule of a trained parameter (under "params"); ValueError if the registry does
    not list it and ndim >= 2."""
    if ndim < 2:  # whatever the path: a vector can never be orthogonalised
        return SMALL_UNLISTED
    return lookup(path, ndim).optimizer


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_path(key_path: tuple[Any, ...]) -> str:
    """'/'-joined path of a leaf, e.g. ``layers/self_attn/q_proj/kernel``.

    Drops a leading ``params`` (flax linen variable collection) and a trailing ``.value`` (flax
    nnx Variable) so both layouts give the same path.
    """
    parts = [_key_str(k) for k in key_path]
    if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    if parts and parts[0] == "params":
        parts = parts[1:]
    return "/".join(parts)
