"""CCA: compressed convolutional attention (docs/model.md §2.1, arXiv 2510.04476).

Per block, from the normed input x [B, S, d]:
  q0 = x Wq [B, S, N*H], k0 = x Wk [B, S, K*H]
  q = conv(concat(q0, k0))[:N*H] + mean-skip(q0, k0)            two-stage causal conv over time
  v = concat(x Wvc, shift_right(x Wvd)) -> [B, S, K, H]          half the value from the previous token
  q, k <- sqrt(H) * l2norm; k *= temp[kv head]; partial RoPE; causal GQA attention; o_proj.
(N query heads, K key/value heads, H head dim; C = (N+K)*H conv channels.)

The conv and value shift need left context; `CCAState` carries it between calls (decoding), and a
fresh state is all zeros, which is exactly the left zero-padding of the full-sequence forward.
With a "context" mesh axis (zaya_jax/parallel/context.py) each rank holds a chunk of the sequence:
its left context is the previous rank's last rows (a halo of conv inputs), and attention reads the
keys and values of the whole sequence, all-gathered over the axis.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from zaya_jax.kernels import attention_choice, blockwise_attention
from zaya_jax.model.attention import (
    attention_allowed,
    blockwise_self_attention,
    pallas_attention,
    xla_attention,
)
from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.rope import apply_rope, rope_cos_sin
from zaya_jax.parallel.context import (
    CONTIGUOUS,
    context_size,
    gather_sequence,
    last_chunk,
    with_left_context,
)
from zaya_jax.parallel.mesh import mesh_platform


class CCAState(NamedTuple):
    """Left context of the CCA projections for one block.

    conv: the last P = (t0-1)+(t1-1) raw concat(q0, k0) rows [B, P, C].
    v_delayed: the previous token's delayed value projection [B, K*H/2], or None at sequence
      start (then it is the projection of a zero vector, as in transformers).
    """

    conv: jax.Array
    v_delayed: jax.Array | None


def torch_conv_init(fan_in: int):
    """PyTorch's default Conv1d init (kaiming_uniform(a=sqrt 5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = fan_in**-0.5
    return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


class DepthwiseConv(nn.Module):
    """Depthwise 'valid' cross-correlation over time (axis -2): [..., T, C] -> [..., T - k + 1, C].

    Params: kernel [k, C] (HF conv_qk_depthwise.weight [C, 1, k]), bias [C].
    """

    kernel_size: int
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, u_tc: jax.Array) -> jax.Array:
        c, k = u_tc.shape[-1], self.kernel_size
        w = self.param("kernel", torch_conv_init(k), (k, c), self.param_dtype).astype(self.dtype)
        b = self.param("bias", torch_conv_init(k), (c,), self.param_dtype).astype(self.dtype)
        return depthwise_conv(u_tc, w) + b


def _depthwise_taps(u_tc: jax.Array, w_kc: jax.Array, t_out: int) -> jax.Array:
    """sum_i u[..., i : i + t_out, :] * w[i]: k is 2 or 3, so a sum of shifted products is exact and
    cheaper than a general convolution."""
    return sum(u_tc[..., i : i + t_out, :] * w_kc[i] for i in range(w_kc.shape[0]))


@jax.custom_vjp
def depthwise_conv(u_tc: jax.Array, w_kc: jax.Array) -> jax.Array:
    """Depthwise 'valid' cross-correlation over axis -2: [..., T, C], [k, C] -> [..., T-k+1, C].

    The backward is written out because autodiff's is one padded [..., T, C] copy of dy * w[i] per
    tap, all alive until summed (tiny's largest backward temporary); here the input gradient is the
    same taps over dy, zero-padded once, and the kernel gradient one reduction per tap."""
    return _depthwise_taps(u_tc, w_kc, u_tc.shape[-2] - w_kc.shape[0] + 1)


def _depthwise_conv_fwd(u_tc, w_kc):
    return depthwise_conv(u_tc, w_kc), (u_tc, w_kc)


def _depthwise_conv_bwd(res, dy_tc):
    u_tc, w_kc = res
    k, t_out = w_kc.shape[0], dy_tc.shape[-2]
    # du[t] = sum_i dy[t - i] w[i]: the taps of dy padded by k - 1 on both sides, flipped in time.
    dy_pad = jnp.pad(dy_tc, [(0, 0)] * (dy_tc.ndim - 2) + [(k - 1, k - 1), (0, 0)])
    du = _depthwise_taps(dy_pad, w_kc[::-1], u_tc.shape[-2])
    lead = tuple(range(dy_tc.ndim - 1))
    dw = jnp.stack([jnp.sum(u_tc[..., i : i + t_out, :] * dy_tc, axis=lead) for i in range(k)])
    return du.astype(u_tc.dtype), dw.astype(w_kc.dtype)


depthwise_conv.defvjp(_depthwise_conv_fwd, _depthwise_conv_bwd)


class ProjectionWeights(nn.Module):
    """A dense layer's parameters, made as nn.Dense makes them (``kernel`` [d, n], ``bias`` [n],
    same initializers and names) but returned, not applied: `project` applies several at once."""

    features: int
    use_bias: bool
    param_dtype: Any
    kernel_init: Callable

    @nn.compact
    def __call__(self, d_in: int) -> tuple[jax.Array, jax.Array | None]:
        kernel = self.param("kernel", self.kernel_init, (d_in, self.features), self.param_dtype)
        if not self.use_bias:
            return kernel, None
        return kernel, self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)


def project(x_bsd: jax.Array, weights: list[tuple[jax.Array, jax.Array | None]], dtype) -> list[jax.Array]:
    """x [..., d] through the dense layers `weights` (kernel [d, n_i], bias [n_i] | None): [..., n_1],
    [..., n_2], ... in `dtype`, each product as nn.Dense computes it (the forward's values are its,
    to the bit); the backward is written out (`_products`): one input-gradient product
    [..., sum n_i] x [sum n_i, d] where autodiff made one per layer and summed them."""
    ys = _products(x_bsd.astype(dtype), tuple(k.astype(dtype) for k, _ in weights))
    return [y if b is None else y + b.astype(dtype) for y, (_, b) in zip(ys, weights)]


@jax.custom_vjp
def _products(x_bsd: jax.Array, kernels: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """x @ k for each kernel [d, n_i]."""
    return tuple(jnp.dot(x_bsd, k) for k in kernels)


def _products_fwd(x_bsd, kernels):
    return _products(x_bsd, kernels), (x_bsd, kernels)


def _products_bwd(res, cts):
    """dx = [dy_1 .. dy_m] [k_1 .. k_m]^T in one product; dk = x^T [dy_1 .. dy_m], split per kernel."""
    x_bsd, kernels = res
    dy = jnp.concatenate(cts, axis=-1)
    dx = jnp.dot(dy, jnp.concatenate(kernels, axis=1).T)
    # Contracted over the leading axes as they are: flattening [B, S] first would make XLA's SPMD
    # partitioner all-gather a sequence split over the context axis.
    lead = tuple(range(x_bsd.ndim - 1))
    dk = jax.lax.dot_general(x_bsd, dy, ((lead, lead), ((), ())))
    cuts = np.cumsum([k.shape[1] for k in kernels])[:-1].tolist()
    return dx.astype(x_bsd.dtype), tuple(jnp.split(dk, cuts, axis=-1))


_products.defvjp(_products_fwd, _products_bwd)


def _grouped_conv_btc(x_btc: jax.Array, w_kic: jax.Array, groups: int, pad: int, taps: bool) -> jax.Array:
    """Grouped cross-correlation over time, fp32 out: x [..., T, C], w [k, C/groups, C] (WIO),
    `pad` zero rows on both sides of T. `taps`: one product per tap (`_grouped_taps`), else XLA's
    grouped convolution (one batch axis)."""
    if taps:
        return _grouped_taps(x_btc, w_kic, groups, pad)
    return jax.lax.conv_general_dilated(
        x_btc,
        w_kic,
        (1,),
        [(pad, pad)],
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=groups,
        preferred_element_type=jnp.float32,
    )


def _grouped_taps(x_btc: jax.Array, w_kic: jax.Array, groups: int, pad: int) -> jax.Array:
    """sum_i x[..., t + i, g, :] @ w[i][:, g, :] per group g: the grouped convolution as k batched
    products (groups the batch axis, every leading axis of x a free one). XLA's SPMD partitioner
    all-gathers a grouped convolution's batch when it is split over an automatic mesh axis (the
    context axis' chunks); these products it keeps split."""
    k, h, c = w_kic.shape
    if pad:
        x_btc = jnp.pad(x_btc, [(0, 0)] * (x_btc.ndim - 2) + [(pad, pad), (0, 0)])
    *lead, t, _ = x_btc.shape
    t_out = t - k + 1
    x_tgi = x_btc.reshape(*lead, t, groups, h)
    w_kigo = w_kic.reshape(k, h, groups, c // groups)
    tap = lambda i: jnp.einsum(
        "...tgi,igo->...tgo", x_tgi[..., i : i + t_out, :, :], w_kigo[i], preferred_element_type=jnp.float32
    )
    y = sum(tap(i) for i in range(k))
    return y.reshape(*lead, t_out, c)


def _grouped_taps_transposed(dy_btc: jax.Array, w_kic: jax.Array, groups: int) -> jax.Array:
    """The input gradient of `_grouped_taps` (pad 0): dx[..., t + i, g] += dy[..., t, g] @ w[i][:, g, :]^T,
    one product per tap over dy's T - k + 1 rows, each placed at its offset. A product per tap
    over the padded dy instead (a full convolution) has T rows, which XLA:ROCm's Triton GEMM
    emitter failed to tile for some T (jax 0.10.2)."""
    k, h, c = w_kic.shape
    *lead, t_out, _ = dy_btc.shape
    dy_tgo = dy_btc.reshape(*lead, t_out, groups, c // groups)
    w_kigo = w_kic.reshape(k, h, groups, c // groups)
    no_pad = [(0, 0)] * len(lead)
    tap = lambda i: jnp.pad(
        jnp.einsum("...tgo,igo->...tgi", dy_tgo, w_kigo[i], preferred_element_type=jnp.float32),
        [*no_pad, (i, k - 1 - i), (0, 0), (0, 0)],
    )
    dx_tgi = sum(tap(i) for i in range(k))
    return dx_tgi.reshape(*lead, t_out + k - 1, groups * h)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def grouped_conv(x_btc: jax.Array, w_kic: jax.Array, groups: int, taps: bool = False) -> jax.Array:
    """Grouped 'valid' cross-correlation [..., T, C] -> [..., T-k+1, C] (fp32), one group per head;
    one leading axis unless `taps` (`_grouped_taps`, any leading axes).

    On XLA:CPU the grouped convolution is faster forward than one einsum per tap, but
    autodiff's backward of it is slow (fwd+bwd slower than the einsums). So the backward is
    written out: the input gradient is again a convolution (padded, with the kernel flipped in
    time and each group's block transposed), the weight gradient one matmul per tap."""
    return _grouped_conv_btc(x_btc, w_kic, groups, 0, taps)


def _grouped_conv_fwd(x_btc, w_kic, groups, taps):
    return _grouped_conv_btc(x_btc, w_kic, groups, 0, taps), (x_btc, w_kic)


def _grouped_conv_bwd(groups, taps, res, dy_btc):
    x_btc, w_kic = res
    k, h, c = w_kic.shape
    *lead, t, _ = x_btc.shape
    t_out = t - k + 1
    # dx[t] = sum_i dy[t - i] w[i]^T per group: a full convolution with the kernel flipped in time
    # and each group's [in, out] block transposed.
    if taps:
        dx = _grouped_taps_transposed(dy_btc.astype(x_btc.dtype), w_kic, groups)
    else:
        w_flip = w_kic.reshape(k, h, groups, h)[::-1].transpose(0, 3, 2, 1).reshape(k, h, c)
        dx = _grouped_conv_btc(dy_btc.astype(x_btc.dtype), w_flip, groups, k - 1, taps)
    # dw[i] = sum over (leading axes, t) of x[t + i]^T dy[t] per group.
    x_tgi = x_btc.reshape(*lead, t, groups, h)
    dy_tgo = dy_btc.reshape(*lead, t_out, groups, h).astype(x_btc.dtype)
    dw = jnp.stack(
        [
            jnp.einsum(
                "...tgi,...tgo->igo",
                x_tgi[..., i : i + t_out, :, :],
                dy_tgo,
                preferred_element_type=jnp.float32,
            )
            for i in range(k)
        ]
    )
    return dx.astype(x_btc.dtype), dw.reshape(k, h, c).astype(w_kic.dtype)


grouped_conv.defvjp(_grouped_conv_fwd, _grouped_conv_bwd)


class GroupedConv(nn.Module):
    """Grouped 'valid' cross-correlation over time (axis -2), one group per head:
    [..., T, G*h] -> [..., T-k+1, G*h].

    Params: kernel [k, h_in, G*h_out] (HF conv_qk_grouped.weight [G*h_out, h_in, k]), bias [G*h].
    """

    kernel_size: int
    groups: int
    dtype: Any
    param_dtype: Any
    # One product per tap (`_grouped_taps`) instead of XLA's convolution: for inputs whose leading
    # axes are split over an automatic mesh axis (CCA's chunks on a "context" mesh).
    taps: bool = False

    @nn.compact
    def __call__(self, u_tc: jax.Array) -> jax.Array:
        *lead, t, c = u_tc.shape
        g, k = self.groups, self.kernel_size
        h = c // g
        w = self.param("kernel", torch_conv_init(h * k), (k, h, c), self.param_dtype).astype(self.dtype)
        bias = self.param("bias", torch_conv_init(h * k), (c,), self.param_dtype).astype(self.dtype)
        if self.taps:
            out = grouped_conv(u_tc, w, g, True)
        else:
            out = grouped_conv(u_tc.reshape(-1, t, c), w, g).reshape(*lead, t - k + 1, c)
        return (out + bias.astype(jnp.float32)).astype(self.dtype)


def qk_mean_skip(q0_bsnh: jax.Array, k0_bskh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The q-k mean skip from the pre-conv projections (docs/model.md §2.1.2).

    mq[j] = (q0[j] + k0[j // G]) / 2 per query head j; mk[h] = mean of mq over kv head h's G queries.
    """
    b, s, nq, hd = q0_bsnh.shape
    nkv = k0_bskh.shape[2]
    mq = (q0_bsnh.reshape(b, s, nkv, nq // nkv, hd) + k0_bskh[:, :, :, None, :]) * 0.5
    return mq.reshape(b, s, nq, hd), mq.mean(axis=3)


def l2_qk_norm(q_bsnh: jax.Array, k_bskh: jax.Array, temp_k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q <- sqrt(hd) q / max(|q|, eps); k likewise, times the linear per-kv-head temperature (fp32)."""
    hd = q_bsnh.shape[-1]
    eps = jnp.finfo(q_bsnh.dtype).eps  # transformers clamps the norm at the compute dtype's eps

    def normalize(x):
        x = x.astype(jnp.float32)
        return x * (hd**0.5 / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps))

    return normalize(q_bsnh), normalize(k_bskh) * temp_k.astype(jnp.float32)[:, None]


class LayerCache(NamedTuple):
    """One block's decoding cache (stacked [L, ...] in the model): k, v [B, T, K, H] preallocated;
    conv [B, (t0-1)+(t1-1), C] and v_delayed [B, K*H/2] as in CCAState."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    v_delayed: jax.Array


class KVContext(NamedTuple):
    """A block's cache plus what all blocks share: the write index (scalar int32) and the key
    positions / key mask of the whole cache [B, T], already updated with the new tokens."""

    layer: LayerCache
    index: jax.Array
    kv_pos_bt: jax.Array
    kv_mask_bt: jax.Array


class CCAttention(nn.Module):
    """x [B, S, d] (normed) -> attention output [B, S, d] in the compute dtype, and the new CCAState."""

    cfg: ZayaConfig
    mesh: Mesh | None = None  # the Pallas kernel runs per device (shard_map) on a mesh
    context_layout: str = CONTIGUOUS  # mesh.context_layout: which chunks each context rank holds

    def setup(self):
        cfg = self.cfg
        init = nn.initializers.normal(cfg.initializer_range)
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        weights = lambda n: ProjectionWeights(n, cfg.attention_bias, cfg.params_dtype, init)
        self.q_proj = weights(nq * hd)
        self.k_proj = weights(nkv * hd)
        self.v_proj_current = weights(nkv * hd // 2)
        self.v_proj_delayed = weights(nkv * hd // 2)
        self.conv_qk_depthwise = DepthwiseConv(cfg.cca_time0, cfg.compute_dtype, cfg.params_dtype)
        # Split chunks (a context mesh): XLA would all-gather a grouped convolution's batch.
        taps = context_size(self.mesh) > 1
        self.conv_qk_grouped = GroupedConv(cfg.cca_time1, nq + nkv, cfg.compute_dtype, cfg.params_dtype, taps)
        # HF initialises temp to 0 as a loading placeholder; from scratch it must start at 1
        # (docs/model.md §2.1.5).
        self.temp = self.param("temp", nn.initializers.ones, (nkv,), cfg.params_dtype)
        self.o_proj = nn.Dense(
            cfg.hidden_size,
            use_bias=cfg.attention_bias,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            kernel_init=init,
        )

    def initial_state(self, batch: int) -> CCAState:
        cfg = self.cfg
        return CCAState(jnp.zeros((batch, cfg.conv_state_len, cfg.conv_channels), cfg.compute_dtype), None)

    def _delayed_value_of_zero(self, b: int, d: int) -> jax.Array:
        """[B, K*H/2]: the delayed value projection of a zero vector, the 'previous token' at a
        sequence's start (as transformers computes it)."""
        dtype, (kernel, bias) = self.cfg.compute_dtype, self.v_proj_delayed(d)
        zero = jnp.zeros((b, kernel.shape[1]), dtype)  # 0 W = 0 exactly: the bias, if any, is all
        return zero if bias is None else zero + bias.astype(dtype)

    def qkv(
        self, x_bsd: jax.Array, state: CCAState | None
    ) -> tuple[jax.Array, jax.Array, jax.Array, CCAState]:
        """Pre-norm q [B,S,N,H], k [B,S,K,H], v [B,S,K,H] (all in the compute dtype).

        state None = sequence start. On a "context" mesh the left context of every chunk but the
        sequence's first comes from the rank holding the chunk before it (`with_left_context`, in
        the order of `context_layout`); `state` is the first chunk's."""
        cfg = self.cfg
        b, s, _ = x_bsd.shape
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = x_bsd.shape[-1]
        projections = (self.q_proj, self.k_proj, self.v_proj_current, self.v_proj_delayed)
        q0, k0, v_cur, v_del = project(x_bsd, [p(d) for p in projections], cfg.compute_dtype)
        mq, mk = qk_mean_skip(q0.reshape(b, s, nq, hd), k0.reshape(b, s, nkv, hd))

        # u [B, K*R, P + S/(K*R), C]: each stored chunk of the conv input after its left context.
        rows = cfg.conv_state_len
        conv_left = None if state is None else state.conv
        left_context = partial(with_left_context, mesh=self.mesh, layout=self.context_layout)
        u = left_context(jnp.concatenate([q0, k0], axis=-1), conv_left, rows)
        conv = self.conv_qk_grouped(self.conv_qk_depthwise(u)).reshape(b, s, -1)  # [B, S, C]
        q = conv[..., : nq * hd].reshape(b, s, nq, hd) + mq
        k = conv[..., nq * hd :].reshape(b, s, nkv, hd) + mk

        prev = None if state is None else state.v_delayed
        if prev is None:
            prev = self._delayed_value_of_zero(b, d)
        v_shifted = left_context(v_del, prev[:, None], 1)[:, :, :-1].reshape(b, s, -1)
        v = jnp.concatenate([v_cur, v_shifted], axis=-1).reshape(b, s, nkv, hd)

        # The sequence's end: the last stored chunk only in the contiguous layout.
        end = last_chunk(self.context_layout, self.mesh)
        v_del_chunks = v_del.reshape(*u.shape[:2], -1, v_del.shape[-1])  # [B, K*R, S/(K*R), D]
        new_state = CCAState(u[:, end, u.shape[2] - rows :], v_del_chunks[:, end, -1])
        return q, k, v, new_state

    def __call__(
        self,
        x_bsd: jax.Array,
        *,
        positions_bs: jax.Array,
        padding_mask_bs: jax.Array | None,
        rope_theta: jax.Array | float,
        sliding_window: jax.Array | int | None = None,
        segment_ids_bs: jax.Array | None = None,
        state: CCAState | None = None,
        kv_cache: KVContext | None = None,
    ) -> tuple[jax.Array, CCAState] | tuple[jax.Array, LayerCache]:
        """With `kv_cache` (decoding): new tokens at positions_bs are written into the layer's cache
        at kv_cache.index, attend over the whole cache, and the updated LayerCache is returned."""
        cfg = self.cfg
        if kv_cache is not None:
            return self._cached(x_bsd, positions_bs, padding_mask_bs, rope_theta, sliding_window, kv_cache)
        if padding_mask_bs is not None:
            # Pad tokens must not leak into the conv or the value shift (docs/model.md §2.1.8).
            x_bsd = x_bsd * padding_mask_bs[..., None].astype(x_bsd.dtype)
        q, k, v, new_state = self.qkv(x_bsd, state)
        q, k = l2_qk_norm(q, k, self.temp)
        cos, sin = rope_cos_sin(positions_bs, cfg.rotary_dim, rope_theta)
        q = apply_rope(q, cos, sin).astype(cfg.compute_dtype)
        k = apply_rope(k, cos, sin).astype(cfg.compute_dtype)
        impl = self._impl(x_bsd.shape[1])
        if impl == "blockwise":
            o = blockwise_self_attention(
                q,
                k,
                v,
                positions_bs=positions_bs,
                key_mask_bs=padding_mask_bs,
                segment_ids_bs=segment_ids_bs,
                sliding_window=sliding_window,
                scale=cfg.head_dim**-0.5,
                mesh=self.mesh,
            )
        elif impl == "pallas":
            # The kernel masks by token order: positions are the default arange (training, prefill),
            # a context rank's chunk at its offset.
            o = pallas_attention(
                q,
                k,
                v,
                scale=cfg.head_dim**-0.5,
                segment_ids=segment_ids_bs,
                key_mask=padding_mask_bs,
                sliding_window=sliding_window,
                mesh=self.mesh,
                layout=self.context_layout,
            )
        elif context_size(self.mesh) > 1:
            o = self._context_attention(
                q, k, v, positions_bs, padding_mask_bs, segment_ids_bs, sliding_window
            )
        else:
            allowed = attention_allowed(
                positions_bs,
                positions_bs,
                key_mask_bt=padding_mask_bs,
                q_segment_bs=segment_ids_bs,
                kv_segment_bt=segment_ids_bs,
                sliding_window=sliding_window,
            )
            o = xla_attention(q, k, v, allowed, scale=cfg.head_dim**-0.5)
        b, s = x_bsd.shape[:2]
        return self.o_proj(o.reshape(b, s, -1)), new_state

    def _impl(self, seq_len: int) -> str:
        """model.attention_impl resolved for `seq_len` keys on the mesh's platform."""
        return attention_choice(self.cfg.attention_impl, mesh_platform(self.mesh), seq_len)

    def _context_attention(self, q, k, v, positions_bs, padding_mask_bs, segment_ids_bs, sliding_window):
        """Attention of this rank's queries over the whole sequence: keys, values and their
        positions / mask / segments all-gathered over "context"; the mask is on global positions."""
        gather = lambda x: None if x is None else gather_sequence(x, self.mesh)
        allowed = attention_allowed(
            positions_bs,
            gather(positions_bs),
            key_mask_bt=gather(padding_mask_bs),
            q_segment_bs=segment_ids_bs,
            kv_segment_bt=gather(segment_ids_bs),
            sliding_window=sliding_window,
        )
        return xla_attention(q, gather(k), gather(v), allowed, scale=self.cfg.head_dim**-0.5)

    def _cached(self, x_bsd, positions_bs, padding_mask_bs, rope_theta, sliding_window, ctx: KVContext):
        cfg = self.cfg
        if padding_mask_bs is not None:
            x_bsd = x_bsd * padding_mask_bs[..., None].astype(x_bsd.dtype)
        b = x_bsd.shape[0]
        lc = ctx.layer
        # At index 0 the previous delayed value is the projection of a zero vector (sequence start).
        zero_prev = self._delayed_value_of_zero(b, x_bsd.shape[-1])
        prev = jnp.where(ctx.index == 0, zero_prev.astype(lc.v_delayed.dtype), lc.v_delayed)
        q, k, v, st = self.qkv(x_bsd, CCAState(lc.conv, prev))
        q, k = l2_qk_norm(q, k, self.temp)
        cos, sin = rope_cos_sin(positions_bs, cfg.rotary_dim, rope_theta)
        q = apply_rope(q, cos, sin).astype(cfg.compute_dtype)
        k = apply_rope(k, cos, sin).astype(cfg.compute_dtype)
        zero = jnp.zeros((), jnp.int32)
        idx = jnp.asarray(ctx.index, jnp.int32)
        k_all = jax.lax.dynamic_update_slice(lc.k, k.astype(lc.k.dtype), (zero, idx, zero, zero))
        v_all = jax.lax.dynamic_update_slice(lc.v, v.astype(lc.v.dtype), (zero, idx, zero, zero))
        k_all_q, v_all_q = k_all.astype(q.dtype), v_all.astype(q.dtype)
        if positions_bs.shape[1] > 1 and self._impl(k_all.shape[1]) == "blockwise":
            # a prefill: [S, T] scores of a long prompt would not fit; a decode step's [1, T] does
            o = blockwise_attention(
                q,
                k_all_q,
                v_all_q,
                q_pos_bs=positions_bs,
                kv_pos_bt=ctx.kv_pos_bt,
                key_mask_bt=ctx.kv_mask_bt,
                sliding_window=sliding_window,
                scale=cfg.head_dim**-0.5,
            )
        else:
            allowed = attention_allowed(
                positions_bs, ctx.kv_pos_bt, key_mask_bt=ctx.kv_mask_bt, sliding_window=sliding_window
            )
            o = xla_attention(q, k_all_q, v_all_q, allowed, scale=cfg.head_dim**-0.5)
        s = x_bsd.shape[1]
        new = LayerCache(k_all, v_all, st.conv.astype(lc.conv.dtype), st.v_delayed.astype(lc.v_delayed.dtype))
        return self.o_proj(o.reshape(b, s, -1)), new
