"""Flash attention for the CCA attention core: Pallas (Triton lowering) forward and backward.

    flash_attention(q [B,Sq,Nq,hd], k [B,Sk,Nkv,hd], v [B,Sk,Nkv,hd], *, scale, causal=True,
                    q_segment_ids=None, kv_segment_ids=None, key_mask=None, sliding_window=None,
                    q_offset=None)
      -> [B, Sq, Nq, hd] in q's dtype

The design: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.kernels.block_sizes import pick_blocks
from zaya_jax.kernels.flops import causal_pairs, tagged
from zaya_jax.kernels.xla_attention import xla_attention

# Masked logits (base-2 domain). Finite, so a row whose visited keys are all masked gives
# exp2(MASK - MASK) = 1 instead of NaN; such rows are detected (m == MASK) and fixed up.
_MASK = -1e30
# The logsumexp recorded for a fully masked row: P = exp2(s - 1e30) is exactly 0 in the backward.
_LSE_MASKED = 1e30
_LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    causal: bool
    sq: int
    sk: int
    groups: int  # G = Nq // Nkv
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    has_segments: bool
    has_key_mask: bool
    has_window: bool
    has_offset: bool  # q_offset a kernel operand (traced); else the static sk - sq
    flops_offset: int  # the offset the FLOP tag counts with (kernels/flops.py)
    num_warps: int
    num_stages: int | None
    interpret: bool

    @property
    def static_offset(self) -> int:  # query row s at position s + offset when none is given
        return self.sk - self.sq


def _dot(a, b, contract=((1,), (0,))):
    """2-D dot with fp32 accumulation; fp32 operands use IEEE fp32 (no TF32) like the XLA path."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _cdiv(a, b: int):
    """ceil(a / b) for a traced non-negative int32 `a` (lax.div lowers in Triton, `//` may not)."""
    return lax.div(a + (b - 1), b)


def _allowed(cfg: _Cfg, q_rows, k_cols, qseg, kseg, kmask, window, offset):
    """bool [bq, bk]: the `attention_allowed` mask for one tile, plus the ragged-edge bounds."""
    ok = (q_rows[:, None] < cfg.sq) & (k_cols[None, :] < cfg.sk)
    q_pos = q_rows[:, None] + offset
    if cfg.causal:
        ok &= k_cols[None, :] <= q_pos
    if cfg.has_segments:
        ok &= qseg[:, None] == kseg[None, :]
    if cfg.has_key_mask:
        ok &= kmask[None, :] != 0
    if cfg.has_window:
        ok &= (window <= 0) | (k_cols[None, :] > q_pos - window)
    return ok


def _split_refs(cfg: _Cfg, refs):
    """(qseg, kseg, kmask, window) refs (None where absent), the query offset (a scalar read from
    its ref, or the static one), rest."""
    refs = list(refs)
    qseg = kseg = kmask = window = None
    if cfg.has_segments:
        qseg, kseg = refs.pop(0), refs.pop(0)
    if cfg.has_key_mask:
        kmask = refs.pop(0)
    if cfg.has_window:
        window = refs.pop(0)
    offset = refs.pop(0)[0] if cfg.has_offset else cfg.static_offset
    return (qseg, kseg, kmask, window), offset, refs


def _q_block_bounds(cfg: _Cfg, q_start, bq: int, bk: int, window, offset):
    """Key-block loop bounds [lo, hi) for the query rows [q_start, q_start + bq)."""
    nk = pl.cdiv(cfg.sk, bk)
    hi = nk
    if cfg.causal:  # keys up to the last row's position
        hi = jnp.minimum(nk, _cdiv(jnp.maximum(q_start + bq + offset, 0), bk))
    lo = 0
    if cfg.has_window:  # keys from the first row's position - w + 1
        first = jnp.maximum(q_start + offset - window + 1, 0)
        lo = jnp.where(window > 0, lax.div(first, bk), 0)
    return lo, hi


def _k_block_bounds(cfg: _Cfg, k_start, bk: int, bq: int, window, offset):
    """Query-block loop bounds [lo, hi) for the key rows [k_start, k_start + bk)."""
    nq = pl.cdiv(cfg.sq, bq)
    lo = 0
    if cfg.causal:  # query rows whose position >= k_start
        lo = jnp.minimum(lax.div(jnp.maximum(k_start - offset, 0), bq), nq)
    hi = nq
    if cfg.has_window:  # query rows with position <= last key + w - 1
        end = jnp.maximum(k_start + bk - 1 + window - offset, 0)  # exclusive row bound
        hi = jnp.where(window > 0, jnp.minimum(nq, _cdiv(end, bq)), nq)
    return lo, hi


# ---------------------------------------------------------------------------------------- forward
def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
    (qseg_ref, kseg_ref, kmask_ref, win_ref), offset, (o_ref, lse_ref) = _split_refs(cfg, refs)
    bq, bk = cfg.block_q, cfg.block_k
    hd = q_ref.shape[-1]
    q_start = pl.program_id(0) * bq
    q_rows = q_start + jnp.arange(bq, dtype=jnp.int32)
    q_in = q_rows < cfg.sq
    q = plgpu.load(q_ref.at[pl.ds(q_start, bq), :], mask=q_in[:, None], other=0)
    qseg = plgpu.load(qseg_ref.at[pl.ds(q_start, bq)], mask=q_in, other=-1) if cfg.has_segments else None
    window = win_ref[0] if cfg.has_window else None
    qk_scale = cfg.scale * _LOG2E  # softmax in base 2: exp(x) = exp2(x log2 e)

    def body(j, carry):
        acc, m, l = carry
        k_start = j * bk
        k_cols = k_start + jnp.arange(bk, dtype=jnp.int32)
        k_in = k_cols < cfg.sk
        k = plgpu.load(k_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
        v = plgpu.load(v_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
        kseg = plgpu.load(kseg_ref.at[pl.ds(k_start, bk)], mask=k_in, other=-2) if cfg.has_segments else None
        kmask = plgpu.load(kmask_ref.at[pl.ds(k_start, bk)], mask=k_in, other=0) if cfg.has_key_mask else None
        s = _dot(q, k, ((1,), (1,))) * qk_scale  # [bq, bk]
        s = jnp.where(_allowed(cfg, q_rows, k_cols, qseg, kseg, kmask, window, offset), s, _MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    lo, hi = _q_block_bounds(cfg, q_start, bq, bk, window, offset)
    acc = jnp.zeros((bq, hd), jnp.float32)
    m = jnp.full((bq,), _MASK, jnp.float32)
    l = jnp.zeros((bq,), jnp.float32)
    acc, m, l = lax.fori_loop(lo, hi, body, (acc, m, l))
    dead = m <= 0.5 * _MASK  # no allowed key: fixed up by the wrapper
    l_safe = jnp.where(dead, 1.0, l)
    o = jnp.where(dead[:, None], 0.0, acc / l_safe[:, None])
    lse = jnp.where(dead, _LSE_MASKED, m + jnp.log2(l_safe))
    plgpu.store(o_ref.at[pl.ds(q_start, bq), :], o.astype(o_ref.dtype), mask=q_in[:, None])
    plgpu.store(lse_ref.at[pl.ds(q_start, bq)], lse, mask=q_in)


def _aux_inputs_and_specs(cfg: _Cfg, qseg, kseg, kmask, window, offset):
    """The optional mask inputs (whole rows per batch) and their BlockSpecs for a 3-D grid whose
    batch index is program_id(1)."""
    args, specs = [], []
    if cfg.has_segments:
        args += [qseg, kseg]
        specs += [
            pl.BlockSpec((None, cfg.sq), lambda i, b, h: (b, 0)),
            pl.BlockSpec((None, cfg.sk), lambda i, b, h: (b, 0)),
        ]
    if cfg.has_key_mask:
        args.append(kmask)
        specs.append(pl.BlockSpec((None, cfg.sk), lambda i, b, h: (b, 0)))
    scalars = [x for x, on in ((window, cfg.has_window), (offset, cfg.has_offset)) if on]
    args += scalars
    specs += [pl.BlockSpec((1,), lambda i, b, h: (0,)) for _ in scalars]
    return args, specs


def _flops(cfg: _Cfg, heads_x_hd: int, dots: int, bq: int, bk: int) -> int:
    """Dot FLOPs of one kernel call: `dots` [bq, hd] x [hd, bk]-sized products per visited block
    (kernels/flops.py), over batch x query heads, at the query offset `cfg.flops_offset`."""
    return 2 * dots * heads_x_hd * causal_pairs(cfg.sq, cfg.sk, bq, bk, cfg.flops_offset, cfg.causal)


def _params(cfg: _Cfg):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _fwd_call(cfg: _Cfg, q, k, v, qseg, kseg, kmask, window, offset):
    b, sq, nq, hd = q.shape
    g = cfg.groups
    aux, aux_specs = _aux_inputs_and_specs(cfg, qseg, kseg, kmask, window, offset)
    q_spec = pl.BlockSpec((None, sq, None, hd), lambda i, bb, h: (bb, 0, h, 0))
    kv_spec = pl.BlockSpec((None, cfg.sk, None, hd), lambda i, bb, h: (bb, 0, lax.div(h, g), 0))
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(pl.cdiv(sq, cfg.block_q), b, nq),
        in_specs=[q_spec, kv_spec, kv_spec, *aux_specs],
        out_specs=[q_spec, pl.BlockSpec((None, None, sq), lambda i, bb, h: (bb, h, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nq, sq), jnp.float32)],
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name=tagged("zaya_flash_attention_fwd", _flops(cfg, b * nq * hd, 2, cfg.block_q, cfg.block_k)),
    )(q, k, v, *aux)
    return o, lse


def _dead_rows(lse):
    """bool [B, Sq, Nq]: rows with no allowed key (the +1e30 logsumexp marker)."""
    return jnp.swapaxes(lse, 1, 2) >= 0.5 * _LSE_MASKED


def _fix_dead_rows(cfg: _Cfg, o, lse, v):
    """Fully masked rows -> mean of all values (the XLA path's finite-MASK_VALUE convention)."""
    _b, _sq, _nq, _hd = o.shape
    mean_v = jnp.mean(v.astype(jnp.float32), axis=1)  # [B, Nkv, hd]
    mean_v = jnp.repeat(mean_v, cfg.groups, axis=1)[:, None]  # [B, 1, Nq, hd]
    return jnp.where(_dead_rows(lse)[..., None], mean_v.astype(o.dtype), o)


# --------------------------------------------------------------------------------------- backward
def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg):
    (qseg_ref, kseg_ref, kmask_ref, win_ref), offset, (dq_ref,) = _split_refs(cfg, refs)
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    hd = q_ref.shape[-1]
    q_start = pl.program_id(0) * bq
    q_rows = q_start + jnp.arange(bq, dtype=jnp.int32)
    q_in = q_rows < cfg.sq
    q = plgpu.load(q_ref.at[pl.ds(q_start, bq), :], mask=q_in[:, None], other=0)
    do = plgpu.load(do_ref.at[pl.ds(q_start, bq), :], mask=q_in[:, None], other=0)
    lse = plgpu.load(lse_ref.at[pl.ds(q_start, bq)], mask=q_in, other=_LSE_MASKED)
    delta = plgpu.load(delta_ref.at[pl.ds(q_start, bq)], mask=q_in, other=0.0)
    qseg = plgpu.load(qseg_ref.at[pl.ds(q_start, bq)], mask=q_in, other=-1) if cfg.has_segments else None
    window = win_ref[0] if cfg.has_window else None
    qk_scale = cfg.scale * _LOG2E

    def body(j, dq):
        k_start = j * bk
        k_cols = k_start + jnp.arange(bk, dtype=jnp.int32)
        k_in = k_cols < cfg.sk
        k = plgpu.load(k_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
        v = plgpu.load(v_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
        kseg = plgpu.load(kseg_ref.at[pl.ds(k_start, bk)], mask=k_in, other=-2) if cfg.has_segments else None
        kmask = plgpu.load(kmask_ref.at[pl.ds(k_start, bk)], mask=k_in, other=0) if cfg.has_key_mask else None
        s = _dot(q, k, ((1,), (1,))) * qk_scale
        ok = _allowed(cfg, q_rows, k_cols, qseg, kseg, kmask, window, offset)
        p = jnp.exp2(jnp.where(ok, s, _MASK) - lse[:, None])  # 0 where masked or dead row
        dp = _dot(do, v, ((1,), (1,)))  # [bq, bk]
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    lo, hi = _q_block_bounds(cfg, q_start, bq, bk, window, offset)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, hd), jnp.float32))
    plgpu.store(dq_ref.at[pl.ds(q_start, bq), :], (dq * cfg.scale).astype(dq_ref.dtype), mask=q_in[:, None])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Cfg):
    (qseg_ref, kseg_ref, kmask_ref, win_ref), offset, (dk_ref, dv_ref) = _split_refs(cfg, refs)
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    hd = k_ref.shape[-1]
    k_start = pl.program_id(0) * bk
    k_cols = k_start + jnp.arange(bk, dtype=jnp.int32)
    k_in = k_cols < cfg.sk
    k = plgpu.load(k_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
    v = plgpu.load(v_ref.at[pl.ds(k_start, bk), :], mask=k_in[:, None], other=0)
    kseg = plgpu.load(kseg_ref.at[pl.ds(k_start, bk)], mask=k_in, other=-2) if cfg.has_segments else None
    kmask = plgpu.load(kmask_ref.at[pl.ds(k_start, bk)], mask=k_in, other=0) if cfg.has_key_mask else None
    window = win_ref[0] if cfg.has_window else None
    qk_scale = cfg.scale * _LOG2E
    lo, hi = _k_block_bounds(cfg, k_start, bk, bq, window, offset)

    def head_body(g, carry):  # the G query heads that read this kv head
        def q_body(i, carry):
            dk, dv = carry
            q_start = i * bq
            q_rows = q_start + jnp.arange(bq, dtype=jnp.int32)
            q_in = q_rows < cfg.sq
            q = plgpu.load(q_ref.at[pl.ds(q_start, bq), g, :], mask=q_in[:, None], other=0)
            do = plgpu.load(do_ref.at[pl.ds(q_start, bq), g, :], mask=q_in[:, None], other=0)
            lse = plgpu.load(lse_ref.at[g, pl.ds(q_start, bq)], mask=q_in, other=_LSE_MASKED)
            delta = plgpu.load(delta_ref.at[g, pl.ds(q_start, bq)], mask=q_in, other=0.0)
            qseg = (
                plgpu.load(qseg_ref.at[pl.ds(q_start, bq)], mask=q_in, other=-1) if cfg.has_segments else None
            )
            s = _dot(q, k, ((1,), (1,))) * qk_scale  # [bq, bk]
            ok = _allowed(cfg, q_rows, k_cols, qseg, kseg, kmask, window, offset)
            p = jnp.exp2(jnp.where(ok, s, _MASK) - lse[:, None])  # 0 where masked or dead row
            dv = dv + _dot(p.astype(do.dtype), do, ((0,), (0,)))  # P^T dO  [bk, hd]
            dp = _dot(do, v, ((1,), (1,)))
            ds = p * (dp - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, ((0,), (0,)))  # dS^T Q  [bk, hd]
            return dk, dv

        return lax.fori_loop(lo, hi, q_body, carry)

    zeros = jnp.zeros((bk, hd), jnp.float32)
    dk, dv = lax.fori_loop(0, cfg.groups, head_body, (zeros, zeros))
    plgpu.store(dk_ref.at[pl.ds(k_start, bk), :], (dk * cfg.scale).astype(dk_ref.dtype), mask=k_in[:, None])
    plgpu.store(dv_ref.at[pl.ds(k_start, bk), :], dv.astype(dv_ref.dtype), mask=k_in[:, None])


def _bwd_calls(cfg: _Cfg, q, k, v, qseg, kseg, kmask, window, offset, do, lse, delta):
    b, sq, nq, hd = q.shape
    nkv = k.shape[2]
    g = cfg.groups
    aux, aux_specs = _aux_inputs_and_specs(cfg, qseg, kseg, kmask, window, offset)
    params = _params(cfg)
    bwd_flops = lambda dots: _flops(cfg, b * nq * hd, dots, cfg.block_q_bwd, cfg.block_k_bwd)

    # dq: grid over (query blocks, batch, query heads).
    q_spec = pl.BlockSpec((None, sq, None, hd), lambda i, bb, h: (bb, 0, h, 0))
    kv_spec = pl.BlockSpec((None, cfg.sk, None, hd), lambda i, bb, h: (bb, 0, lax.div(h, g), 0))
    row_spec = pl.BlockSpec((None, None, sq), lambda i, bb, h: (bb, h, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(pl.cdiv(sq, cfg.block_q_bwd), b, nq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *aux_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=cfg.interpret,
        name=tagged("zaya_flash_attention_dq", bwd_flops(3)),
    )(q, k, v, do, lse, delta, *aux)

    # dk, dv: grid over (key blocks, batch, kv heads); the G query heads of a group are one block
    # of the head axis (block index h -> heads [h G, (h + 1) G)).
    qg_spec = pl.BlockSpec((None, sq, g, hd), lambda j, bb, h: (bb, 0, h, 0))
    kvo_spec = pl.BlockSpec((None, cfg.sk, None, hd), lambda j, bb, h: (bb, 0, h, 0))
    rowg_spec = pl.BlockSpec((None, g, sq), lambda j, bb, h: (bb, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        grid=(pl.cdiv(cfg.sk, cfg.block_k_bwd), b, nkv),
        in_specs=[qg_spec, kvo_spec, kvo_spec, qg_spec, rowg_spec, rowg_spec, *aux_specs],
        out_specs=[kvo_spec, kvo_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=cfg.interpret,
        name=tagged("zaya_flash_attention_dkv", bwd_flops(4)),
    )(q, k, v, do, lse, delta, *aux)
    return dq, dk, dv


# The residuals of the forward a remat policy can keep by name (jax.ad_checkpoint.checkpoint_name).
FLASH_OUT, FLASH_LSE = "flash_attention_out", "flash_attention_lse"


# ------------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Cfg, q, k, v, qseg, kseg, kmask, window, offset):
    o, lse = _fwd_call(cfg, q, k, v, qseg, kseg, kmask, window, offset)
    return _fix_dead_rows(cfg, o, lse, v)


def _flash_fwd(cfg: _Cfg, q, k, v, qseg, kseg, kmask, window, offset):
    o, lse = _fwd_call(cfg, q, k, v, qseg, kseg, kmask, window, offset)
    o = _fix_dead_rows(cfg, o, lse, v)
    # Named: a remat policy that keeps them (model.remat="matmuls") skips the forward kernel in the
    # backward; the inputs q, k, v are recomputed from the kept projections.
    o, lse = checkpoint_name(o, FLASH_OUT), checkpoint_name(lse, FLASH_LSE)
    return o, (q, k, v, qseg, kseg, kmask, window, offset, o, lse)


def _flash_bwd(cfg: _Cfg, res, do):
    q, k, v, qseg, kseg, kmask, window, offset, o, lse = res
    do = do.astype(q.dtype)
    # delta_s = sum_d o * do (= rowsum(P * dP)); zero on dead rows, whose P is 0 in the kernels.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, 1, 2)  # [B, Nq, Sq]
    dq, dk, dv = _bwd_calls(cfg, q, k, v, qseg, kseg, kmask, window, offset, do, lse, delta)
    # Dead rows output mean_t v[t]: dv[t] += sum over dead (s, head in group) of do / Sk.
    b, _sq, nq, hd = q.shape
    dead = _dead_rows(lse)[..., None].astype(jnp.float32)  # [B, Sq, Nq, 1]
    extra = jnp.sum(dead * do.astype(jnp.float32), axis=1)  # [B, Nq, hd]
    extra = extra.reshape(b, nq // cfg.groups, cfg.groups, hd).sum(axis=2) / cfg.sk
    dv = (dv.astype(jnp.float32) + extra[:, None]).astype(v.dtype)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------ public
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    q_offset: jax.Array | int | None = None,
    flops_offset: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Pallas flash attention (forward + custom_vjp backward); see the module docstring.

    q [B, Sq, Nq, hd], k/v [B, Sk, Nkv, hd] (Nq a multiple of Nkv) -> [B, Sq, Nq, hd] (q.dtype).
    Block sizes default to `pick_blocks("flash_attention", ..., platform)`; given ones must be powers
    of two >= 16 (they are clipped to the next power of two of the sequence lengths).
    `flops_offset`: the static query offset the kernels' FLOP tags count a traced `q_offset` as (the
    mean over the context ranks that run this call); default Sk - Sq, the largest: an upper bound.
    """
    b, sq, nq, hd = q.shape
    _, sk, nkv, hd_k = k.shape
    if k.shape != v.shape or k.shape[0] != b or hd_k != hd:
        raise ValueError(f"flash_attention: shapes q {q.shape}, k {k.shape}, v {v.shape} mismatch")
    if nq % nkv:
        raise ValueError(f"flash_attention: Nq={nq} is not a multiple of Nkv={nkv}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids or neither")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    picked = pick_blocks("flash_attention", {"seq_q": sq, "seq_k": sk, "head_dim": hd}, q.dtype, platform)

    def blk(given, key, seq):
        size = picked[key] if given is None else int(given)
        if size < 16 or size & (size - 1):
            raise ValueError(f"flash_attention: {key}={size} must be a power of two >= 16")
        return max(16, min(size, pl.next_power_of_2(seq)))

    cfg = _Cfg(
        scale=float(scale),
        causal=bool(causal),
        sq=sq,
        sk=sk,
        groups=nq // nkv,
        block_q=blk(block_q, "block_q", sq),
        block_k=blk(block_k, "block_k", sk),
        block_q_bwd=blk(block_q_bwd, "block_q_bwd", sq),
        block_k_bwd=blk(block_k_bwd, "block_k_bwd", sk),
        has_segments=q_segment_ids is not None,
        has_key_mask=key_mask is not None,
        has_window=sliding_window is not None,
        has_offset=q_offset is not None,
        flops_offset=sk - sq if flops_offset is None or q_offset is None else int(flops_offset),
        num_warps=picked["num_warps"] if num_warps is None else num_warps,
        num_stages=picked["num_stages"] if num_stages is None else num_stages,
        interpret=bool(interpret),
    )
    if sq == 0 or sk == 0 or b == 0:
        return jnp.zeros(q.shape, q.dtype)
    qseg = kseg = kmask = window = None
    if cfg.has_segments:
        qseg = jnp.asarray(q_segment_ids, jnp.int32).reshape(b, sq)
        kseg = jnp.asarray(kv_segment_ids, jnp.int32).reshape(b, sk)
    if cfg.has_key_mask:
        kmask = jnp.asarray(key_mask).astype(jnp.int32).reshape(b, sk)
    if cfg.has_window:
        window = jnp.asarray(sliding_window, jnp.int32).reshape(1)
    offset = None if q_offset is None else jnp.asarray(q_offset, jnp.int32).reshape(1)
    hd_p = max(16, pl.next_power_of_2(hd))
    if hd_p != hd:  # Triton tiles are powers of two: zero-pad the head dim (exact).
        pad = [(0, 0), (0, 0), (0, 0), (0, hd_p - hd)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    out = _flash(cfg, q, k, v, qseg, kseg, kmask, window, offset)
    return out[..., :hd] if hd_p != hd else out


def reference_mask(
    sq: int,
    sk: int,
    *,
    batch: int,
    causal: bool = True,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    q_offset: jax.Array | int | None = None,
) -> jax.Array:
    """bool [B, Sq, Sk]: `attention_allowed` with positions arange (queries offset by q_offset,
    default Sk - Sq); causal=False drops only the causal term."""
    offset = sk - sq if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_pos = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32) + offset, (batch, sq))
    kv_pos = jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (batch, sk))
    allowed = jnp.ones((batch, sq, sk), bool)
    if causal:
        allowed &= kv_pos[:, None, :] <= q_pos[:, :, None]
    if key_mask is not None:
        allowed &= jnp.asarray(key_mask).astype(bool)[:, None, :]
    if q_segment_ids is not None:
        allowed &= jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None, :]
    if sliding_window is not None:
        w = jnp.asarray(sliding_window)
        allowed &= (w <= 0) | (kv_pos[:, None, :] > q_pos[:, :, None] - w)
    return allowed


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    sliding_window: jax.Array | int | None = None,
    q_offset: jax.Array | int | None = None,
    **unused,
) -> jax.Array:
    """Pure-XLA flash_attention: the model's `xla_attention` with `reference_mask`."""
    del unused  # block sizes / interpret, so the two functions take the same keywords
    allowed = reference_mask(
        q.shape[1],
        k.shape[1],
        batch=q.shape[0],
        causal=causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        key_mask=key_mask,
        sliding_window=sliding_window,
        q_offset=q_offset,
    )
    return xla_attention(q, k, v, allowed, scale)
