"""A reader of compiled HLO text (`compiled.as_text()`): its computations, how often each runs per
call, the collectives in it with their result bytes, and its work: dots (with their FLOPs), vendor
GEMM calls, convolutions, Triton kernels (ours, and XLA's Triton fusions); and the jax source path
each instruction came from (`op_names`).

Read by `zaya_jax.analysis.dry_run` (the collectives, kernels and FLOPs of `train --dry_run`),
`benchmarks/collectives.py` (the expert exchange's all-to-all bytes) and
`benchmarks/profile_step.py` (a profile's ops named by the model code that made them).

Operand shapes: XLA:CPU's text writes every operand with its shape; XLA:GPU's names operands only
(`dot(%a, %b)`), so a dot's contraction sizes are looked up in the declarations of its computation
(every instruction, parameters included, is declared `%name = TYPE op(...)`).

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

import numpy as np

from zaya_jax.kernels.flops import FLOPS_TAG  # our kernels' names end with it and their FLOPs

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
TRIP_COUNT_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_OPERANDS = re.compile(r"\s[a-z][\w\-]*\(([^)]*)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
TRITON_NAME_RE = re.compile(r'\bname = "([^"]*)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w]+)"')
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
    device, the runs of its computation, its device groups (`replica_groups`: logical device ids,
    the positions in the mesh's device order; None where the text does not say) and jax's op_name
    (where in the program it came from)."""

    op: str
    bytes: int
    runs: Runs
    groups: tuple[tuple[int, ...], ...] | None = None
    op_name: str = ""
    key: str = ""  # the instruction's name (an async pair's: its start's), as the timeline keys it


_GROUPS = re.compile(r"\breplica_groups=(\{\{[\d,{} ]*\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_MESH_GROUPS = re.compile(
    r"\breplica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))?\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"\bsource_target_pairs=\{(\{[\d, ]*\}(?:,\s*\{[\d, ]*\})*)\}")
_IOTA = re.compile(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?")


def _iota(dims: list[int], perm: list[int] | None) -> list[int]:
    """Device ids of an iota tile assignment `<=[dims]T(perm)`, in order: arange(prod(dims))
    reshaped to dims, transposed by perm (XLA's IotaTileAssignment)."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return [int(i) for i in (ids.transpose(perm) if perm else ids).ravel()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _mesh_groups(axes_text: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...] | None:
    """Groups of XLA's mesh form `mesh['axis_0'=4,'axis_1'=2], device_ids=(...) {'axis_0'}`: devices
    laid out on the named mesh (iota, or `device_ids`), one group per coordinate of the other axes.
    None for a form this reader does not know (sub-axes)."""
    sizes = re.findall(r"'([^']+)'=(\d+)", axes_text)
    names = [n for n, _ in sizes]
    wanted = re.findall(r"'([^']+)'", grouped)
    if not sizes or any(w not in names for w in wanted) or ":" in grouped:
        return None
    shape = [int(v) for _, v in sizes]
    ids = list(range(math.prod(shape)))
    if device_ids:
        m = _IOTA.fullmatch(device_ids)
        ids = _iota(_ints(m.group(1)), _ints(m.group(3)) if m.group(3) else None)
    inside = [names.index(w) for w in wanted]
    outside = [k for k in range(len(shape)) if k not in inside]
    grid = np.asarray(ids).reshape(shape).transpose(outside + inside)
    return tuple(tuple(int(i) for i in g) for g in grid.reshape(-1, math.prod(shape[k] for k in inside)))


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a collective instruction (source-target pairs for a permute), from any
    of XLA's three forms: explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` (optionally `<=[2,2]T(1,0)`),
    and mesh axes `mesh['axis_0'=2,...] {'axis_0'}`. None when it has none (`{}`: every device)
    or a form not read here."""
    if m := _MESH_GROUPS.search(line):
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    if m := _PAIRS.search(line):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d, ]*)\}", m.group(1)))
    m = _GROUPS.search(line)
    if not m or m.group(1) == "{}":
        return None
    text = m.group(1)
    if text.startswith("{"):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d, ]*)\}", text[1:-1]))
    iota = _IOTA.fullmatch(text)
    ids = _iota(_ints(iota.group(2)), _ints(iota.group(3)) if iota.group(3) else None)
    size = _ints(iota.group(1))[-1]
    return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def ring_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes a collective of result `nbytes` moves through each device's links over a ring of `n`
    devices: all-gather and all-to-all (n - 1) / n of the result, reduce-scatter (n - 1) x the
    result (its input is n results), all-reduce 2 (n - 1) / n, a collective-permute its result."""
    if op == "collective-permute":
        return float(nbytes)
    if op == "reduce-scatter":
        return float(nbytes) * (n - 1)
    return nbytes * (n - 1) / n * (2 if op == "all-reduce" else 1)


def shape_bytes(text: str) -> int:
    """Bytes of an HLO result type: an array `f32[8,128]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = _DTYPE_BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def op_names(hlo: str) -> dict[str, str]:
    """{instruction name: its op_name metadata, "" where it has none} over the whole module: the jax
    source path (`jit(f)/.../layers/self_attn/dot_general`) of each op a profiler names by instruction."""
    names = {}
    for line in hlo.splitlines():
        m = _NAME.match(line)
        if m:
            found = _OP_NAME.search(line)
            names[m.group(1)] = found.group(1) if found else ""
    return names


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
    trip = TRIP_COUNT_RE.search(line)
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


def group_axes(
    groups: tuple[tuple[int, ...], ...] | None, names: tuple[str, ...], shape: tuple[int, ...]
) -> tuple[str, ...] | None:
    """The mesh axes a collective spans: those along which the devices of a group (or of a
    source-target pair) differ, device i of a group sitting at position i of the mesh's devices
    (row-major over `shape`, axes `names`). () for groups of one device; None when unknown."""
    if not groups:
        return None
    coords = [np.unravel_index(list(g), shape) for g in groups]
    varying = {k for c in coords for k in range(len(shape)) if len(set(c[k].tolist())) > 1}
    return tuple(n for k, n in enumerate(names) if k in varying)


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled (per-device) HLO module. Async pairs count once, by their
    `-done` (whose result is the collective's output; the groups are written on the `-start`)."""
    comps, entry = computations(hlo)
    runs = executions(comps, entry)
    out = []
    for name, lines in comps.items():
        starts = {}
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            if m.group(2).endswith("-start"):
                starts[_NAME.match(line).group(1)] = line
                continue
            op = m.group(2).removesuffix("-done")
            if op in COLLECTIVES:
                operands = _OPERANDS.search(line)
                first = operands.group(1).split(",")[0].strip().lstrip("%") if operands else ""
                source = starts.get(first, line) if m.group(2).endswith("-done") else line
                op_name = found.group(1) if (found := _OP_NAME.search(line)) else ""
                groups = replica_groups(source)
                key = first if source is not line else _NAME.match(line).group(1)
                out.append(Collective(op, shape_bytes(m.group(1)), runs[name], groups, op_name, key))
    return out


# ------------------------------------------------------------------------------------------- work
TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas (Triton lowering) kernel in XLA:GPU's HLO
# Vendor GEMM calls: cuBLAS / cuBLASLt, and on ROCm the same targets run rocBLAS / hipBLASLt.
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul")
CONV_CALLS = ("__cudnn$conv", "__miopen$conv")


@dataclasses.dataclass(frozen=True)
class Work:
    """One instruction that does matrix work (or names a kernel): its kind, name, dot FLOPs per run
    (0 where the HLO does not say), jax's op_name (where in the program) and its runs per step.

    kind: "dot" (an HLO dot, standalone or inside a fusion), "gemm" (a vendor GEMM custom call:
    cuBLAS / cuBLASLt / hipBLASLt / rocBLAS), "triton" (a Pallas kernel; name without the FLOPs
    tag), "triton fusion" (XLA's own Triton fusion: its dots are counted as "dot"),
    "convolution" (an HLO convolution or a cuDNN / MIOpen conv call)."""

    kind: str
    name: str
    flops: float
    op_name: str
    runs: Runs


def _dims(type_text: str) -> list[int]:
    """Dimensions of the first array in an HLO type (a tuple's first element)."""
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def declared(lines: list[str]) -> dict[str, str]:
    """{instruction name: its result type} of one computation."""
    out = {}
    for line in lines:
        name, inst = _NAME.match(line), _INSTRUCTION.match(line)
        if name and inst:
            out[name.group(1)] = inst.group(1)
    return out


def _lhs_dims(line: str, declared: dict[str, str]) -> list[int]:
    """The first operand's dimensions: written inline (XLA:CPU) or declared (XLA:GPU)."""
    m = _OPERANDS.search(line)
    first = m.group(1).split(",")[0].strip() if m else ""
    if _ARRAY.match(first):
        return _dims(first)
    return _dims(declared.get(first.lstrip("%"), ""))


def _contracting(line: str, json_key: str, hlo_key: str) -> list[int]:
    m = re.search(rf'"{json_key}":\[([^\]]*)\]', line) or re.search(rf"{hlo_key}=\{{([\d,]*)\}}", line)
    return [int(d.strip('"')) for d in m.group(1).split(",") if d.strip('"')] if m else []


def gemm_flops(result: str, line: str, declared: dict[str, str]) -> float:
    """2 x output elements x contraction size of a dot or a GEMM call."""
    lhs = _lhs_dims(line, declared)
    contracting = _contracting(line, "lhs_contracting_dimensions", "lhs_contracting_dims")
    k = math.prod(lhs[d] for d in contracting if d < len(lhs)) if lhs else 0
    return 2.0 * math.prod(_dims(result)) * k


def _instruction_work(line: str, declared: dict[str, str], runs: Runs) -> Work | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    result, op = m.group(1), m.group(2)
    op_name = found.group(1) if (found := _OP_NAME.search(line)) else ""
    target = found.group(1) if (found := TARGET_RE.search(line)) else ""
    if op == "dot":
        return Work("dot", "dot", gemm_flops(result, line, declared), op_name, runs)
    if op == "convolution" or target.startswith(CONV_CALLS):
        return Work("convolution", target or "convolution", 0.0, op_name, runs)
    if target.startswith(GEMM_CALLS):
        return Work("gemm", target, gemm_flops(result, line, declared), op_name, runs)
    if target == TRITON_CALL:
        name = found.group(1) if (found := TRITON_NAME_RE.search(line)) else "?"
        base, tag, flops = name.rpartition(FLOPS_TAG)
        count = float(flops) if tag and flops.isdigit() else 0.0
        return Work("triton", base if tag else name, count, op_name, runs)
    kind = _FUSION_KIND.search(line) if op == "fusion" else None
    if kind and kind.group(1).startswith("__triton"):
        return Work("triton fusion", kind.group(1), 0.0, op_name, runs)
    return None


def work(hlo: str) -> list[Work]:
    """Every dot, vendor GEMM, convolution and Triton kernel / fusion of a compiled module, with the
    runs of its computation per call (`executions`)."""
    comps, entry = computations(hlo)
    runs = executions(comps, entry)
    out = []
    for name, lines in comps.items():
        types = declared(lines)
        for line in lines:
            w = _instruction_work(line, types, runs[name])
            if w is not None:
                out.append(w)
    return out
