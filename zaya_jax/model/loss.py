"""Next-token cross-entropy computed in sequence chunks, so [B, S, V] logits never exist at once.

ZAYA1's vocabulary is 262k: full fp32 logits for a 4 x 4096 microbatch would take 17 GB. The loss is
a fused linear cross-entropy: the forward pass computes each chunk's gradients with its loss (the
softmax minus the target's one-hot, through the head's vjp), so the backward pass only scales them by
the incoming cotangent. The logits are never recomputed: 3 head matmuls per chunk, memory bounded
by the chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Tokens per device in one loss chunk. Its fp32 logits take tokens x V x 4 bytes (4.3 GB at ZAYA1's
# 262k vocabulary), and every chunk adds its head-weight gradient [V, d] into an fp32 sum: fewer,
# larger chunks move fewer bytes (docs/performance.md "The loss").
LOSS_CHUNK_TOKENS = 4096


def chunk_positions(rows: int, tokens: int = LOSS_CHUNK_TOKENS) -> int:
    """Positions per loss chunk for `rows` sequences per device: `tokens` spread over them (>= 1)."""
    return max(1, tokens // max(1, rows))


def token_cross_entropy(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
    """fp32 -log softmax(logits)[target], per token [B, S]."""
    logits = logits_bsv.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_bs[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def chunked_cross_entropy(
    hidden_bsd: jax.Array,
    targets_bs: jax.Array,
    weights_bs: jax.Array,
    head: Callable[[Any, jax.Array], jax.Array],
    head_params: Any,
    chunk: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of weighted token losses, sum of weights), both fp32 scalars.

    Args:
      hidden_bsd: final-normed hidden [B, S, d].
      targets_bs: int target ids [B, S].
      weights_bs: loss weights [B, S] (the loss mask; not differentiated).
      head: head(head_params, h) maps [..., d] -> logits [..., V].
      head_params: the pytree of arrays the head reads (differentiated, like hidden_bsd).
      chunk: positions per chunk; the last chunk is padded with weight 0.

    Returns:
      (loss sum [] fp32, weight sum [] fp32). The gradients are computed in the forward pass
      (`_fused_fwd`), so differentiating costs 3 head matmuls per chunk.
    """
    weights_bs = weights_bs.astype(jnp.float32)
    total = _fused_cross_entropy(head, chunk, head_params, hidden_bsd, targets_bs, weights_bs)
    return total, jnp.sum(weights_bs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_cross_entropy(head, chunk, head_params, hidden_bsd, targets_bs, weights_bs):
    """The loss sum alone (nothing differentiates: evaluation), a scan over chunks."""
    split, chunked = _chunked(chunk, hidden_bsd, targets_bs, weights_bs)

    def body(total, xs):
        h, t, w = xs
        return total + jnp.sum(token_cross_entropy(head(head_params, h), t) * w), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), tuple(map(split, chunked)))
    return total


def _fused_fwd(head, chunk, head_params, hidden_bsd, targets_bs, weights_bs):
    """(loss sum, residuals): one scan over chunks computes each chunk's loss and its gradients,
    d loss / d logits = (softmax - one_hot(target)) * weight pushed through the head's vjp. The
    head-param gradients are summed in fp32; the hidden gradients come out per chunk.
    Residuals: (fp32 head-param gradient sums, hidden gradient [B, S, d], zero-size arrays of the
    head params' dtypes for the backward's cast)."""
    b, s, _ = hidden_bsd.shape
    split, chunked = _chunked(chunk, hidden_bsd, targets_bs, weights_bs)

    def body(carry, xs):
        total, dp_sum = carry
        h, t, w = xs
        logits, vjp = jax.vjp(head, head_params, h)
        logits32 = logits.astype(jnp.float32)
        lse = jax.nn.logsumexp(logits32, axis=-1)
        target_logit = jnp.take_along_axis(logits32, t[..., None], axis=-1)[..., 0]
        one_hot = jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
        d_logits = (jnp.exp(logits32 - lse[..., None]) - one_hot) * w[..., None]
        dp, dh = vjp(d_logits.astype(logits.dtype))
        dp_sum = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), dp_sum, dp)
        return (total + jnp.sum((lse - target_logit) * w), dp_sum), dh

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params)
    init = (jnp.zeros((), jnp.float32), zeros)
    (total, dp_sum), dh = jax.lax.scan(body, init, tuple(map(split, chunked)))
    dh_bsd = jnp.moveaxis(dh, 0, 1).reshape(b, -1, dh.shape[-1])[:, :s]  # [n, B, chunk, d] -> [B, S, d]
    # A dtype is not a valid residual: zero-size arrays carry the head params' dtypes.
    dtypes = jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), head_params)
    return total, (dp_sum, dh_bsd, dtypes)


def _fused_bwd(head, chunk, residuals, g):
    """The forward's gradients times the loss sum's cotangent g (in fp32), in the primals' dtypes;
    none for targets and weights."""
    dp_sum, dh_bsd, dtypes = residuals
    g = g.astype(jnp.float32)
    d_params = jax.tree.map(lambda d, like: (g * d).astype(like.dtype), dp_sum, dtypes)
    return d_params, (g * dh_bsd.astype(jnp.float32)).astype(dh_bsd.dtype), None, None


_fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd)


def chunked_token_logprobs(
    hidden_bsd: jax.Array,
    targets_bs: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    chunk: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Per-token (fp32 log p(target) [B, S], target is the argmax [B, S] bool), chunked like
    `chunked_cross_entropy` (forward only: scoring and evaluation)."""
    b, s, _ = hidden_bsd.shape
    split, (hidden_bsd, targets_bs) = _chunked(chunk, hidden_bsd, targets_bs)

    def body(_, xs):
        h, t = xs
        logits = head(h).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        # an exact tie with the maximum counts as greedy
        greedy = target_logit >= jnp.max(logits, axis=-1)
        return None, (target_logit - jax.nn.logsumexp(logits, axis=-1), greedy)

    _, (logp, greedy) = jax.lax.scan(body, None, (split(hidden_bsd), split(targets_bs)))
    merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :s]  # [n, B, chunk] -> [B, S]
    return merge(logp), merge(greedy)


def _chunked(chunk: int, *arrays_bs: jax.Array):
    """Pads [B, S, ...] arrays along S to a multiple of min(chunk, S) (zeros: weight 0 / token 0) and
    returns (split, padded) with split(x) = x as [n, B, chunk, ...] for a scan over chunks."""
    b, s = arrays_bs[0].shape[:2]
    chunk = min(chunk, s)
    n = -(-s // chunk)
    pad = n * chunk - s
    if pad:
        arrays_bs = tuple(jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in arrays_bs)
    split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
    return split, arrays_bs
