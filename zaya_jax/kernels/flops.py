"""The dot FLOPs one call of a Pallas kernel can do, declared in the kernel's name.

A Triton kernel is opaque in XLA's HLO: the custom call names its grid, not the work of a program
(which lives in its IR). So each of our pallas_calls is named `tagged(name, flops)`: its name plus
`FLOPS_TAG` and the count, which `zaya_jax.analysis.hlo.work` reads back from a compiled step
(the dry run's FLOPs table, tests/test_gpu_compile.py's expert work). The count follows the
kernel's own loops over padded tiles: what its programs execute when every row they may own is
used, i.e. an upper bound over the data (a grouped matmul's tiles of empty groups, a causal
kernel's blocks past the diagonal are counted only where the kernel can run them).
"""

from __future__ import annotations

# A kernel's name ends with FLOPS_TAG + the dot FLOPs one call can do at most: a Triton kernel's
# work is inside its IR, not in the HLO.
FLOPS_TAG = "_flops_"


def tagged(name: str, flops: float) -> str:
    """`name` with the call's dot FLOPs appended (FLOPS_TAG + an integer)."""
    return f"{name}{FLOPS_TAG}{int(flops)}"


def padded(dim: int, block: int) -> int:
    """`dim` rounded up to whole blocks (masked tiles still run their dots)."""
    return -(-dim // block) * block


def grouped_tiles(t: int, groups: int, block_m: int) -> int:
    """Row tiles of block_m that G groups of T rows in total can fill: sum_g ceil(n_g / bm) <=
    T // bm + G (rows past every group, the tail, run no dot)."""
    return t // block_m + groups


def causal_pairs(sq: int, sk: int, bq: int, bk: int, offset: int, causal: bool) -> int:
    """(query row, key column) pairs of the [bq, bk] blocks a flash-attention kernel visits for one
    (batch, head): every block, or with `causal` the key blocks up to each query block's last row
    (query row s at key position s + offset)."""
    nk = -(-sk // bk)
    total = 0
    for q_start in range(0, sq, bq):
        hi = min(nk, max(0, -(-(q_start + bq + offset) // bk))) if causal else nk
        total += hi * bk * bq
    return total
