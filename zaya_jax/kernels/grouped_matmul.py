"""Grouped (ragged) matmul for the MoE experts: Pallas (Triton lowering) gmm + tgmm, custom_vjp.

    grouped_matmul(lhs [T, K], rhs [G, K, N], group_sizes [G]) -> [T, N]
      out[r] = lhs[r] @ rhs[g(r)] for the rows r of group g (consecutive rows, group 0 first);
      rows past sum(group_sizes) are 0. Same contract as `jax.lax.ragged_dot` (the reference).
    tgmm(lhs [T, K], dout [T, N], group_sizes [G]) -> [G, K, N]
      out[g] = lhs_g^T dout_g (the weight gradient; an empty group gives zeros).

The design: docs/design/kernels.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax.kernels.block_sizes import pick_blocks
from zaya_jax.kernels.flops import grouped_tiles, padded, tagged


def _dot(a, b, contract=((1,), (0,))):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _compute_dtype(a_dtype, b_dtype):
    """Operand dtype of a mixed-dtype dot: the narrower of the two (bf16 x fp32 cotangent -> bf16,
    the usual mixed-precision backward); equal dtypes are kept."""
    a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
    return a_dtype if a_dtype.itemsize <= b_dtype.itemsize else b_dtype


def _check_block(name: str, size: int) -> int:
    size = int(size)
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name}={size} must be a power of two >= 16 (Triton tile rules)")
    return size


# ------------------------------------------------------------------------------------ tile list
def num_tiles(t: int, g: int, block_m: int) -> int:
    """Static bound on the number of block_m-row tiles of G groups + the tail over T rows."""
    return t // block_m + g + 1


def group_offsets(group_sizes: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    """(starts [G], sizes [G]) int32, clipped to the T rows (rows past T do not exist)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), t)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends - starts


def make_tiles(group_sizes: jax.Array, t: int, block_m: int):
    """Tile list over G groups + the tail: (tile_group, tile_start, tile_end) int32 [num_tiles].

    tile_group == G marks a tail tile (rows past sum(group_sizes): written as zeros); unused
    entries have tile_start == tile_end (no rows).
    """
    g = group_sizes.shape[0]
    starts, sizes = group_offsets(group_sizes, t)
    tail_start = starts[-1] + sizes[-1] if g else jnp.int32(0)
    starts = jnp.concatenate([starts, jnp.reshape(tail_start, (1,))])
    sizes = jnp.concatenate([sizes, jnp.reshape(t - tail_start, (1,))])
    ntiles = (sizes + block_m - 1) // block_m  # [G + 1]
    cum = jnp.cumsum(ntiles)
    n = num_tiles(t, g, block_m)
    tid = jnp.arange(n, dtype=jnp.int32)
    grp = jnp.searchsorted(cum, tid, side="right").astype(jnp.int32)
    valid = tid < cum[-1]
    grp = jnp.where(valid, grp, g)
    grp_c = jnp.minimum(grp, g)
    local = tid - (cum[grp_c] - ntiles[grp_c])
    tile_start = jnp.where(valid, starts[grp_c] + local * block_m, 0)
    tile_end = jnp.where(valid, starts[grp_c] + sizes[grp_c], 0)
    return grp.astype(jnp.int32), tile_start.astype(jnp.int32), tile_end.astype(jnp.int32)


# ------------------------------------------------------------------------------------------- gmm
def _gmm_kernel(
    tg_ref,
    ts_ref,
    te_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    bm,
    bn,
    bk,
    k_dim,
    n_dim,
    groups,
    transpose_rhs,
    compute_dtype,
):
    t = pl.program_id(0)
    j = pl.program_id(1)
    g = tg_ref[t]
    r0 = ts_ref[t]
    r1 = te_ref[t]
    rows = r0 + jnp.arange(bm, dtype=jnp.int32)
    row_in = rows < r1
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    col_in = cols < n_dim
    gi = jnp.minimum(g, groups - 1)  # tail tiles (g == G) read nothing: zero K iterations
    nk = (g < groups).astype(jnp.int32) * pl.cdiv(k_dim, bk)  # (a where() of two Python ints
    # lowers to a mistyped scf.for bound in Triton)

    def body(kk, acc):
        k0 = kk * bk
        k_in = (k0 + jnp.arange(bk, dtype=jnp.int32)) < k_dim
        a = plgpu.load(
            lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=row_in[:, None] & k_in[None, :], other=0
        )
        if transpose_rhs:  # rhs [G, N, K]: b tile [bn, bk]
            b = plgpu.load(
                rhs_ref.at[gi, pl.ds(j * bn, bn), pl.ds(k0, bk)],
                mask=col_in[:, None] & k_in[None, :],
                other=0,
            )
            contract = ((1,), (1,))
        else:  # rhs [G, K, N]: b tile [bk, bn]
            b = plgpu.load(
                rhs_ref.at[gi, pl.ds(k0, bk), pl.ds(j * bn, bn)],
                mask=k_in[:, None] & col_in[None, :],
                other=0,
            )
            contract = ((1,), (0,))
        return acc + _dot(a.astype(compute_dtype), b.astype(compute_dtype), contract)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)],
        acc.astype(out_ref.dtype),
        mask=row_in[:, None] & col_in[None, :],
    )


def _gmm_call(
    lhs,
    rhs,
    group_sizes,
    *,
    transpose_rhs,
    out_dtype,
    block_m,
    block_n,
    block_k,
    num_warps,
    num_stages,
    interpret,
):
    t, k_dim = lhs.shape
    groups = rhs.shape[0]
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if t == 0 or n_dim == 0:
        return jnp.zeros((t, n_dim), out_dtype)
    if groups == 0 or k_dim == 0:
        return jnp.zeros((t, n_dim), out_dtype)
    tg, ts, te = make_tiles(group_sizes, t, block_m)
    n_tiles = tg.shape[0]
    kernel = functools.partial(
        _gmm_kernel,
        bm=block_m,
        bn=block_n,
        bk=block_k,
        k_dim=k_dim,
        n_dim=n_dim,
        groups=groups,
        transpose_rhs=transpose_rhs,
        compute_dtype=_compute_dtype(lhs.dtype, rhs.dtype),
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    used_tiles = min(n_tiles, grouped_tiles(t, groups, block_m))  # the tail's tiles run no dot
    flops = 2 * used_tiles * block_m * padded(n_dim, block_n) * padded(k_dim, block_k)
    return pl.pallas_call(
        kernel,
        grid=(n_tiles, pl.cdiv(n_dim, block_n)),
        in_specs=[
            whole((n_tiles,)),
            whole((n_tiles,)),
            whole((n_tiles,)),
            whole(lhs.shape),
            whole(rhs.shape),
        ],
        out_specs=whole((t, n_dim)),
        out_shape=jax.ShapeDtypeStruct((t, n_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=tagged("zaya_gmm", flops),
    )(tg, ts, te, lhs, rhs)


# ------------------------------------------------------------------------------------------ tgmm
def _tgmm_kernel(st_ref, sz_ref, lhs_ref, dout_ref, out_ref, *, bm, bk, bn, k_dim, n_dim, compute_dtype):
    g = pl.program_id(0)
    i = pl.program_id(1)
    j = pl.program_id(2)
    start = st_ref[g]
    size = sz_ref[g]
    end = start + size
    k_in = (i * bk + jnp.arange(bk, dtype=jnp.int32)) < k_dim
    n_in = (j * bn + jnp.arange(bn, dtype=jnp.int32)) < n_dim

    def body(mm, acc):
        r0 = start + mm * bm
        row_in = (r0 + jnp.arange(bm, dtype=jnp.int32)) < end
        a = plgpu.load(
            lhs_ref.at[pl.ds(r0, bm), pl.ds(i * bk, bk)], mask=row_in[:, None] & k_in[None, :], other=0
        )
        d = plgpu.load(
            dout_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], mask=row_in[:, None] & n_in[None, :], other=0
        )
        return acc + _dot(a.astype(compute_dtype), d.astype(compute_dtype), ((0,), (0,)))

    acc = lax.fori_loop(0, lax.div(size + (bm - 1), bm), body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(
        out_ref.at[pl.ds(i * bk, bk), pl.ds(j * bn, bn)],
        acc.astype(out_ref.dtype),
        mask=k_in[:, None] & n_in[None, :],
    )


def tgmm(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    block_n: int | None = None,
    out_dtype=None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Transposed grouped matmul: out[g] = lhs_g^T dout_g, [G, K, N] (zeros for empty groups).

    lhs [T, K], dout [T, N], group_sizes [G]; rows past sum(group_sizes) are ignored. Operands are
    cast per tile to the narrower of the two dtypes, fp32 accumulation; out_dtype defaults to
    lhs.dtype.
    """
    t, k_dim = lhs.shape
    n_dim = dout.shape[1]
    groups = group_sizes.shape[0]
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    cdt = _compute_dtype(lhs.dtype, dout.dtype)
    picked = pick_blocks("tgmm", {"m": t, "k": k_dim, "n": n_dim, "groups": groups}, cdt, platform)
    bm = _block("block_m", block_m, picked["block_m"], t)
    bk = _block("block_k", block_k, picked["block_k"], k_dim)
    bn = _block("block_n", block_n, picked["block_n"], n_dim)
    if groups == 0 or k_dim == 0 or n_dim == 0 or t == 0:
        return jnp.zeros((groups, k_dim, n_dim), out_dtype)
    starts, sizes = group_offsets(group_sizes, t)
    kernel = functools.partial(
        _tgmm_kernel,
        bm=bm,
        bk=bk,
        bn=bn,
        k_dim=k_dim,
        n_dim=n_dim,
        compute_dtype=_compute_dtype(lhs.dtype, dout.dtype),
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda g, i, j: (0,) * len(shape))
    flops = 2 * grouped_tiles(t, groups, bm) * bm * padded(k_dim, bk) * padded(n_dim, bn)
    return pl.pallas_call(
        kernel,
        grid=(groups, pl.cdiv(k_dim, bk), pl.cdiv(n_dim, bn)),
        in_specs=[whole((groups,)), whole((groups,)), whole(lhs.shape), whole(dout.shape)],
        out_specs=pl.BlockSpec((None, k_dim, n_dim), lambda g, i, j: (g, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((groups, k_dim, n_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or picked["num_warps"], num_stages=num_stages or picked["num_stages"]
        ),
        interpret=interpret,
        name=tagged("zaya_tgmm", flops),
    )(starts, sizes, lhs, dout)


# The output a remat policy can keep by name (jax.ad_checkpoint.checkpoint_name).
GMM_OUT = "grouped_matmul_out"


# ------------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs, rhs, group_sizes, opts):
    o = dict(opts)
    return _gmm_call(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=False,
        out_dtype=o["out_dtype"],
        block_m=o["block_m"],
        block_n=o["block_n"],
        block_k=o["block_k"],
        num_warps=o["num_warps"],
        num_stages=o["num_stages"],
        interpret=o["interpret"],
    )


def _gmm_fwd(lhs, rhs, group_sizes, opts):
    # Named: a remat policy that keeps it (model.remat="matmuls") recomputes no grouped matmul in the
    # backward (the SwiGLU's second input is elementwise work on the first's output).
    return checkpoint_name(_gmm(lhs, rhs, group_sizes, opts), GMM_OUT), (lhs, rhs, group_sizes)


def _gmm_bwd(opts, res, dout):
    lhs, rhs, group_sizes = res
    o = dict(opts)
    # dlhs [T, K] = gmm(dout [T, N], rhs^T): the same kernel reading rhs transposed (no copy of
    # the weights); its output tile runs over K and its reduction over N. Tail rows get zeros.
    dlhs = _gmm_call(
        dout,
        rhs,
        group_sizes,
        transpose_rhs=True,
        out_dtype=lhs.dtype,
        block_m=o["block_m"],
        block_n=o["bwd_block_out"],
        block_k=o["bwd_block_red"],
        num_warps=o["num_warps"],
        num_stages=o["num_stages"],
        interpret=o["interpret"],
    )
    drhs = tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype, interpret=o["interpret"], platform=o["platform"])
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _block(name: str, given: int | None, picked: int, dim: int) -> int:
    """A given block (validated) or the picked one, clipped to the dimension's next power of 2."""
    size = _check_block(name, picked if given is None else given)
    return max(16, min(size, pl.next_power_of_2(max(dim, 1))))


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    preferred_element_type=None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Pallas ragged_dot: lhs [T, K], rhs [G, K, N], group_sizes [G] int -> [T, N].

    Rows of group g (consecutive, in group order) are multiplied by rhs[g]; rows past
    sum(group_sizes) are 0. Output dtype: preferred_element_type, default lhs.dtype (as
    `jax.lax.ragged_dot`). Differentiable in lhs and rhs (custom_vjp with Pallas kernels); block
    sizes default to `pick_blocks("grouped_matmul", ..., platform)`.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul: want lhs [T,K], rhs [G,K,N], group_sizes [G]; got "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    t, k_dim = lhs.shape
    groups, k2, n_dim = rhs.shape
    if k2 != k_dim or group_sizes.shape[0] != groups:
        raise ValueError(f"grouped_matmul: mismatched shapes {lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    cdt = _compute_dtype(lhs.dtype, rhs.dtype)
    picked = pick_blocks("grouped_matmul", {"m": t, "k": k_dim, "n": n_dim, "groups": groups}, cdt, platform)
    # The backward's dlhs = dout [T, N] @ rhs^T [N, K] swaps the roles of K and N.
    bwd = pick_blocks("grouped_matmul", {"m": t, "k": n_dim, "n": k_dim, "groups": groups}, cdt, platform)
    opts = (
        ("block_m", _block("block_m", block_m, picked["block_m"], t)),
        ("block_n", _block("block_n", block_n, picked["block_n"], n_dim)),
        ("block_k", _block("block_k", block_k, picked["block_k"], k_dim)),
        ("bwd_block_out", bwd["block_n"]),
        ("bwd_block_red", bwd["block_k"]),
        ("out_dtype", jnp.dtype(preferred_element_type or lhs.dtype)),
        ("num_warps", num_warps or picked["num_warps"]),
        ("num_stages", num_stages or picked["num_stages"]),
        ("interpret", bool(interpret)),
        ("platform", platform),
    )
    return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), opts)


def reference_grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None, **unused
) -> jax.Array:
    """`jax.lax.ragged_dot` (the XLA reference)."""
    del unused
    return jax.lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=preferred_element_type
    )


def swiglu_grouped_pallas(
    x_sorted_md: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    group_sizes_e: jax.Array,
    act: Callable,
    interpret: bool = False,
    platform: str | None = None,
    **block_kwargs,
) -> jax.Array:
    """`zaya_jax.model.moe.swiglu_grouped` on the Pallas grouped matmul: expert-sorted tokens
    [T, d] -> fp32 [T, d], rows past sum(group_sizes) are 0.

    h = x G|U (fp32 out), a = (act(gate) * up) cast to x's dtype, y = a D (fp32 out); gradients
    through both grouped matmuls are the Pallas gmm/tgmm kernels.
    """
    h = grouped_matmul(
        x_sorted_md,
        gate_up_edf,
        group_sizes_e,
        preferred_element_type=jnp.float32,
        interpret=interpret,
        platform=platform,
        **block_kwargs,
    )
    gate, up = jnp.split(h, 2, axis=-1)
    a = (act(gate) * up).astype(x_sorted_md.dtype)
    return grouped_matmul(
        a,
        down_efd,
        group_sizes_e,
        preferred_element_type=jnp.float32,
        interpret=interpret,
        platform=platform,
        **block_kwargs,
    )
