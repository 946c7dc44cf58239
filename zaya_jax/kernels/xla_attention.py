"""The XLA attention core of CCA (the model's path, and the reference the Pallas kernel is tested
against): causal grouped-query softmax attention over a boolean mask.

Inputs are the post-QK-norm, post-RoPE queries and keys:
  q [B, S, N, H], k and v [B, T, K, H], N = K * G  ->  out [B, S, N, H].
Query head n reads kv head n // G (transformers' `repeat_kv` order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A finite "minus infinity": a fully masked row (a padding query) then averages the values instead
# of producing NaN, and NaN can never leak into valid rows through the backward pass.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def attention_allowed(
    q_pos_bs: jax.Array,
    kv_pos_bt: jax.Array,
    *,
    key_mask_bt: jax.Array | None = None,
    q_segment_bs: jax.Array | None = None,
    kv_segment_bt: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
) -> jax.Array:
    """Which (query, key) pairs may attend: bool [B, Sq, Sk].

    Causal on positions (key position <= query position); keys with key_mask == 0 are hidden; with
    segment ids only pairs in the same segment (packed documents); with a window w > 0 only keys with
    position > query position - w (transformers' sliding-window convention; w <= 0 means no window).
    """
    allowed = kv_pos_bt[:, None, :] <= q_pos_bs[:, :, None]
    if key_mask_bt is not None:
        allowed &= key_mask_bt[:, None, :].astype(bool)
    if q_segment_bs is not None:
        allowed &= q_segment_bs[:, :, None] == kv_segment_bt[:, None, :]
    if sliding_window is not None:
        w = jnp.asarray(sliding_window)
        allowed &= (w <= 0) | (kv_pos_bt[:, None, :] > q_pos_bs[:, :, None] - w)
    return allowed


def xla_attention(
    q_bsnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, allowed_bst: jax.Array, scale: float
) -> jax.Array:
    """Softmax attention with fp32 logits and softmax; returns [B, Sq, Nq, hd] in q's dtype.

    Laid out for XLA:CPU: each kv head's G query heads are stacked as rows, m = g*s, so both
    products are plain batched matmuls with the batch dims (b, k) leading, the logits [b, k, m, t]
    are already in the layout the second dot reads, and the softmax runs over the contiguous last
    axis. Only q, k, v and the output (h wide) are transposed, never the [.., s, t] tensors; the
    mask is a broadcast XLA fuses into the softmax. (The other layout, logits [b, k, g, s, t] from
    q [b, s, k, g, h], made XLA copy the logits around both dots and the softmax: slower on
    CPU, docs/performance.md.) The core's gradient is written by hand (`_core_bwd`): it keeps q, k, v, the [b, s, t] mask
    and the probabilities for the backward, where autodiff of the softmax kept four to five
    [b, k, m, t] fp32 tensors a layer (docs/model.md §2.1.7).
    """
    b, s, nq, hd = q_bsnh.shape
    nkv = k_btkh.shape[2]
    g = nq // nkv
    q_bkmh = q_bsnh.reshape(b, s, nkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * s, hd)
    k_bkth, v_bkth = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)
    out = _core(q_bkmh, k_bkth, v_bkth, allowed_bst, scale)
    out = out.reshape(b, nkv, g, s, hd).transpose(0, 3, 1, 2, 4).reshape(b, s, nq, hd)
    return out.astype(q_bsnh.dtype)


def _allowed_bkmt(allowed_bst: jax.Array, q_bkmh: jax.Array) -> jax.Array:
    """The [b, s, t] mask broadcast over the k and g heads of the stacked rows m = g*s."""
    b, nkv, m, _ = q_bkmh.shape
    s, t = allowed_bst.shape[1:]
    return jnp.broadcast_to(allowed_bst[:, None, None], (b, nkv, m // s, s, t)).reshape(b, nkv, m, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(q_bkmh, k_bkth, v_bkth, allowed_bst, scale):
    """softmax(q k^T * scale, masked) v: [b, k, m, h] in fp32."""
    return _core_fwd(q_bkmh, k_bkth, v_bkth, allowed_bst, scale)[0]


def _core_fwd(q_bkmh, k_bkth, v_bkth, allowed_bst, scale):
    logits = jnp.einsum("bkmh,bkth->bkmt", q_bkmh, k_bkth, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(_allowed_bkmt(allowed_bst, q_bkmh), logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    p_v = probs.astype(v_bkth.dtype)
    out = jnp.einsum("bkmt,bkth->bkmh", p_v, v_bkth, preferred_element_type=jnp.float32)
    return out, (q_bkmh, k_bkth, v_bkth, allowed_bst, probs)


def _core_bwd(scale, residuals, dout_bkmh):
    """softmax's backward from the kept probabilities, p * (dp - sum(p * dp)), zero where masked."""
    q_bkmh, k_bkth, v_bkth, allowed_bst, probs = residuals
    allowed_bkmt = _allowed_bkmt(allowed_bst, q_bkmh)
    do = dout_bkmh.astype(v_bkth.dtype)
    dv = contract_rows(do, probs.astype(v_bkth.dtype))
    dp = jnp.einsum("bkmh,bkth->bkmt", do, v_bkth, preferred_element_type=jnp.float32)
    ds = probs * (dp - jnp.sum(probs * dp, axis=-1, keepdims=True))
    ds = (jnp.where(allowed_bkmt, ds, 0.0) * scale).astype(q_bkmh.dtype)
    dq = jnp.einsum("bkmt,bkth->bkmh", ds, k_bkth, preferred_element_type=jnp.float32)
    dk = contract_rows(q_bkmh, ds)
    return dq.astype(q_bkmh.dtype), dk.astype(k_bkth.dtype), dv.astype(v_bkth.dtype), None


_core.defvjp(_core_fwd, _core_bwd)


def contract_rows(x_bkmh: jax.Array, y_bkmt: jax.Array) -> jax.Array:
    """sum over m of y[.., m, t] x[.., m, h] -> [b, k, t, h] fp32: the backward's dk and dv.

    Written with the [m, h] operand first (a [b, k, h, t] product, then swapped): XLA:CPU runs
    that faster than "bkmt,bkmh->bkth" at h = 32 and no slower at h = 64 (docs/performance.md,
    "Choices inside the code")."""
    return jnp.einsum("bkmh,bkmt->bkht", x_bkmh, y_bkmt, preferred_element_type=jnp.float32).swapaxes(-1, -2)
