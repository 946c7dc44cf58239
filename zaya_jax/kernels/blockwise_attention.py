"""Blockwise (flash-style) attention in plain JAX/XLA: the semantics of `xla_attention` +
`attention_allowed` without ever holding an [S, T] matrix.

  q [B, S, N, H], k and v [B, T, K, H], N = K * G  ->  out [B, S, N, H]; query head n reads kv
  head n // G. Masks from per-token inputs: positions of queries and keys (causal on positions),
  a key padding mask, packed-document segment ids, a sliding window (attention_allowed's).

The schedule, masking and layout: docs/design/kernels.md.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.kernels.block_sizes import pick_blocks
from zaya_jax.kernels.xla_attention import MASK_VALUE, attention_allowed, contract_rows


class Masks(NamedTuple):
    """The per-token mask inputs, padded to whole blocks: [B, S] for queries, [B, T] for keys;
    `window` a scalar int32 (<= 0: none)."""

    q_pos: jax.Array
    q_seg: jax.Array
    kv_pos: jax.Array
    kv_seg: jax.Array
    key_mask: jax.Array
    window: jax.Array


def blockwise_attention(
    q_bsnh: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    *,
    q_pos_bs: jax.Array,
    kv_pos_bt: jax.Array,
    key_mask_bt: jax.Array | None = None,
    q_segment_bs: jax.Array | None = None,
    kv_segment_bt: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """`xla_attention(q, k, v, attention_allowed(q_pos, kv_pos, ...), scale)` computed blockwise
    (module docstring); returns [B, S, N, H] in q's dtype. Blocks default to `pick_blocks`'s
    "blockwise_attention" entry; S and T need not be multiples of them (padded here)."""
    q, k, v, masks, bq, bk = _padded(
        q_bsnh,
        k_btkh,
        v_btkh,
        q_pos_bs,
        kv_pos_bt,
        key_mask_bt,
        q_segment_bs,
        kv_segment_bt,
        sliding_window,
        block_q,
        block_k,
    )
    out = _attention(q, k, v, masks, float(scale), bq, bk, k_btkh.shape[1])
    return out[:, : q_bsnh.shape[1]]


def visited_blocks(q_bsnh, k_btkh, v_btkh, **kwargs) -> jax.Array:
    """The number of (query block, key block) pairs the forward computes for these inputs (the
    arguments of `blockwise_attention`), counted by its loop: what the mask lets it skip."""
    scale = kwargs.pop("scale")
    block_q, block_k = kwargs.pop("block_q", None), kwargs.pop("block_k", None)
    names = ("q_pos_bs", "kv_pos_bt", "key_mask_bt", "q_segment_bs", "kv_segment_bt", "sliding_window")
    q, k, v, masks, bq, bk = _padded(
        q_bsnh, k_btkh, v_btkh, *(kwargs.get(n) for n in names), block_q, block_k
    )
    return _forward(q, k, v, masks, float(scale), bq, bk, k_btkh.shape[1])[2]


def _padded(q, k, v, q_pos, kv_pos, key_mask, q_seg, kv_seg, window, block_q, block_k):
    """Fills the optional masks (no padding, one segment, no window) and pads S and T to whole
    blocks: padded keys are masked out, padded queries (edge positions, so they widen no block's
    key range) are sliced off the output."""
    b, s, _, _ = q.shape
    t = k.shape[1]
    blocks = pick_blocks("blockwise_attention", {"seq_q": s, "seq_k": t}, q.dtype)
    bq, bk = block_q or blocks["block_q"], block_k or blocks["block_k"]
    sp, tp = -(-s // bq) * bq, -(-t // bk) * bk
    if key_mask is None:
        key_mask = jnp.ones((b, t), bool)
    if q_seg is None or kv_seg is None:
        q_seg, kv_seg = jnp.zeros((b, s), jnp.int32), jnp.zeros((b, t), jnp.int32)
    pad_rows = lambda x, n, mode="edge": jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode=mode)
    pad_tokens = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
    masks = Masks(
        q_pos=pad_rows(jnp.asarray(q_pos, jnp.int32), sp),
        q_seg=pad_rows(jnp.asarray(q_seg, jnp.int32), sp),
        kv_pos=pad_rows(jnp.asarray(kv_pos, jnp.int32), tp),
        kv_seg=pad_rows(jnp.asarray(kv_seg, jnp.int32), tp),
        key_mask=pad_rows(jnp.asarray(key_mask).astype(bool), tp, "constant"),
        window=jnp.asarray(0 if window is None else window, jnp.int32),
    )
    return pad_tokens(q, sp), pad_tokens(k, tp), pad_tokens(v, tp), masks, bq, bk


def _query_blocks(x_bsnh: jax.Array, nkv: int, bq: int) -> jax.Array:
    """[B, S, N, H] -> [S/bq, B, K, G*bq, H]: query blocks leading (the scan axis), rows m = g*bq + s."""
    b, s, n, h = x_bsnh.shape
    g = n // nkv
    x = x_bsnh.reshape(b, s // bq, bq, nkv, g, h).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(s // bq, b, nkv, g * bq, h)


def _unblock(x_ibkmh: jax.Array, g: int) -> jax.Array:
    """The inverse of `_query_blocks`: [S/bq, B, K, G*bq, H] -> [B, S, N, H]."""
    nqb, b, nkv, m, h = x_ibkmh.shape
    x = x_ibkmh.reshape(nqb, b, nkv, g, m // g, h).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(b, nqb * (m // g), nkv * g, h)


def _needed_blocks(masks: Masks, bq: int, bk: int) -> jax.Array:
    """bool [S/bq, T/bk]: may query block i hold an allowed pair with key block j? Bounds over the
    whole block and batch, so False only where every pair is masked (causal, window, padding or
    segments), for any positions."""

    def bounds(x, block):  # [B, n*block] -> per-block min and max [n]
        x = x.reshape(x.shape[0], -1, block)
        return x.min(axis=(0, 2)), x.max(axis=(0, 2))

    q_lo, q_hi = bounds(masks.q_pos, bq)
    k_lo, k_hi = bounds(masks.kv_pos, bk)
    qs_lo, qs_hi = bounds(masks.q_seg, bq)
    ks_lo, ks_hi = bounds(masks.kv_seg, bk)
    some_key = masks.key_mask.reshape(masks.key_mask.shape[0], -1, bk).any(axis=(0, 2))
    w = masks.window
    need = k_lo[None] <= q_hi[:, None]  # causal: some key at or before some query
    need &= (w <= 0) | (k_hi[None] > q_lo[:, None] - w)  # window: some key inside it
    need &= (ks_lo[None] <= qs_hi[:, None]) & (ks_hi[None] >= qs_lo[:, None])  # segments overlap
    return need & some_key[None]


def _next_block(need_j: jax.Array, j: jax.Array) -> jax.Array:
    """The first needed key block after j (the number of blocks if none): the loop visits exactly
    the needed blocks, holes (a padded or other-document block between two needed ones) included."""
    idx = jnp.arange(need_j.shape[0])
    return jnp.min(jnp.where(need_j & (idx > j), idx, need_j.shape[0]))


def _block_allowed(masks: Masks, i, j, bq: int, bk: int, nkv: int, g: int) -> jax.Array:
    """bool [B, K, G*bq, bk] of query block i x key block j (rows in `_query_blocks` order)."""
    qs = lambda x: jax.lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1)
    ks = lambda x: jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)
    allowed_bst = attention_allowed(
        qs(masks.q_pos),
        ks(masks.kv_pos),
        key_mask_bt=ks(masks.key_mask),
        q_segment_bs=qs(masks.q_seg),
        kv_segment_bt=ks(masks.kv_seg),
        sliding_window=masks.window,
    )
    b = allowed_bst.shape[0]
    return jnp.broadcast_to(allowed_bst[:, None, None], (b, nkv, g, bq, bk)).reshape(b, nkv, g * bq, bk)


def _key_block(x_bkth: jax.Array, j, bk: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x_bkth, j * bk, bk, axis=2)


def _add_block(acc_bkth: jax.Array, x_bkth: jax.Array, j, bk: int) -> jax.Array:
    """acc[:, :, key block j] += x, in place in the loop's buffer."""
    return jax.lax.dynamic_update_slice_in_dim(acc_bkth, _key_block(acc_bkth, j, bk) + x_bkth, j * bk, axis=2)


def _forward(q_bsnh, k_btkh, v_btkh, masks: Masks, scale: float, bq: int, bk: int, t: int):
    """(out [B, S, N, H] in q's dtype, log-sum-exp [S/bq, B, K, G*bq] fp32 (+inf on fully masked
    rows), the number of key blocks visited)."""
    nkv = k_btkh.shape[2]
    g = q_bsnh.shape[2] // nkv
    k_bkth, v_bkth = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)
    need_ij = _needed_blocks(masks, bq, bk)
    nkb = need_ij.shape[1]
    # what a fully masked row reads: the mean of the real (unpadded) values
    v_mean_bkh = v_bkth[:, :, :t].astype(jnp.float32).mean(axis=2)

    def query_block(visits, xs):
        q_bkmh, i = xs
        rows = q_bkmh.shape[:3]

        def key_block(carry):
            j, n, m_bkm, l_bkm, acc_bkmh = carry
            logits = jnp.einsum(
                "bkmh,bkth->bkmt", q_bkmh, _key_block(k_bkth, j, bk), preferred_element_type=jnp.float32
            )
            allowed = _block_allowed(masks, i, j, bq, bk, nkv, g)
            logits = jnp.where(allowed, logits * scale, -jnp.inf)
            m_new = jnp.maximum(m_bkm, logits.max(axis=-1))  # >= MASK_VALUE: finite, no inf - inf
            p_bkmt = jnp.exp(logits - m_new[..., None])
            corr = jnp.exp(m_bkm - m_new)
            pv = jnp.einsum(
                "bkmt,bkth->bkmh",
                p_bkmt.astype(v_bkth.dtype),
                _key_block(v_bkth, j, bk),
                preferred_element_type=jnp.float32,
            )
            l_new = l_bkm * corr + p_bkmt.sum(axis=-1)
            return _next_block(need_ij[i], j), n + 1, m_new, l_new, acc_bkmh * corr[..., None] + pv

        init = (
            _next_block(need_ij[i], -1),
            visits,
            jnp.full(rows, MASK_VALUE, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros(q_bkmh.shape, jnp.float32),
        )
        _, visits, m_bkm, l_bkm, acc_bkmh = jax.lax.while_loop(lambda c: c[0] < nkb, key_block, init)
        empty = l_bkm == 0  # no allowed key in the whole row
        l_bkm = jnp.where(empty, 1.0, l_bkm)
        out = jnp.where(empty[..., None], v_mean_bkh[:, :, None], acc_bkmh / l_bkm[..., None])
        lse = jnp.where(empty, jnp.inf, m_bkm + jnp.log(l_bkm))
        return visits, (out.astype(q_bkmh.dtype), lse)

    q_ibkmh = _query_blocks(q_bsnh, nkv, bq)
    visits, (out_ibkmh, lse_ibkm) = jax.lax.scan(
        query_block, jnp.zeros((), jnp.int32), (q_ibkmh, jnp.arange(q_ibkmh.shape[0]))
    )
    return _unblock(out_ibkmh, g), lse_ibkm, visits


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q_bsnh, k_btkh, v_btkh, masks: Masks, scale: float, bq: int, bk: int, t: int):
    return _forward(q_bsnh, k_btkh, v_btkh, masks, scale, bq, bk, t)[0]


def _attention_fwd(q_bsnh, k_btkh, v_btkh, masks, scale, bq, bk, t):
    out, lse, _ = _forward(q_bsnh, k_btkh, v_btkh, masks, scale, bq, bk, t)
    return out, (q_bsnh, k_btkh, v_btkh, masks, out, lse)


def _attention_bwd(scale, bq, bk, t, res, do_bsnh):
    """Per query block, the visited key blocks again: p = exp(logits - lse) recomputed, dq summed
    in the inner loop, dk / dv accumulated into whole-length fp32 buffers."""
    q_bsnh, k_btkh, v_btkh, masks, out_bsnh, lse_ibkm = res
    nkv = k_btkh.shape[2]
    g = q_bsnh.shape[2] // nkv
    k_bkth, v_bkth = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)
    need_ij = _needed_blocks(masks, bq, bk)
    nkb = need_ij.shape[1]
    do_ibkmh = _query_blocks(do_bsnh.astype(q_bsnh.dtype), nkv, bq)
    out_ibkmh = _query_blocks(out_bsnh, nkv, bq).astype(jnp.float32)
    delta_ibkm = jnp.einsum("ibkmh,ibkmh->ibkm", do_ibkmh.astype(jnp.float32), out_ibkmh)

    def query_block(dkv, xs):
        q_bkmh, do_bkmh, lse_bkm, delta_bkm, i = xs

        def key_block(carry):
            j, dq_bkmh, (dk_bkth, dv_bkth) = carry
            k_blk, v_blk = _key_block(k_bkth, j, bk), _key_block(v_bkth, j, bk)
            logits = jnp.einsum("bkmh,bkth->bkmt", q_bkmh, k_blk, preferred_element_type=jnp.float32)
            allowed = _block_allowed(masks, i, j, bq, bk, nkv, g)
            p_bkmt = jnp.where(allowed, jnp.exp(logits * scale - lse_bkm[..., None]), 0.0)
            dp_bkmt = jnp.einsum("bkmh,bkth->bkmt", do_bkmh, v_blk, preferred_element_type=jnp.float32)
            ds_bkmt = p_bkmt * (dp_bkmt - delta_bkm[..., None]) * scale
            dq_bkmh = dq_bkmh + jnp.einsum(
                "bkmt,bkth->bkmh", ds_bkmt.astype(k_blk.dtype), k_blk, preferred_element_type=jnp.float32
            )
            dk_blk = contract_rows(q_bkmh, ds_bkmt.astype(q_bkmh.dtype))
            dv_blk = contract_rows(do_bkmh, p_bkmt.astype(do_bkmh.dtype))
            dk_bkth, dv_bkth = _add_block(dk_bkth, dk_blk, j, bk), _add_block(dv_bkth, dv_blk, j, bk)
            return _next_block(need_ij[i], j), dq_bkmh, (dk_bkth, dv_bkth)

        init = (_next_block(need_ij[i], -1), jnp.zeros(q_bkmh.shape, jnp.float32), dkv)
        _, dq_bkmh, dkv = jax.lax.while_loop(lambda c: c[0] < nkb, key_block, init)
        return dkv, dq_bkmh

    zeros = jnp.zeros(k_bkth.shape, jnp.float32)
    xs = (_query_blocks(q_bsnh, nkv, bq), do_ibkmh, lse_ibkm, delta_ibkm, jnp.arange(lse_ibkm.shape[0]))
    (dk_bkth, dv_bkth), dq_ibkmh = jax.lax.scan(query_block, (zeros, zeros), xs)
    # A fully masked row's output is the mean of the t real values: each of them gets do / t.
    empty = jnp.isinf(lse_ibkm)[..., None]
    dv_mean_bkh = jnp.where(empty, do_ibkmh.astype(jnp.float32), 0.0).sum(axis=(0, 3)) / t
    dv_bkth = dv_bkth.at[:, :, :t].add(dv_mean_bkh[:, :, None])
    dq = _unblock(dq_ibkmh, g).astype(q_bsnh.dtype)
    dk = dk_bkth.transpose(0, 2, 1, 3).astype(k_btkh.dtype)
    dv = dv_bkth.transpose(0, 2, 1, 3).astype(v_btkh.dtype)
    return dq, dk, dv, jax.tree.map(lambda _: None, masks)


_attention.defvjp(_attention_fwd, _attention_bwd)
