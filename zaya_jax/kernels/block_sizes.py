"""Block (tile) sizes of the Pallas kernels, by kernel, problem shape and dtype.

    pick_blocks(kernel, shapes, dtype, platform=None) -> dict of block sizes (+ num_warps /
                                                           num_stages)

The design: docs/design/kernels.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

# attention_impl="auto" off GPUs: blockwise attention from this many key positions on, the dense
# XLA softmax below (kernels.attention_choice): at 512 keys blockwise is one block and no faster;
# from 1024 on it wins on time and temporaries, more so as S grows (docs/performance.md,
# `long_context`).
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
    get = lambda key: shapes.get(key)

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
