"""The expert exchange's all-to-all bytes of a compiled program, counted from its HLO."""

from __future__ import annotations

from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.training.train_state import OPTIMIZER_SCOPE


def all_to_all_bytes(hlo: str) -> tuple[int, int]:
    """(main path, spill) all-to-all bytes per call of a compiled per-device HLO module: each
    all-to-all's result bytes times how often its computation runs on the main path (every
    conditional's default branch), and once per non-default branch (the spill). Distributed Muon's
    all-to-alls (under OPTIMIZER_SCOPE) are not the exchange and are left out."""
    ops = [c for c in hlo_lib.collectives(hlo) if c.op == "all-to-all" and OPTIMIZER_SCOPE not in c.op_name]
    return sum(c.bytes * c.runs.main for c in ops), sum(c.bytes * c.runs.branch for c in ops)
