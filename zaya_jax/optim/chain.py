"""The training optimizer: global-norm clipping, then Muon or AdamW per parameter.

    make_optimizer(cfg, total_steps) = chain(
        clip_by_global_norm(optim.clip_grad_norm),        # identity if 0/None
        multi_transform({"muon": muon(...), "adamw": adamw(...)}, param_labels))

Which optimizer a parameter gets is decided by :data:`ROUTING_RULES`, a table of
regexes over the '/'-joined parameter path (first match wins), not by ndim:
scanned layers give every per-layer vector a leading ``L`` axis (norm scales are
``[L, d]``) and the CCA conv kernels are 3-D/4-D, so "ndim >= 2 -> Muon" would be
wrong both ways. A parameter of ndim >= 2 that matches no rule raises ValueError,
so a new parameter can never silently land on the wrong optimizer.
``describe_routing(params)`` lists ``(path, shape, label)`` for inspection.

Config fields (``default_optim_config()``; ``cfg`` may be the training config
with an ``optim`` field or the optim ConfigDict itself)::

    optim.lr                 peak learning rate (both optimizers, times their lr_multiplier)
    optim.schedule           "wsd" | "cosine" | "constant"  (see zaya_jax.optim.schedules)
    optim.warmup_steps       linear warmup length in steps
    optim.decay_fraction     wsd: fraction of total_steps spent decaying
    optim.decay_steps        wsd: decay length in steps; overrides decay_fraction if not None
    optim.decay_shape        wsd: "linear" | "cosine" | "sqrt"
    optim.final_lr_fraction  wsd/cosine: lr at the last step = lr * final_lr_fraction
    optim.clip_grad_norm     max global grad norm (over ALL params); 0 or None disables
    optim.adamw.b1, .b2, .eps
    optim.adamw.weight_decay decoupled, times lr; only on params whose rule says decay
    optim.adamw.lr_multiplier
    optim.muon.beta          momentum (0.95)
    optim.muon.nesterov      Nesterov look-ahead (True)
    optim.muon.bias_correction  optax-style bias-corrected Nesterov mix (True)
    optim.muon.ns_steps      Newton–Schulz iterations (5)
    optim.muon.ns_coeffs     quintic NS coefficients (3.4445, -4.7750, 2.0315)
    optim.muon.ns_dtype      "float32" | "bfloat16": dtype NS runs in
    optim.muon.ns_impl       "xla" | "pallas" | "auto": who runs NS (auto = Pallas on GPU)
    optim.muon.mu_dtype      momentum buffer dtype ("float32")
    optim.muon.eps           added to the Frobenius norm before NS
    optim.muon.consistent_rms  0.2: update RMS matched to AdamW (lr/wd transfer);
                             None: reference Muon scaling sqrt(max(1, out/in))
    optim.muon.weight_decay  decoupled, times lr
    optim.muon.lr_multiplier

``total_steps`` is an argument of :func:`make_optimizer`, not a config field.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from zaya_jax.optim.muon import DEFAULT_NS_COEFFS, muon
from zaya_jax.optim.schedules import make_schedule

MUON = "muon"
ADAMW = "adamw"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One routing rule: ``pattern`` is re.fullmatch'ed against the param path."""

    pattern: str
    label: str  # MUON | ADAMW
    weight_decay: bool  # whether the chosen optimizer's decoupled decay applies
    why: str


_ATTN_PROJ = r"(q_proj|k_proj|v_proj_current|v_proj_delayed|o_proj)"

# First match wins. Paths are relative to the params root ("params/" stripped);
# per-layer params carry a leading scanned L axis, experts a further E axis.
ROUTING_RULES: tuple[Rule, ...] = (
    # ---- AdamW exceptions that LOOK like matrices --------------------------------
    Rule(
        r"embed_tokens/embedding",
        ADAMW,
        True,
        "token embedding [V, d]: a lookup table whose rows receive sparse, "
        "token-frequency-skewed gradients; orthogonalising it would couple unrelated "
        "tokens. Embeddings stay on AdamW in the reference Muon.",
    ),
    Rule(
        r"lm_head/kernel",
        ADAMW,
        True,
        "untied output head [d, V]: a classifier over the vocabulary whose per-logit "
        "scale matters; kept on AdamW as in the reference Muon.",
    ),
    Rule(
        r"layers/self_attn/conv_qk_(depthwise|grouped)/kernel",
        ADAMW,
        True,
        "CCA causal conv filters ([L, t0, C] depthwise, [L, t1, hd, C] grouped): the "
        "last two axes are (time/head-dim, channel) filter taps, not an (in, out) "
        "linear map, so Newton-Schulz on them has no meaning. This is why routing is "
        "by path and not by ndim.",
    ),
    Rule(
        r"layers/mlp/gate/router_mlp/out_proj/kernel",
        ADAMW,
        True,
        "router output layer [L, R, E+1]: a tiny classifier head over the experts "
        "(+1 skip). With fan_out E+1 << R an orthogonalised update has all E+1 "
        "singular values equal, overriding the learned per-expert logit scale that "
        "load balancing depends on; like an lm head it gets AdamW's per-entry "
        "adaptivity.",
    ),
    # ---- Muon: hidden linear maps [..., fan_in, fan_out] -----------------------------
    Rule(
        rf"layers/self_attn/{_ATTN_PROJ}/kernel",
        MUON,
        True,
        "attention projections [L, in, out]: hidden linear maps, Muon's target; L is "
        "a batch axis (one orthogonalisation per layer).",
    ),
    Rule(
        r"layers/mlp/gate/down_proj/kernel",
        MUON,
        True,
        "router down-projection [L, d, R]: hidden linear map.",
    ),
    Rule(
        r"layers/mlp/gate/router_mlp/(fc1|fc2)/kernel",
        MUON,
        True,
        "router MLP hidden layers [L, R, R]: hidden linear maps.",
    ),
    Rule(
        r"layers/mlp/experts/(gate_up_proj|down_proj)",
        MUON,
        True,
        "expert weights [L, E, d, 2I] / [L, E, I, d]: L and E are batch axes, each "
        "expert's matrix is orthogonalised on its own (gate|up halves of the fused "
        "gate_up_proj together, as one [d, 2I] map).",
    ),
    # ---- AdamW, no decay: vectors (possibly with a scanned L axis) -------------------
    Rule(
        r"(.*/)?[^/]*(bias|scale)",
        ADAMW,
        False,
        "biases, norm scales, residual / hidden-state scales and biases, router state "
        "scale ([d] or scanned [L, d]): per-channel vectors; ndim cannot tell [L, d] "
        "from a matrix. No weight decay: it would pull gains towards 0.",
    ),
    Rule(
        r"layers/self_attn/temp",
        ADAMW,
        False,
        "CCA per-KV-head temperature [L, nkv]: per-head scalars; no decay.",
    ),
)

_SAFETY_RULE = Rule(
    "<ndim < 2>",
    ADAMW,
    False,
    "safety: scalars and vectors can never be orthogonalised, whatever their path.",
)


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_path(key_path: tuple[Any, ...]) -> str:
    """'/'-joined path of a leaf, e.g. ``layers/self_attn/q_proj/kernel``.

    Drops a leading ``params`` (flax linen variable collection) and a trailing
    ``.value`` (flax nnx Variable) so both layouts give the same path.
    """
    parts = [_key_str(k) for k in key_path]
    if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    if parts and parts[0] == "params":
        parts = parts[1:]
    return "/".join(parts)


def match_rule(path: str, ndim: int) -> Rule:
    """The rule deciding a leaf's optimizer; ValueError if none matches."""
    if ndim < 2:
        return _SAFETY_RULE
    for rule in ROUTING_RULES:
        if re.fullmatch(rule.pattern, path):
            return rule
    raise ValueError(
        f"no optimizer routing rule matches parameter {path!r} (ndim={ndim}); add a "
        "rule to zaya_jax.optim.chain.ROUTING_RULES saying whether it is a Muon "
        "matrix or an AdamW parameter."
    )


def _map_rules(fn, params):
    return jax.tree_util.tree_map_with_path(lambda kp, x: fn(match_rule(param_path(kp), jnp.ndim(x))), params)


def param_labels(params: Any) -> Any:
    """Tree like ``params`` with ``"muon"`` or ``"adamw"`` at every leaf."""
    return _map_rules(lambda rule: rule.label, params)


def weight_decay_mask(params: Any) -> Any:
    """Tree like ``params`` with ``True`` where decoupled weight decay applies."""
    return _map_rules(lambda rule: rule.weight_decay, params)


def describe_routing(params: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``[(path, shape, label), ...]`` in tree order, for logging / tests."""
    return [
        (param_path(kp), tuple(jnp.shape(x)), match_rule(param_path(kp), jnp.ndim(x)).label)
        for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]
    ]


def default_optim_config() -> ml_collections.ConfigDict:
    """Default ``optim`` config; field meanings in the module docstring."""
    cfg = ml_collections.ConfigDict()
    cfg.lr = 1e-3
    cfg.schedule = "wsd"
    cfg.warmup_steps = 100
    cfg.decay_fraction = 0.2
    cfg.decay_steps = ml_collections.FieldReference(None, field_type=int)
    cfg.decay_shape = "linear"
    cfg.final_lr_fraction = 0.0
    cfg.clip_grad_norm = 1.0

    cfg.adamw = ml_collections.ConfigDict()
    cfg.adamw.b1 = 0.9
    cfg.adamw.b2 = 0.95
    cfg.adamw.eps = 1e-8
    cfg.adamw.weight_decay = 0.1
    cfg.adamw.lr_multiplier = 1.0

    cfg.muon = ml_collections.ConfigDict()
    cfg.muon.beta = 0.95
    cfg.muon.nesterov = True
    cfg.muon.bias_correction = True
    cfg.muon.ns_steps = 5
    cfg.muon.ns_coeffs = DEFAULT_NS_COEFFS
    cfg.muon.ns_dtype = "float32"
    cfg.muon.ns_impl = "xla"  # "xla" | "pallas" (zaya_jax.kernels.newton_schulz) | "auto" (pallas on GPU)
    cfg.muon.mu_dtype = "float32"
    cfg.muon.eps = 1e-8
    cfg.muon.consistent_rms = ml_collections.FieldReference(0.2, field_type=float)
    cfg.muon.weight_decay = 0.1
    cfg.muon.lr_multiplier = 1.0
    return cfg


def _optim_section(cfg: Any) -> Any:
    return cfg.optim if hasattr(cfg, "optim") else cfg


def lr_schedule(cfg: Any, total_steps: int) -> optax.Schedule:
    """The base (multiplier-free) LR schedule ``step -> lr`` of the config, e.g.
    for logging. ``cfg``: training config with ``optim`` or the optim config."""
    oc = _optim_section(cfg)
    kw: dict[str, Any] = dict(peak_lr=oc.lr, total_steps=total_steps, warmup_steps=oc.warmup_steps)
    if oc.schedule == "wsd":
        decay_steps = getattr(oc, "decay_steps", None)
        if decay_steps is not None:
            kw["decay_steps"] = decay_steps
        else:
            kw["decay_fraction"] = oc.decay_fraction
        kw.update(final_lr_fraction=oc.final_lr_fraction, decay_shape=oc.decay_shape)
    elif oc.schedule == "cosine":
        kw.update(final_lr_fraction=oc.final_lr_fraction)
    return make_schedule(oc.schedule, **kw)


def _orthogonalize_fn(ns_impl: str):
    """None (the XLA default) or the Pallas Newton-Schulz kernel, by ``optim.muon.ns_impl``."""
    if ns_impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"optim.muon.ns_impl={ns_impl!r}; expected 'xla', 'pallas' or 'auto'")
    from zaya_jax import kernels  # the kernels package is only needed when selected

    if not kernels.use_pallas(ns_impl):
        return None
    return functools.partial(kernels.newton_schulz, interpret=kernels.default_interpret())


def _scaled(schedule: optax.Schedule, multiplier: float) -> optax.Schedule:
    multiplier = float(multiplier)
    return lambda step: multiplier * schedule(step)


def make_optimizer(cfg: Any, total_steps: int) -> optax.GradientTransformation:
    """Build the optimizer described in the module docstring.

    Args:
      cfg: training config with an ``optim`` field, or the optim config itself.
      total_steps: number of optimizer steps the schedule spans.
    """
    oc = _optim_section(cfg)
    schedule = lr_schedule(oc, total_steps)
    mc, ac = oc.muon, oc.adamw

    clip = oc.clip_grad_norm
    if clip is not None and clip < 0:
        raise ValueError(f"optim.clip_grad_norm must be >= 0 or None, got {clip}")
    # identity (not omission) when disabled keeps the state tree shape stable, so
    # checkpoints restore whether or not clipping is on.
    clipper = optax.clip_by_global_norm(float(clip)) if clip else optax.identity()

    consistent_rms = mc.consistent_rms
    return optax.chain(
        clipper,
        optax.multi_transform(
            {
                MUON: muon(
                    _scaled(schedule, mc.lr_multiplier),
                    beta=mc.beta,
                    nesterov=mc.nesterov,
                    bias_correction=mc.bias_correction,
                    ns_coeffs=tuple(mc.ns_coeffs),
                    ns_steps=int(mc.ns_steps),
                    ns_dtype=jnp.dtype(mc.ns_dtype),
                    eps=mc.eps,
                    mu_dtype=jnp.dtype(mc.mu_dtype),
                    consistent_rms=None if consistent_rms is None else float(consistent_rms),
                    weight_decay=mc.weight_decay,
                    weight_decay_mask=weight_decay_mask,
                    orthogonalize_fn=_orthogonalize_fn(getattr(mc, "ns_impl", "xla")),
                ),
                ADAMW: optax.adamw(
                    _scaled(schedule, ac.lr_multiplier),
                    b1=ac.b1,
                    b2=ac.b2,
                    eps=ac.eps,
                    weight_decay=ac.weight_decay,
                    mask=weight_decay_mask,
                ),
            },
            param_labels,
        ),
    )
