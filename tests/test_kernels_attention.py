"""Pallas flash attention (interpret mode on CPU) vs the XLA reference: values and dq/dk/dv.

Shapes are tiny (interpret mode runs the kernel body as XLA ops); each case is one jit of the
kernel's forward + backward and the reference's, compiled with cheap XLA options. Error metric:
max|a - b| / max|b| (fp32 within 1e-5, bf16 within 2e-2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.kernel_lowering import lowered_triton_kernels
from support.xla_env import FAST_COMPILE

from zaya_jax.kernels import flash_attention, reference_attention, reference_mask
from zaya_jax.kernels.flops import causal_pairs
from zaya_jax.model.attention import MASK_VALUE, attention_allowed, xla_attention

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(a, b, floor: float = 1e-30) -> float:
    """max|a - b| / max|b| (the denominator floored at `floor` for an all-zero reference)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))


ERRORS: dict = {}  # (test, dtype) -> {output: rel_err}; printed by test_zz_report with -s


def current_test() -> str:
    import os

    return os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]


def run_compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def make_qkv(b, sq, sk, nq, nkv, hd, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, nq, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, nkv, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, nkv, hd), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, nq, hd), jnp.float32).astype(dtype)
    return q, k, v, do


def value_and_grads(attn, kw):
    """jit-able (q, k, v, do, *masks) -> (out, dq, dk, dv) of `attn` with keywords kw(*masks)."""

    def fn(q, k, v, do, *masks):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **kw(*masks)), q, k, v)
        return (out, *vjp(do))

    return fn


def compare(q, k, v, do, masks, kw, *, kernel_kw, dtype, floor=1e-30, names=("out", "dq", "dk", "dv")):
    """Kernel vs reference in one compiled program; returns {name: rel_err} after asserting."""
    kern = value_and_grads(lambda *a, **k: flash_attention(*a, interpret=True, **kernel_kw, **k), kw)
    ref = value_and_grads(reference_attention, kw)
    both = run_compiled(lambda *a: (kern(*a), ref(*a)), q, k, v, do, *masks)
    got, want = both(q, k, v, do, *masks)
    errs = {n: rel_err(g, w, floor) for n, g, w in zip(names, got, want)}
    ERRORS[(current_test(), str(jnp.dtype(dtype)))] = errs
    for n, g in zip(names, got):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), n
    assert max(errs.values()) < TOL[dtype], errs
    return errs, both


def segments(b, s, seed):
    """Packed-document ids [B, S]: random boundaries, non-decreasing."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.cumsum(rng.random((b, s)) < 0.15, axis=1), jnp.int32)


# ------------------------------------------------------------------------------------------ cases
def test_causal_gqa2_ragged_seq_fp32():
    """Causal, G = 2, seq 37 with blocks 16 (three partial tiles), different fwd/bwd blocks."""
    q, k, v, do = make_qkv(2, 37, 37, 4, 2, 16, jnp.float32)
    compare(
        q,
        k,
        v,
        do,
        (),
        lambda: dict(scale=0.25),
        dtype=jnp.float32,
        kernel_kw=dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16),
    )


def test_mha_segments_key_mask_dead_rows_fp32():
    """G = 1; packed documents + padding. Batch 1 is left-padded: its first query rows see no key
    (fully masked) and must reproduce the XLA path's mean-of-values convention, grads included."""
    b, s = 2, 29
    q, k, v, do = make_qkv(b, s, s, 2, 2, 16, jnp.float32, seed=1)
    seg = segments(b, s, seed=1)
    key_mask = jnp.ones((b, s), jnp.int32).at[1, :6].set(0).at[0, 25:].set(0)
    allowed = reference_mask(s, s, batch=b, q_segment_ids=seg, kv_segment_ids=seg, key_mask=key_mask)
    assert not bool(jnp.any(allowed[1, :6], axis=-1).any())  # the case under test exists
    compare(
        q,
        k,
        v,
        do,
        (seg, key_mask),
        lambda seg, km: dict(scale=0.3, q_segment_ids=seg, kv_segment_ids=seg, key_mask=km),
        dtype=jnp.float32,
        kernel_kw=dict(block_q=16, block_k=16),
    )


def test_gqa4_segments_traced_sliding_window_fp32():
    """G = 4 (one kv head), segments, a traced window (as scanned over layers): one compile serves
    w = 5, w = 16 and w = 0 (no window)."""
    b, s = 1, 45
    q, k, v, do = make_qkv(b, s, s, 4, 1, 16, jnp.float32, seed=2)
    seg = segments(b, s, seed=2)
    _errs, both = compare(
        q,
        k,
        v,
        do,
        (seg, jnp.int32(5)),
        lambda seg, w: dict(scale=0.25, q_segment_ids=seg, kv_segment_ids=seg, sliding_window=w),
        dtype=jnp.float32,
        kernel_kw=dict(block_q=16, block_k=16),
    )
    for w in (16, 0):
        got, want = both(q, k, v, do, seg, jnp.int32(w))
        e = [rel_err(g, r) for g, r in zip(got, want)]
        assert max(e) < 1e-5, (w, e)


def test_non_causal_key_mask_static_window_fp32():
    """causal=False (only the mask terms apply), key padding, a static Python-int window."""
    b, s = 2, 33
    q, k, v, do = make_qkv(b, s, s, 4, 2, 16, jnp.float32, seed=3)
    key_mask = jnp.ones((b, s), jnp.int32).at[0, 20:].set(0)
    compare(
        q,
        k,
        v,
        do,
        (key_mask,),
        lambda km: dict(scale=0.25, causal=False, key_mask=km, sliding_window=7),
        dtype=jnp.float32,
        kernel_kw=dict(block_q=16, block_k=16),
    )


def test_bf16_segments_padding():
    b, s = 2, 40
    q, k, v, do = make_qkv(b, s, s, 4, 2, 32, jnp.bfloat16, seed=4)
    seg = segments(b, s, seed=4)
    key_mask = jnp.ones((b, s), jnp.int32).at[1, :3].set(0)
    _errs, _ = compare(
        q,
        k,
        v,
        do,
        (seg, key_mask),
        lambda seg, km: dict(scale=32**-0.5, q_segment_ids=seg, kv_segment_ids=seg, key_mask=km),
        dtype=jnp.bfloat16,
        kernel_kw=dict(block_q=16, block_k=16),
    )


def test_one_token():
    """One query, one key: softmax is exactly 1, so dq = dk = 0 in exact arithmetic (the kernel
    leaves ~1e-7 of rounding): errors are relative to max(max|ref|, 1)."""
    q, k, v, do = make_qkv(1, 1, 1, 2, 1, 16, jnp.float32, seed=5)
    compare(q, k, v, do, (), lambda: dict(scale=0.25), dtype=jnp.float32, kernel_kw={}, floor=1.0)


def test_shorter_queries_and_odd_head_dim():
    """Sq < Sk (queries are the last Sq positions) and head_dim 24 (zero-padded to 32)."""
    q, _, _, do = make_qkv(1, 20, 20, 4, 2, 24, jnp.float32, seed=6)
    _, k, v, _ = make_qkv(1, 37, 37, 4, 2, 24, jnp.float32, seed=7)
    compare(
        q,
        k,
        v,
        do,
        (jnp.int32(9),),
        lambda w: dict(scale=0.2, sliding_window=w),
        dtype=jnp.float32,
        kernel_kw=dict(block_q=16, block_k=16),
    )


def test_traced_query_offset_is_a_context_ranks_chunk_fp32():
    """A traced q_offset (a context rank's query chunk against the gathered keys): one compile
    serves ranks 0, 1 and 2 of three 16-row chunks of 48 keys, G = 2, segments, padding and a
    window; each equals the reference with that offset, and that reference equals the rows of
    whole-sequence attention the chunk holds (what the rank owns)."""
    b, s, rows = 2, 48, 16
    q_all, k, v, do_all = make_qkv(b, s, s, 4, 2, 16, jnp.float32, seed=8)
    seg = segments(b, s, seed=8)
    key_mask = jnp.ones((b, s), jnp.int32).at[1, :5].set(0)
    kw = lambda qseg, seg, km, off: dict(
        scale=0.25, q_segment_ids=qseg, kv_segment_ids=seg, key_mask=km, sliding_window=20, q_offset=off
    )
    whole = reference_attention(
        q_all, k, v, scale=0.25, q_segment_ids=seg, kv_segment_ids=seg, key_mask=key_mask, sliding_window=20
    )
    both = None
    for r in range(3):
        chunk = slice(r * rows, (r + 1) * rows)
        q, do = q_all[:, chunk], do_all[:, chunk]
        masks = (seg[:, chunk], seg, key_mask, jnp.int32(r * rows))
        if both is None:
            blocks = dict(block_q=16, block_k=16)
            _, both = compare(q, k, v, do, masks, kw, dtype=jnp.float32, kernel_kw=blocks)
        got, want = both(q, k, v, do, *masks)
        assert max(rel_err(g, w) for g, w in zip(got, want)) < 1e-5, r
        assert rel_err(want[0], whole[:, chunk]) < 1e-6, r


# ------------------------------------------------------------------------------- no kernel runs
def test_reference_mask_is_attention_allowed():
    """The reference's mask (causal) is the model's `attention_allowed` with arange positions."""
    b, s = 2, 19
    seg = segments(b, s, seed=8)
    km = jnp.ones((b, s), jnp.int32).at[1, :4].set(0)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    for w in (None, 5, 0):
        want = attention_allowed(
            pos, pos, key_mask_bt=km, q_segment_bs=seg, kv_segment_bt=seg, sliding_window=w
        )
        got = reference_mask(
            s, s, batch=b, q_segment_ids=seg, kv_segment_ids=seg, key_mask=km, sliding_window=w
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def numpy_attention(q, k, v, allowed, scale):
    """Per (batch, query head) softmax attention in float64 numpy, head n reading kv head n // G,
    masked logits at MASK_VALUE (a fully masked row averages the values)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, _s, nq, _ = q.shape
    g = nq // k.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        for n in range(nq):
            logits = q[i, :, n] @ k[i, :, n // g].T * scale
            logits = np.where(np.asarray(allowed[i]), logits, MASK_VALUE)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            out[i, :, n] = (p / p.sum(-1, keepdims=True)) @ v[i, :, n // g]
    return out


def test_xla_attention_matches_per_head_reference():
    """The XLA core (heads stacked as [b, k, g*s, t] rows) equals a per-head float64 loop, in
    fp32 and bf16, with padding, segments, a window and fully masked rows; its gradients equal
    the finite differences of the reference."""
    b, s, nq, nkv, hd = 2, 11, 6, 2, 8
    q, k, v, do = make_qkv(b, s, s, nq, nkv, hd, jnp.float32, seed=3)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    key_mask = jnp.ones((b, s), jnp.int32).at[1, :3].set(0)
    seg = jnp.asarray([[0] * 5 + [1] * 6, [0] * 11], jnp.int32)
    allowed = attention_allowed(
        pos, pos, key_mask_bt=key_mask, q_segment_bs=seg, kv_segment_bt=seg, sliding_window=4
    )
    assert not bool(allowed[1, :3].any())  # fully masked rows are under test
    want = numpy_attention(q, k, v, allowed, 0.3)
    got = xla_attention(q, k, v, allowed, 0.3)
    assert got.dtype == jnp.float32 and rel_err(got, want) < 1e-6
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got_bf = xla_attention(*bf, allowed, 0.3)
    assert got_bf.dtype == jnp.bfloat16 and rel_err(got_bf, numpy_attention(*bf, allowed, 0.3)) < 1e-2

    # Directional derivative of <out, do> along a random (dq, dk, dv) vs the reference's.
    grads = jax.grad(lambda *x: jnp.vdot(xla_attention(*x, allowed, 0.3), do), argnums=(0, 1, 2))(q, k, v)
    ds = make_qkv(b, s, s, nq, nkv, hd, jnp.float32, seed=4)[:3]
    eps = 1e-4
    loss = lambda sign: np.vdot(
        numpy_attention(
            *(np.float64(x) + sign * eps * np.float64(d) for x, d in zip((q, k, v), ds)), allowed, 0.3
        ),
        np.float64(do),
    )
    fd = (loss(1) - loss(-1)) / (2 * eps)
    ad = sum(float(jnp.vdot(gr, d)) for gr, d in zip(grads, ds))
    assert abs(ad - fd) < 1e-4 * max(1.0, abs(fd)), (ad, fd)
    assert bool(jnp.all(grads[0][1, :3] == 0))  # dead query rows pass no gradient to q


def test_xla_attention_keeps_only_the_probabilities_for_the_backward():
    """The hand-written backward's residuals: q, k, v, the [b, s, t] mask and one [b, k, m, t]
    tensor, the probabilities. Autodiff of the softmax kept three (masked logits, exponentials,
    probabilities) and a broadcast mask, and XLA kept more still (docs/design/host-memory.md)."""
    from jax._src.ad_checkpoint import saved_residuals

    b, s, nq, nkv, hd = 2, 16, 4, 2, 8
    q, k, v, _ = make_qkv(b, s, s, nq, nkv, hd, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    allowed = attention_allowed(pos, pos)
    kept = [aval for aval, _ in saved_residuals(lambda *x: xla_attention(*x, allowed, 0.3), q, k, v)]
    scores = [a for a in kept if a.shape[-1] == s and a.size == b * nq * s * s]
    assert [(a.shape, a.dtype) for a in scores] == [((b, nkv, nq // nkv * s, s), jnp.float32)]
    others = sorted(a.size for a in kept if a not in scores)
    assert others == sorted([b * s * s] + [b * s * nkv * hd] * 2 + [q.size])  # mask, k, v, q


def test_rejects_bad_arguments():
    q, k, v, _ = make_qkv(1, 8, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v, scale=1.0, interpret=True)
    q, k, v, _ = make_qkv(1, 8, 8, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, scale=1.0, block_q=24, interpret=True)
    with pytest.raises(ValueError, match="segment"):
        flash_attention(q, k, v, scale=1.0, q_segment_ids=jnp.zeros((1, 8), jnp.int32), interpret=True)


def test_traced_offset_flops_are_counted_at_the_given_mean(monkeypatch):
    """A traced q_offset's FLOP tags count the static `flops_offset` (the mean over the ranks that
    run the call), or Sk - Sq, the largest, without one."""
    sds = jax.ShapeDtypeStruct
    q, kv = sds((1, 64, 2, 16), jnp.bfloat16), sds((1, 256, 2, 16), jnp.bfloat16)
    blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)

    def tags(flops_offset):
        def fn(q, k, v, offset):
            f = lambda q: flash_attention(
                q, k, v, scale=0.25, q_offset=offset, flops_offset=flops_offset, platform="cuda", **blocks
            )
            return f(q)

        scalar = sds((), jnp.int32)
        found = lowered_triton_kernels(monkeypatch, fn, q, kv, kv, scalar, platform="cuda", flops=True)
        return dict(found)["zaya_flash_attention_fwd"]

    per_pair = 2 * 2 * 2 * 16  # two dots per visited block, batch 1 x 2 heads x head dim 16
    assert tags(96) == per_pair * causal_pairs(64, 256, 16, 16, 96, True)
    assert tags(None) == per_pair * causal_pairs(64, 256, 16, 16, 256 - 64, True) > tags(96)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_to_triton(monkeypatch, platform):
    """Forward + dq + dk/dv lower to Triton IR (power-of-two tiles, supported primitives) at ZAYA1
    sizes (hd 128, 8 q / 2 kv heads) with a ragged sequence and every mask feature on, queries a
    context rank's chunk of half the keys at a traced offset."""
    b, s = 2, 300
    sds = jax.ShapeDtypeStruct
    q = sds((b, s // 2, 8, 128), jnp.bfloat16)
    kv = sds((b, s, 2, 128), jnp.bfloat16)
    ids, q_ids, scalar = sds((b, s), jnp.int32), sds((b, s // 2), jnp.int32), sds((), jnp.int32)

    def fn(q, k, v, qseg, seg, km, w, offset):
        f = lambda q, k, v: flash_attention(
            q,
            k,
            v,
            scale=128**-0.5,
            q_segment_ids=qseg,
            kv_segment_ids=seg,
            key_mask=km,
            sliding_window=w,
            q_offset=offset,
        )
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(out)

    args = (q, kv, kv, q_ids, ids, ids, scalar, scalar)
    names = lowered_triton_kernels(monkeypatch, fn, *args, platform=platform)
    assert sorted(names) == sorted(
        ["zaya_flash_attention_fwd", "zaya_flash_attention_dq", "zaya_flash_attention_dkv"]
    ), names


def test_zz_report():
    """Prints the max errors measured above (pytest -s); runs last in this file."""
    for (name, dtype), errs in sorted(ERRORS.items()):
        print(f"{name:55s} {dtype:9s} " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))


def test_pick_blocks_rules_and_package_exports():
    """Block table: powers of two >= 16, clipped to short sequences, smaller for big head dims and
    fp32, ROCm counts 64-lane wavefronts; the package exports and SUPPORTED note."""
    import zaya_jax.kernels as K
    from zaya_jax.kernels.block_sizes import KERNELS, pick_blocks

    zaya = pick_blocks(
        "flash_attention", {"seq_q": 4096, "seq_k": 4096, "head_dim": 128}, jnp.bfloat16, platform="cuda"
    )
    assert (zaya["block_q"], zaya["block_k"], zaya["num_warps"]) == (128, 128, 8)
    assert (
        pick_blocks(
            "flash_attention", {"seq_q": 4096, "seq_k": 4096, "head_dim": 128}, jnp.bfloat16, platform="rocm"
        )["num_warps"]
        == 4
    )
    big_head = {"seq_q": 4096, "seq_k": 4096, "head_dim": 256}
    assert pick_blocks("flash_attention", big_head)["block_q"] == 64
    assert pick_blocks("flash_attention", {"seq_q": 20, "seq_k": 20, "head_dim": 32})["block_q"] == 32
    assert (
        pick_blocks("flash_attention", {"seq_q": 4096, "seq_k": 4096, "head_dim": 128}, jnp.float32)[
            "block_k"
        ]
        == 64
    )
    gmm = pick_blocks("grouped_matmul", {"m": 16384, "k": 2048, "n": 4096, "groups": 16})
    assert (gmm["block_m"], gmm["block_n"], gmm["block_k"]) == (128, 128, 64)
    assert (
        pick_blocks("grouped_matmul", {"m": 16384, "k": 2048, "n": 4096, "groups": 16}, jnp.float32)[
            "block_k"
        ]
        == 32
    )
    few_tokens = {"m": 512, "k": 2048, "n": 4096, "groups": 16}  # 32 tokens per expert
    assert pick_blocks("grouped_matmul", few_tokens)["block_m"] == 32
    for kernel in KERNELS:
        for dtype in (jnp.float32, jnp.bfloat16):
            for dims in ({}, {"m": 3, "n": 5, "k": 7, "seq_q": 1, "seq_k": 1, "head_dim": 8}):
                for key, size in pick_blocks(kernel, dims, dtype).items():
                    if key.startswith("block"):
                        assert size >= 16 and size & (size - 1) == 0, (kernel, key, size)
    with pytest.raises(ValueError, match="unknown kernel"):
        pick_blocks("nope", {})
    assert K.kernel_options("cpu") == {"interpret": True, "platform": "cpu"}
    assert K.kernel_options("rocm") == {"interpret": False, "platform": "rocm"}
    # ROCm's 64-lane wavefronts: the same threads in half the warps, whatever this process runs on.
    for kernel in ("flash_attention", "grouped_matmul", "newton_schulz"):
        cuda, rocm = pick_blocks(kernel, {}, platform="cuda"), pick_blocks(kernel, {}, platform="rocm")
        assert rocm["num_warps"] * 2 == cuda["num_warps"] == pick_blocks(kernel, {})["num_warps"]
    assert set(K.SUPPORTED) >= {"flash_attention", "grouped_matmul", "newton_schulz"}
    for name in K.__all__:
        assert hasattr(K, name), name
