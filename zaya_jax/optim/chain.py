"""The training optimizer: global-norm clipping, then Muon or AdamW per parameter.

    make_optimizer(cfg, total_steps, platform) = chain(
        clip_by_global_norm(optim.clip_grad_norm),        # identity if 0/None; grad_norm= extra arg
        multi_transform({"muon": muon(...), "adamw": adamw(...)}, param_labels))

Which optimizer a parameter gets is decided by its entry in the parameter registry
(:mod:`zaya_jax.params`, each with its reason; :data:`ROUTING_RULES` is that table
by path), not by ndim: scanned layers give every per-layer vector a leading ``l``
axis (norm scales are ``[l, d]``) and the CCA conv kernels are 3-D/4-D, so
"ndim >= 2 -> Muon" would be wrong both ways. A parameter of ndim >= 2 that the
registry does not list raises ValueError, so a new parameter can never silently
land on the wrong optimizer.
``describe_routing(params)`` lists ``(path, shape, label)`` for inspection.

Config fields: ``default_optim_config()`` (``cfg`` may be the training config with an ``optim``
field or the optim ConfigDict itself); every key and its meaning: docs/reference/config.md.
``total_steps`` is an argument of :func:`make_optimizer`, not a config field.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from zaya_jax import kernels
from zaya_jax.optim.muon import DEFAULT_NS_COEFFS, muon, orthogonalize
from zaya_jax.optim.schedules import make_schedule
from zaya_jax.params import ADAMW, MUON, PARAMS, Rule, optimizer_rule, param_path

__all__ = [
    "ADAMW",
    "MUON",
    "ROUTING_RULES",
    "Rule",
    "adamw",
    "clip_by_global_norm",
    "default_optim_config",
    "describe_routing",
    "gradient_clipping",
    "lr_schedule",
    "make_optimizer",
    "match_rule",
    "param_labels",
    "param_path",
    "weight_decay_mask",
]

# Re-exported: the routing lives in the parameter registry, next to each parameter's sharding
# and HF name.
ROUTING_RULES: dict[str, Rule] = {p.path: p.optimizer for p in PARAMS if p.optimizer is not None}


def match_rule(path: str, ndim: int) -> Rule:
    """The rule deciding a leaf's optimizer; ValueError if the registry does not list a leaf of
    ndim >= 2."""
    return optimizer_rule(path, ndim)


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
    cfg.muon.ns_impl = "xla"  # "xla" | "pallas" (kernels.newton_schulz) | "auto" (kernels.NS_AUTO_PALLAS)
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


def _orthogonalize_fn(ns_impl: str, platform: str | None):
    """Muon's Newton-Schulz by ``optim.muon.ns_impl`` for devices of ``platform`` (None: the
    default device's, where a mesh-less step runs): the Pallas kernel, or the XLA `orthogonalize`
    iterating slice by slice where kernels.NS_PER_SLICE says so (CPU), as one batched chain elsewhere."""
    if ns_impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"optim.muon.ns_impl={ns_impl!r}; expected 'xla', 'pallas' or 'auto'")
    from zaya_jax.parallel.mesh import mesh_platform

    platform = platform or mesh_platform(None)
    choice = kernels.ns_choice(ns_impl, platform)
    if choice == "pallas":
        return functools.partial(kernels.newton_schulz, **kernels.kernel_options(platform))
    return functools.partial(orthogonalize, per_slice=choice == "xla per slice")


def owned_placement(mesh: Mesh, zero1: bool = True, sharded_params: bool = False):
    """Muon's placement on `mesh`: each matrix orthogonalised by the rank that owns it, the results
    all-gathered like the parameters (zaya_jax/parallel/zero1.py `owned_orthogonalize`); the
    momentum laid out by ZeRO-1 (`zero1`, as state_shardings lays it out) or like its parameter.
    `sharded_params`: the parameters are the fp32 master in the ZeRO-1 shard (`zero1.shards_master`),
    and the results stay in that shard."""
    from zaya_jax.parallel.sharding import spec_for, zero1_param_spec
    from zaya_jax.parallel.zero1 import owned_orthogonalize

    def place(path, x, ns):
        shape = tuple(x.shape)
        spec = spec_for(path, shape, mesh)
        stored = zero1_param_spec(path, shape, mesh) if zero1 else spec
        return owned_orthogonalize(ns, x, stored, stored if sharded_params else spec, mesh)

    return place


def _scaled(schedule: optax.Schedule, multiplier: float) -> optax.Schedule:
    multiplier = float(multiplier)
    return lambda step: multiplier * schedule(step)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` (the same formula, bit for bit) that takes the norm as the
    extra argument ``grad_norm`` when the caller already has it: the train step computes the
    global norm for its metrics and NaN check, so the clip need not read every gradient again.
    Without ``grad_norm`` it computes the norm itself, as optax does."""

    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        g_norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        trigger = g_norm < max_norm
        clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def gradient_clipping(cfg: Any) -> optax.GradientTransformation:
    """The chain's first transform: `clip_by_global_norm(optim.clip_grad_norm)`, or identity when it
    is 0 / None. Identity (not omission) keeps the state tree's shape, so checkpoints restore
    whether or not clipping is on."""
    clip = _optim_section(cfg).clip_grad_norm
    if clip is not None and clip < 0:
        raise ValueError(f"optim.clip_grad_norm must be >= 0 or None, got {clip}")
    return clip_by_global_norm(float(clip)) if clip else optax.identity()


def adamw(cfg: Any, schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW with `optim.adamw`'s settings on `schedule` x its lr_multiplier, decoupled weight
    decay where the registry says so (`weight_decay_mask`). Both moments are fp32 whatever the
    parameters' dtype (optax keeps them in it)."""
    ac = _optim_section(cfg).adamw
    inner = optax.adamw(
        _scaled(schedule, ac.lr_multiplier),
        b1=ac.b1,
        b2=ac.b2,
        eps=ac.eps,
        weight_decay=ac.weight_decay,
        mu_dtype=jnp.float32,
        mask=weight_decay_mask,
    )
    # optax makes the second moment like the parameters it is given: fp32 copies (a no-op for fp32)
    fp32 = lambda params: jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return optax.GradientTransformation(lambda params: inner.init(fp32(params)), inner.update)


def make_optimizer(
    cfg: Any,
    total_steps: int,
    platform: str | None = None,
    mesh: Mesh | None = None,
    zero1: bool = True,
    sharded_params: bool = False,
) -> optax.GradientTransformation:
    """Build the optimizer described in the module docstring.

    Args:
      cfg: training config with an ``optim`` field, or the optim config itself.
      total_steps: number of optimizer steps the schedule spans.
      platform: of the devices the update is compiled for ("cpu" / "cuda" / "rocm", the mesh's:
        zaya_jax.parallel.mesh.mesh_platform); decides ``ns_impl="auto"`` and the kernel's
        Triton-vs-interpret. None: the default device's.
      mesh: the mesh the update runs on: Muon's Newton-Schulz runs each matrix on the rank that
        owns it (distributed Muon, zaya_jax/parallel/zero1.py). None: wherever XLA puts it (the
        same updates).
      zero1: whether the optimizer state is laid out by ZeRO-1 on `mesh` (mesh.zero1).
      sharded_params: whether the parameters are the fp32 master in the ZeRO-1 shard
        (zaya_jax/parallel/zero1.py `shards_master`): Muon's results are not gathered then.
    """
    oc = _optim_section(cfg)
    schedule = lr_schedule(oc, total_steps)
    mc = oc.muon
    consistent_rms = mc.consistent_rms
    placement = None if mesh is None or mesh.size == 1 else owned_placement(mesh, zero1, sharded_params)
    return optax.chain(
        gradient_clipping(oc),
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
                    orthogonalize_fn=_orthogonalize_fn(getattr(mc, "ns_impl", "xla"), platform),
                    placement=placement,
                ),
                ADAMW: adamw(oc, schedule),
            },
            param_labels,
        ),
    )
