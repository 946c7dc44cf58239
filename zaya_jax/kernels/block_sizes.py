"""Block (tile) sizes of the Pallas kernels, by kernel, problem shape and dtype.

    pick_blocks(kernel, shapes, dtype, platform=None) -> dict of block sizes (+ num_warps /
                                                           num_stages)

kernel      shapes keys                         returns
----------  ----------------------------------  -----------------------------------------------
flash_attention  seq_q, seq_k, head_dim         block_q, block_k (forward), block_q_bwd,
                                                block_k_bwd, num_warps, num_stages
grouped_matmul   m (rows T), k, n, [groups]     block_m, block_n, block_k, num_warps, num_stages
tgmm             m (rows T), k, n, [groups]     block_m (the reduction over rows), block_k,
                                                block_n (the [K, N] output tile), num_warps, ...
newton_schulz    m, n (after the wide transpose) block (square output tile), block_k, num_warps, ...
blockwise_attention  seq_q, seq_k               block_q, block_k (plain XLA, zaya_jax/kernels/
                                                blockwise_attention.py; no warps)

Sizing rules (why these numbers)
--------------------------------
* Powers of two, >= 16. Triton tensors must have power-of-two sizes and `tl.dot` needs every
  dimension >= 16 (MFMA on CDNA3 and mma on Hopper are 16/32-wide). Dimensions of the problem
  that are multiples of 64/128 (ZAYA1: d = I = 2048, hd = 128, S = 4096) then tile exactly.
* Shared memory (LDS) is the binding limit. MI300X has 64 KiB of LDS per CU (H100/H200: up to
  227 KiB of shared memory per SM), so the table is sized for the 64 KiB budget and is therefore
  valid on both. A bf16 128x64 operand tile is 16 KiB; fp32 doubles every tile, so fp32 halves the
  reduction block (block_k) instead of the output tile.
* Attention forward: block_q = block_k = 128 for head_dim <= 128 (one 128x128 fp32 score tile in
  registers per program, K and V tiles of 128 x hd bf16 = 32 KiB each); head_dim > 128 -> 64 so
  K/V tiles stay within budget; fp32 -> block_k 64. Backward (dq, dk/dv) holds ~2x more live
  tiles (q, k, v, do, the accumulators) -> 64 x 64. Short sequences clip every block to the
  next power of two of the sequence (min 16) so a 20-token test runs one 32-row tile, not 128.
* num_warps is counted in NVIDIA warps of 32 threads: 4 for tiles up to 64 x 64 (or head_dim
  <= 64), else 8, i.e. 128 / 256 threads. On ROCm a Triton "warp" is a 64-lane wavefront, so the
  same thread count is half the warps (platform="rocm": 2 / 4, the AMD Triton tutorials' 4 warps
  for a 128 x 128 attention tile).
* num_stages is None: the Pallas Triton lowering's backend default, 1 on ROCm (the AMD backend
  does not multi-buffer through LDS; a deeper pipeline would not fit 64 KiB anyway) and 3 on CUDA
  (3 x 32 KiB of staged bf16 tiles fits Hopper's shared memory).
* Grouped matmul: 128 x 128 output tiles with block_k 64 (bf16) / 32 (fp32). When the average
  group (tokens per expert) is below 128 rows, block_m drops to 64 (then 32, 16): a group smaller
  than block_m wastes the padded rows of its tile, and every group boundary costs one partial
  tile. tgmm (the weight gradient) reduces over rows, so its block_m is the pipelined reduction
  block (64 bf16 / 32 fp32) and its output tile is block_k x block_n = 128 x 128; its last chunk
  of every group is padded too, so block_m drops with the average group the same way (else at 32
  experts of 16 tokens each the weight gradient ran 4x the routed rows; tests/test_gpu_compile.py).
* Blockwise attention (plain XLA, any backend): block_q = block_k = 512, clipped to short
  sequences like the rest. No shared memory to fit: the bound is the per-block logits [b, k, g*bq,
  bk] fp32 (4 MiB per kv head at G = 2) against the loop overhead per block. Measured at 4096
  tokens (configs/tiny.py, 2 CPU cores, forward + backward): blocks 256 4.3 s, 512 3.5 s, 1024
  6.5 s, XLA's temporaries the same 0.34 GiB for all three.
* Newton-Schulz: square 128 x 128 output tiles (64 for matrices whose short side is < 128), block_k
  32 for fp32 (the default ns_dtype) / 64 for bf16.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

# attention_impl="auto" off GPUs: blockwise attention from this many key positions on, the dense
# XLA softmax below (kernels.attention_choice). configs/tiny.py, batch 1, forward + backward on
# 2 CPU cores (benchmarks/README.md "Long context"): at 512 one block, blockwise 0.36 s vs xla
# 0.32 s; at 1024 0.50 s vs 1.04 s and 0.08 vs 0.26 GiB of temporaries; the gap grows with S.
BLOCKWISE_AUTO_MIN_SEQ = 1024

KERNELS = ("flash_attention", "grouped_matmul", "tgmm", "newton_schulz", "blockwise_attention")

# Base table (bf16 / fp16 operands). fp32 adjustments are applied in `pick_blocks`.
TABLE: dict[str, dict[str, int]] = {
    "flash_attention": dict(
        block_q=128, block_k=128, block_q_bwd=64, block_k_bwd=64, num_warps=8, num_stages=None
    ),
    "grouped_matmul": dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=None),
    "tgmm": dict(block_m=64, block_k=128, block_n=128, num_warps=8, num_stages=None),
    "newton_schulz": dict(block=128, block_k=64, num_warps=8, num_stages=None),
    "blockwise_attention": dict(block_q=512, block_k=512),
}


def _p2(x: int) -> int:
    """Next power of two >= max(x, 1)."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def _clip(block: int, dim: int | None, floor: int = 16) -> int:
    """Clip a block to the next power of two of the dimension it tiles (but >= floor)."""
    if dim is None:
        return block
    return max(floor, min(block, _p2(dim)))


def _shrink_to_groups(block_m: int, m: int | None, groups: int | None) -> int:
    """Halve a row block (down to 16) while the average group (m / groups rows) is smaller: each
    group's last block is padded, so G groups waste up to G * block_m rows."""
    if m is None or not groups:
        return block_m
    avg = max(1, m // groups)
    while block_m > 16 and avg < block_m:
        block_m //= 2
    return block_m


def pick_blocks(
    kernel: str, shapes: Mapping[str, int], dtype: Any = jnp.bfloat16, platform: str | None = None
) -> dict[str, Any]:
    """Block sizes for `kernel` (one of KERNELS) on a problem of `shapes` in `dtype`.

    See the module docstring for the keys of `shapes` and the rules. platform: the platform the
    kernel is compiled for ("rocm" halves num_warps; "cuda", "cpu" or None keep the table's
    32-lane warps); it only changes num_warps. Every block is
    a power of two >= 16; the result is a fresh dict (callers may override entries).
    """
    if kernel not in TABLE:
        raise ValueError(f"pick_blocks: unknown kernel {kernel!r}; one of {KERNELS}")
    wide = jnp.dtype(dtype).itemsize >= 4  # fp32 tiles take twice the shared memory
    out = dict(TABLE[kernel])
    get = lambda key: shapes.get(key)  # noqa: E731

    if kernel == "flash_attention":
        hd = get("head_dim") or 128
        if hd > 128:
            out.update(block_q=64, block_k=64, block_q_bwd=32, block_k_bwd=32)
        if wide:
            out.update(block_k=min(out["block_k"], 64), block_k_bwd=min(out["block_k_bwd"], 32))
        for key, dim in (
            ("block_q", "seq_q"),
            ("block_k", "seq_k"),
            ("block_q_bwd", "seq_q"),
            ("block_k_bwd", "seq_k"),
        ):
            out[key] = _clip(out[key], get(dim))
        small = out["block_q"] * out["block_k"] <= 64 * 64 or hd <= 64
        out["num_warps"] = 4 if small else 8

    elif kernel == "grouped_matmul":
        m, groups = get("m"), get("groups")
        if wide:
            out["block_k"] = 32
        out["block_m"] = _shrink_to_groups(out["block_m"], m, groups)
        out["block_m"] = _clip(out["block_m"], m)
        out["block_n"] = _clip(out["block_n"], get("n"))
        out["block_k"] = _clip(out["block_k"], get("k"))
        out["num_warps"] = 4 if out["block_m"] * out["block_n"] <= 64 * 64 else 8

    elif kernel == "tgmm":
        if wide:
            out["block_m"] = 32
        out["block_m"] = _shrink_to_groups(out["block_m"], get("m"), get("groups"))
        out["block_m"] = _clip(out["block_m"], get("m"))
        out["block_k"] = _clip(out["block_k"], get("k"))
        out["block_n"] = _clip(out["block_n"], get("n"))
        out["num_warps"] = 4 if out["block_k"] * out["block_n"] <= 64 * 64 else 8

    elif kernel == "newton_schulz":
        m, n = get("m"), get("n")
        short = min(m, n) if m is not None and n is not None else None
        if short is not None and short < 128:
            out["block"] = 64
        if wide:
            out["block_k"] = 32
        out["block"] = _clip(out["block"], short)
        out["block_k"] = _clip(out["block_k"], short)
        out["num_warps"] = 4 if out["block"] <= 64 else 8
    elif kernel == "blockwise_attention":  # an XLA loop, not a Triton program: no warps to set
        out["block_q"] = _clip(out["block_q"], get("seq_q"))
        out["block_k"] = _clip(out["block_k"], get("seq_k"))
        return out
    if platform == "rocm":  # 64-lane wavefronts: same threads, half the warps
        out["num_warps"] = max(1, out["num_warps"] // 2)
    return out
