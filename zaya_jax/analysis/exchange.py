"""The expert exchange's all-to-all bytes in a compiled step (main path and spill), and the
ideal it is measured against."""

from __future__ import annotations

from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.training.train_state import OPTIMIZER_SCOPE


def all_to_all_bytes(hlo: str) -> tuple[int, int]:
    """(main path, spill) all-to-all bytes per call of a compiled per-device HLO module.

    Bytes are each all-to-all's result (= operand) bytes times how often its computation runs (while
    bodies x their known trip count), as the dry run counts them (`zaya_jax.analysis.hlo`): the main path
    takes every conditional's default branch (`lax.cond`'s false branch: the expert exchange's
    no-overflow case); the other branches' all-to-alls are the spill, counted once as if taken.
    The optimizer's (distributed Muon bringing matrices whole to their owners,
    zaya_jax/parallel/zero1.py) are not the exchange and are left out."""
    ops = [c for c in hlo_lib.collectives(hlo) if c.op == "all-to-all" and OPTIMIZER_SCOPE not in c.op_name]
    return sum(c.bytes * c.runs.main for c in ops), sum(c.bytes * c.runs.branch for c in ops)


def ideal_exchange_bytes(tokens_per_device: int, hidden: int, itemsize: int) -> int:
    """Dispatch + combine, forward + backward, of exactly the tokens a device holds: 4 x T x d x
    itemsize per MoE block (the exchange's target)."""
    return 4 * tokens_per_device * hidden * itemsize
