"""Muon's quintic Newton-Schulz iteration: the XLA version and Pallas (Triton lowering) kernels.

    orthogonalize(x [..., m, n], *, ns_coeffs=(a, b, c), ns_steps=5, ns_dtype=float32, eps=1e-8)
        -> [..., m, n] in x.dtype          plain XLA: the optimizer's default and the reference
    newton_schulz(x, same keywords, block=..., interpret=...)       the Pallas kernels below

The design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.kernels.block_sizes import pick_blocks
from zaya_jax.kernels.flops import padded, tagged

DEFAULT_NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


def validate_ns_coeffs(ns_coeffs: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, c) as floats; ValueError unless a triple."""
    coeffs = tuple(float(c) for c in ns_coeffs)
    if len(coeffs) != 3:
        raise ValueError(f"ns_coeffs must be a triple (a, b, c), got {ns_coeffs!r}")
    return coeffs  # type: ignore[return-value]


def orthogonalize(
    x: jax.Array,
    *,
    ns_coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    ns_dtype: Any = jnp.float32,
    eps: float = 1e-8,
    per_slice: bool = False,
) -> jax.Array:
    """Approximate ``U V^T`` of each [m, n] slice of x [..., m, n] with the quintic Newton-Schulz
    iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T`` (m <= n; for m > n the transposed form
    ``X <- a X + X (b A + c A^2)``, ``A = X^T X``, which is the same iteration on X^T).

    ns_dtype: dtype the iteration runs in (float32 or bfloat16); eps: added to each slice's
    Frobenius norm. Returns [..., m, n] in x.dtype. With the default coefficients the singular
    values land roughly in [0.7, 1.2] rather than exactly 1: the coefficients trade exactness for a
    steep slope at 0 so small singular values grow fast.

    per_slice: iterate the slices one after the other (a loop of 2-D matmul chains) instead of as
    one batched chain: faster on XLA:CPU for Muon's expert stacks (docs/performance.md), and its temporaries are
    one slice's, not the stack's (kernels.NS_PER_SLICE says where the optimizer asks for it).
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs ndim >= 2 ([..., m, n]), got shape {x.shape}")
    a, b, c = validate_ns_coeffs(ns_coeffs)
    ns = functools.partial(
        _orthogonalize_stack, coeffs=(a, b, c), ns_steps=ns_steps, ns_dtype=jnp.dtype(ns_dtype), eps=eps
    )
    if not per_slice or x.ndim == 2:
        return ns(x)
    # Each result overwrites its own slice of the stack (read just before): no second stack-sized
    # buffer (lax.map's output would be one, zero-filled whenever XLA likes).
    def one(i, x_bmn):
        x_mn = lax.dynamic_index_in_dim(x_bmn, i, keepdims=False)
        return lax.dynamic_update_index_in_dim(x_bmn, ns(x_mn), i, 0)

    flat = x.reshape(-1, *x.shape[-2:])
    return lax.fori_loop(0, flat.shape[0], one, flat).reshape(x.shape)


def _orthogonalize_stack(x: jax.Array, *, coeffs, ns_steps: int, ns_dtype, eps: float) -> jax.Array:
    """`orthogonalize` of x [..., m, n] in one batched chain (the temporaries are x-sized)."""
    a, b, c = coeffs
    # Asking for float32 should mean float32: without HIGHEST, GPUs/TPUs may run fp32 matmuls in
    # TF32/bf16 passes and the iteration loses its accuracy.
    precision = lax.Precision.HIGHEST if ns_dtype == jnp.float32 else None
    nb = x.ndim - 2
    batch = (tuple(range(nb)), tuple(range(nb)))
    # Contract the long axis: the Gram matrix is [min, min], the cheaper product, and no
    # transposed copy of the [..., m, n] stack is ever materialised.
    tall = x.shape[-2] > x.shape[-1]
    long_axis = nb if tall else nb + 1

    def gram(x):
        return lax.dot_general(x, x, (((long_axis,), (long_axis,)), batch), precision=precision)

    def apply(poly, x):  # tall: X P; wide: P X (P symmetric, [min, min])
        p, q = (x, poly) if tall else (poly, x)
        return jnp.matmul(p, q, precision=precision)

    out_dtype = x.dtype
    # Frobenius normalisation bounds the spectral norm by 1, inside NS's basin of convergence.
    # Computed in fp32 so a bf16 ns_dtype does not lose the scale.
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True))
    x = (x32 / (norm + eps)).astype(ns_dtype)
    for _ in range(ns_steps):
        g = gram(x)
        poly = b * g + c * jnp.matmul(g, g, precision=precision)
        x = a * x + apply(poly, x)
    return x.astype(out_dtype)


def _dot(a, b, contract):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _mm_kernel(p_ref, q_ref, *refs, alpha, beta, trans_q, symmetric, bs, bk, rows, cols, red):
    """out = alpha * c + beta * (P @ Q) (Q^T if trans_q) for one [bs, bs] tile of one matrix."""
    if alpha:
        c_ref, out_ref = refs
    else:
        (out_ref,) = refs
    i = pl.program_id(1)
    j = pl.program_id(2)
    r_idx = i * bs + jnp.arange(bs, dtype=jnp.int32)
    c_idx = j * bs + jnp.arange(bs, dtype=jnp.int32)
    r_in = r_idx < rows
    c_in = c_idx < cols

    def tile():
        def body(kk, acc):
            k0 = kk * bk
            k_in = (k0 + jnp.arange(bk, dtype=jnp.int32)) < red
            a = plgpu.load(
                p_ref.at[pl.ds(i * bs, bs), pl.ds(k0, bk)], mask=r_in[:, None] & k_in[None, :], other=0
            )
            if trans_q:  # Q^T: rows j of Q [cols, red]
                b = plgpu.load(
                    q_ref.at[pl.ds(j * bs, bs), pl.ds(k0, bk)], mask=c_in[:, None] & k_in[None, :], other=0
                )
                return acc + _dot(a, b, ((1,), (1,)))
            b = plgpu.load(
                q_ref.at[pl.ds(k0, bk), pl.ds(j * bs, bs)], mask=k_in[:, None] & c_in[None, :], other=0
            )
            return acc + _dot(a, b, ((1,), (0,)))

        acc = lax.fori_loop(0, pl.cdiv(red, bk), body, jnp.zeros((bs, bs), jnp.float32))
        mask = r_in[:, None] & c_in[None, :]
        if beta != 1.0:
            acc = beta * acc
        if alpha:  # fused fp32 epilogue, one rounding to ns_dtype
            c = plgpu.load(c_ref.at[pl.ds(i * bs, bs), pl.ds(j * bs, bs)], mask=mask, other=0)
            acc = acc + alpha * c.astype(jnp.float32)
        out = acc.astype(out_ref.dtype)
        plgpu.store(out_ref.at[pl.ds(i * bs, bs), pl.ds(j * bs, bs)], out, mask=mask)
        if symmetric:  # mirror the tile into (j, i); the diagonal tile rewrites itself identically
            plgpu.store(out_ref.at[pl.ds(j * bs, bs), pl.ds(i * bs, bs)], out.T, mask=mask.T)

    if symmetric:
        pl.when(i <= j)(tile)
    else:
        tile()


def _mm(
    p,
    q,
    c,
    *,
    alpha: float,
    beta: float,
    trans_q: bool,
    symmetric: bool,
    bs: int,
    bk: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Batched alpha * c + beta * (p @ q or p @ q^T), [Bt, rows, cols] in p.dtype."""
    bt, rows, red = p.shape
    cols = q.shape[1] if trans_q else q.shape[2]
    kernel = functools.partial(
        _mm_kernel,
        alpha=alpha,
        beta=beta,
        trans_q=trans_q,
        symmetric=symmetric,
        bs=bs,
        bk=bk,
        rows=rows,
        cols=cols,
        red=red,
    )
    mat = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda b, i, j: (b, 0, 0))
    args = [p, q] + ([c] if alpha else [])
    nb = pl.cdiv(rows, bs), pl.cdiv(cols, bs)
    tiles = nb[0] * (nb[0] + 1) // 2 if symmetric else nb[0] * nb[1]  # symmetric: tiles i <= j
    return pl.pallas_call(
        kernel,
        grid=(bt, *nb),
        in_specs=[mat(a) for a in args],
        out_specs=pl.BlockSpec((None, rows, cols), lambda b, i, j: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((bt, rows, cols), p.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=tagged("zaya_ns_matmul", 2 * bt * tiles * bs * bs * padded(red, bk)),
    )(*args)


def newton_schulz(
    x: jax.Array,
    *,
    ns_coeffs: Sequence[float] = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    eps: float = 1e-8,
    ns_dtype: Any = jnp.float32,
    block: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Pallas `orthogonalize`: approximate U V^T of each [m, n] slice of x [..., m, n] (tall slices
    are transposed in and out: the kernels only do the wide case). platform: the GPU it is
    compiled for (block_sizes.pick_blocks: warps)."""
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs ndim >= 2 ([..., m, n]), got shape {x.shape}")
    a, b, c = validate_ns_coeffs(ns_coeffs)
    ns_dtype = jnp.dtype(ns_dtype)
    out_dtype = x.dtype
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    lead, (m, n) = x.shape[:-2], x.shape[-2:]
    if x.size == 0:
        y = x.astype(out_dtype)
        return jnp.swapaxes(y, -1, -2) if transposed else y
    x32 = x.astype(jnp.float32).reshape(-1, m, n)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True))
    xs = (x32 / (norm + eps)).astype(ns_dtype)

    picked = pick_blocks("newton_schulz", {"m": m, "n": n}, ns_dtype, platform)

    def blk(given, key):
        size = picked[key] if given is None else int(given)
        if size < 16 or size & (size - 1):
            raise ValueError(f"newton_schulz: {key}={size} must be a power of two >= 16")
        return max(16, min(size, pl.next_power_of_2(m)))

    kw = dict(
        bs=blk(block, "block"),
        bk=blk(block_k, "block_k"),
        num_warps=num_warps or picked["num_warps"],
        num_stages=num_stages or picked["num_stages"],
        interpret=bool(interpret),
    )

    def step(_, xs):
        gram = _mm(xs, xs, None, alpha=0.0, beta=1.0, trans_q=True, symmetric=True, **kw)
        poly = _mm(gram, gram, gram, alpha=b, beta=c, trans_q=True, symmetric=True, **kw)
        return _mm(poly, xs, xs, alpha=a, beta=1.0, trans_q=False, symmetric=False, **kw)

    xs = lax.fori_loop(0, ns_steps, step, xs)
    y = xs.reshape(*lead, m, n)
    if transposed:
        y = jnp.swapaxes(y, -1, -2)
    return y.astype(out_dtype)


def reference_newton_schulz(x: jax.Array, **kwargs) -> jax.Array:
    """`orthogonalize` (the XLA reference) with the kernel's signature; extra keywords ignored."""
    keep = {k: v for k, v in kwargs.items() if k in ("ns_coeffs", "ns_steps", "ns_dtype", "eps")}
    return orthogonalize(x, **keep)
