"""Next-token cross-entropy computed in sequence chunks, so [B, S, V] logits never exist at once.

ZAYA1's vocabulary is 262k: full fp32 logits for a 4 x 4096 microbatch would take 17 GB, and the
backward pass would keep them. Each chunk's logits are recomputed in the backward pass instead
(`jax.checkpoint`), which costs one extra head matmul and bounds memory by the chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def token_cross_entropy(logits_bsv: jax.Array, targets_bs: jax.Array) -> jax.Array:
    """fp32 -log softmax(logits)[target], per token [B, S]."""
    logits = logits_bsv.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_bs[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def chunked_cross_entropy(
    hidden_bsd: jax.Array,
    targets_bs: jax.Array,
    weights_bs: jax.Array,
    head: Callable[[jax.Array], jax.Array],
    chunk: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of weighted token losses, sum of weights), both fp32 scalars.

    hidden [B, S, d] final-normed; head maps [..., d] -> logits [..., V]; weights [B, S] (loss mask).
    The sequence is split into chunks of `chunk` positions (the last chunk is padded with weight 0).
    """
    split, (hidden_bsd, targets_bs, weights_bs) = _chunked(chunk, hidden_bsd, targets_bs, weights_bs)

    @jax.checkpoint
    def chunk_loss(h, t, w):
        return jnp.sum(token_cross_entropy(head(h), t) * w)

    def body(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(
        body,
        jnp.zeros((), jnp.float32),
        (split(hidden_bsd), split(targets_bs), split(weights_bs.astype(jnp.float32))),
    )
    return total, jnp.sum(weights_bs.astype(jnp.float32))


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
