"""Optimizers for ZAYA1 training: our Muon, LR schedules and the Muon/AdamW chain.

* :mod:`zaya_jax.optim.muon`      — Muon (Nesterov momentum + Newton–Schulz).
* :mod:`zaya_jax.optim.schedules` — warmup-stable-decay / warmup-cosine schedules.
* :mod:`zaya_jax.optim.chain`     — per-parameter routing and ``make_optimizer``.
"""

from zaya_jax.optim.chain import (
    ROUTING_RULES,
    Rule,
    default_optim_config,
    describe_routing,
    lr_schedule,
    make_optimizer,
    param_labels,
    weight_decay_mask,
)
from zaya_jax.optim.muon import (
    DEFAULT_NS_COEFFS,
    MuonState,
    muon,
    orthogonalize,
    scale_by_muon,
    scale_by_shape,
)
from zaya_jax.optim.schedules import (
    make_schedule,
    warmup_constant,
    warmup_cosine,
    warmup_stable_decay,
)

__all__ = [
    "DEFAULT_NS_COEFFS",
    "ROUTING_RULES",
    "MuonState",
    "Rule",
    "default_optim_config",
    "describe_routing",
    "lr_schedule",
    "make_optimizer",
    "make_schedule",
    "muon",
    "orthogonalize",
    "param_labels",
    "scale_by_muon",
    "scale_by_shape",
    "warmup_constant",
    "warmup_cosine",
    "warmup_stable_decay",
    "weight_decay_mask",
]
