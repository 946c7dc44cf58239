"""A reader of compiled HLO text (`compiled.as_text()`): its computations, how often each runs per
call, and the collectives in it with their result bytes.

Read by `zaya_jax.dry_run` (the collectives table of `train --dry_run`) and
`benchmarks/collectives.py` (the expert exchange's all-to-all bytes, issue 17).

Runs per call: a while body (and condition) runs its known trip count times per run of its caller
(1 when XLA could not infer it). A conditional's default branch, branch 0 of an indexed conditional
(`lax.cond`'s false branch) or the `false_computation` of a predicated one, is the main path; its
other branches are counted apart, once as if taken: they run only on the steps that take them (the
expert exchange's spill round runs only when some bucket overflowed, zaya_jax/parallel/expert.py).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented: instructions are indented
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations|true_computation|false_computation)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DTYPE_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True)
class Runs:
    """Runs of a computation per call of ENTRY: on the main path, and only inside a conditional's
    non-default branch (counted as if taken)."""

    main: int = 0
    branch: int = 0


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its op (async `-done` folded into the op), result bytes per
    device, and the runs of its computation."""

    op: str
    bytes: int
    runs: Runs


def shape_bytes(text: str) -> int:
    """Bytes of an HLO result type: an array `f32[8,128]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = _DTYPE_BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines} and the ENTRY computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith("HloModule"):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _callees(line: str, comps: dict[str, list[str]]) -> list[tuple[str, int, bool]]:
    """(callee, runs per run of the caller, whether it is a non-default branch) of one instruction."""
    trip = _TRIP_COUNT.search(line)
    out = []
    for kind, targets in _CALLS.findall(line):
        times = int(trip.group(1)) if trip and kind in ("body", "condition") else 1
        names = [t.strip().lstrip("%") for t in targets.strip("{}").split(",")]
        for i, name in enumerate(names):
            branch = (kind == "branch_computations" and i > 0) or kind == "true_computation"
            if name in comps:
                out.append((name, times, branch))
    return out


def executions(comps: dict[str, list[str]], entry: str) -> dict[str, Runs]:
    """How often each computation runs per call of ENTRY (see the module docstring)."""
    calls = {name: [c for line in lines for c in _callees(line, comps)] for name, lines in comps.items()}
    main: dict[str, int] = collections.defaultdict(int)
    branch: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int, in_branch: bool) -> None:
        (branch if in_branch else main)[name] += times
        for callee, k, is_branch in calls[name]:
            visit(callee, times * k, in_branch or is_branch)

    visit(entry, 1, False)
    return {name: Runs(main[name], branch[name]) for name in comps}


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled (per-device) HLO module. Async pairs count once, by their
    `-done` (whose result is the collective's output)."""
    comps, entry = computations(hlo)
    runs = executions(comps, entry)
    out = []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2).endswith("-start"):
                continue
            op = m.group(2).removesuffix("-done")
            if op in COLLECTIVES:
                out.append(Collective(op, shape_bytes(m.group(1)), runs[name]))
    return out
