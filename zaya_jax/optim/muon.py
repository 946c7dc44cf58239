"""Muon: momentum orthogonalised by a quintic Newton–Schulz iteration.

Tensor axes and the differences from the reference Muon: docs/design/optimizer.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# The XLA Newton-Schulz lives with its Pallas kernel (kernels never import optim); re-exported here
# as this module's public names.
from zaya_jax.kernels.newton_schulz import DEFAULT_NS_COEFFS, orthogonalize, validate_ns_coeffs
from zaya_jax.params import param_path

__all__ = [
    "DEFAULT_NS_COEFFS",
    "MuonState",
    "muon",
    "orthogonalize",
    "scale_by_muon",
    "scale_by_shape",
    "shape_scale",
]

DTypeLike = Any
# placement(path, x, ns) -> ns(x), computed where the placement puts it (scale_by_muon).
Placement = Callable[[str, jax.Array, Callable[[jax.Array], jax.Array]], jax.Array]


def _check_matrices(tree: Any, who: str) -> None:
    """Raises ValueError naming every leaf with ndim < 2 (Muon needs matrices)."""
    bad = [
        f"{jax.tree_util.keystr(path)} shape={tuple(x.shape)}"
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if jnp.ndim(x) < 2
    ]
    if bad:
        raise ValueError(
            f"{who}: Muon only handles parameters with ndim >= 2 (matrix = last two "
            f"axes, leading axes = batch); route these to AdamW instead: {bad}"
        )


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon`.

    count: int32 scalar, number of updates applied so far.
    mu: momentum buffer, same tree/shapes as the params, dtype ``mu_dtype``.
    """

    count: jax.Array
    mu: optax.Updates


def _look_ahead(mu, grads, t: jax.Array, beta: float, nesterov: bool, bias_correction: bool):
    """What Newton-Schulz orthogonalises at step t (fp32): the Nesterov mix of the new momentum `mu`
    and the gradient, or `mu` itself, bias-corrected as optax does."""
    if nesterov:
        if bias_correction:
            # Matches optax: m_t / (1 - beta^{t+1}) and g_t / (1 - beta^t).
            m_scale = 1.0 / (1.0 - beta ** (t + 1.0))
            g_scale = 1.0 / (1.0 - beta**t)
        else:
            m_scale = g_scale = 1.0
        return jax.tree.map(
            lambda m, g: beta * m_scale * m + (1 - beta) * g_scale * g.astype(jnp.float32), mu, grads
        )
    # A global rescale of m would be undone by NS's normalisation except for eps; applied anyway
    # so bias_correction means the same thing here.
    m_scale = 1.0 / (1.0 - beta**t) if bias_correction else 1.0
    return jax.tree.map(lambda m: m_scale * m, mu)


def scale_by_muon(
    beta: float = 0.95,
    *,
    nesterov: bool = True,
    bias_correction: bool = True,
    ns_coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    ns_dtype: DTypeLike = jnp.float32,
    eps: float = 1e-8,
    mu_dtype: DTypeLike = jnp.float32,
    orthogonalize_fn: Callable[..., jax.Array] | None = None,
    placement: Placement | None = None,
) -> optax.GradientTransformation:
    """Momentum followed by per-matrix Newton–Schulz orthogonalisation.

    ``orthogonalize_fn`` (same signature as :func:`orthogonalize`, the XLA default from
    ``zaya_jax.kernels.newton_schulz``) lets the Pallas kernel ``newton_schulz`` take its place.
    ``placement(path, x, ns)`` decides where ``ns(x)`` of the parameter at ``path`` runs (on a mesh:
    each matrix on the rank that owns it, zaya_jax/parallel/zero1.py ``owned_orthogonalize``);
    None: wherever XLA puts it. Either way each matrix gets the same result.

    Every leaf must have ndim >= 2 (``[..., fan_in, fan_out]``); see module doc.
    Output updates have the leaves' shapes and the gradients' dtypes.

    Args:
      beta: momentum decay, ``m <- beta m + (1 - beta) g``.
      nesterov: orthogonalise the Nesterov look-ahead instead of ``m``.
      bias_correction: Adam-style bias correction of the Nesterov mix, as optax
        does. Without Nesterov it is a pure rescale and NS's normalisation
        removes it, so it only matters when ``nesterov=True``.
      ns_coeffs, ns_steps, ns_dtype, eps: see :func:`orthogonalize`.
      mu_dtype: dtype of the momentum buffer.
    """
    ns_coeffs = validate_ns_coeffs(ns_coeffs)
    mu_dtype = jnp.dtype(mu_dtype)
    orthogonalize_fn = orthogonalize_fn or orthogonalize
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")

    def init_fn(params):
        _check_matrices(params, "scale_by_muon")
        mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update_fn(updates, state, params=None):
        del params
        _check_matrices(updates, "scale_by_muon")
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        # Accumulate in fp32 whatever mu_dtype / grad dtype is, so a bf16 buffer
        # only loses precision once per step (on the store), not in the mix.
        mu = jax.tree.map(
            lambda m, g: beta * m.astype(jnp.float32) + (1 - beta) * g.astype(jnp.float32),
            state.mu,
            updates,
        )
        look_ahead = _look_ahead(mu, updates, t, beta, nesterov, bias_correction)
        ns = lambda u: orthogonalize_fn(u, ns_coeffs=ns_coeffs, ns_steps=ns_steps, ns_dtype=ns_dtype, eps=eps)

        def one(key_path, u, g):
            out = ns(u) if placement is None else placement(param_path(key_path), u, ns)
            return out.astype(g.dtype)

        new_updates = jax.tree_util.tree_map_with_path(one, look_ahead, updates)
        mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return new_updates, MuonState(count=count, mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def shape_scale(shape: Sequence[int], consistent_rms: float | None) -> float:
    """Scalar multiplier for an orthogonalised ``[..., fan_in, fan_out]`` update.

    ``consistent_rms`` set: ``consistent_rms * sqrt(max(fan_in, fan_out))``. An
    orthogonal [m, n] matrix has RMS ``1/sqrt(max(m, n))``, so the result has RMS
    ``consistent_rms`` for every shape (0.2 ~ AdamW's typical update RMS, Liu et
    al. 2025, "Muon is Scalable for LLM Training").
    ``None``: reference Muon width scaling ``sqrt(max(1, fan_out / fan_in))``.
    """
    fan_in, fan_out = shape[-2], shape[-1]
    if consistent_rms is not None:
        return consistent_rms * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_shape(consistent_rms: float | None = 0.2) -> optax.GradientTransformation:
    """Stateless per-leaf rescale by :func:`shape_scale` (leaves ``[..., in, out]``)."""

    def update_fn(updates, state, params=None):
        del params
        _check_matrices(updates, "scale_by_shape")
        updates = jax.tree.map(lambda u: (u * shape_scale(u.shape, consistent_rms)).astype(u.dtype), updates)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    bias_correction: bool = True,
    ns_coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    ns_dtype: DTypeLike = jnp.float32,
    eps: float = 1e-8,
    mu_dtype: DTypeLike = jnp.float32,
    consistent_rms: float | None = 0.2,
    weight_decay: float = 0.0,
    weight_decay_mask: Any | Callable[[optax.Params], Any] | None = None,
    orthogonalize_fn: Callable[..., jax.Array] | None = None,
    placement: Placement | None = None,
) -> optax.GradientTransformation:
    """Full Muon optimizer for a tree of ``[..., fan_in, fan_out]`` parameters.

    Update per matrix: ``-lr * (scale * NS(momentum) + weight_decay * param)``.
    Every leaf must have ndim >= 2 (ValueError otherwise); route vectors, norms,
    embeddings etc. to AdamW with :mod:`zaya_jax.optim.chain`.

    Equivalent to ``optax.contrib.muon`` on its Muon branch when called with the
    same ``beta, nesterov, ns_coeffs, ns_steps, eps, weight_decay,
    consistent_rms`` and ``bias_correction=True``, ``ns_dtype=float32``.

    Args:
      learning_rate: scalar or optax schedule.
      weight_decay: decoupled decay coefficient (multiplied by ``lr``).
      weight_decay_mask: optional bool tree / callable as in
        ``optax.add_decayed_weights``; ``True`` leaves are decayed.
      others: see :func:`scale_by_muon` and :func:`shape_scale`.
    """
    return optax.chain(
        scale_by_muon(
            beta,
            nesterov=nesterov,
            bias_correction=bias_correction,
            ns_coeffs=ns_coeffs,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            eps=eps,
            mu_dtype=mu_dtype,
            orthogonalize_fn=orthogonalize_fn,
            placement=placement,
        ),
        scale_by_shape(consistent_rms),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
