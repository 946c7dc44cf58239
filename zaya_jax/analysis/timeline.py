"""A step's time read from its compiled HLO (`compiled.as_text()`, XLA:GPU's scheduled module) and
a device's figures (zaya_jax/analysis/hardware.py): per device, per call of the program.

The module's instructions run in their written order (the schedule) on one compute stream; the
collectives run on one network stream beside it.

* Kernels (each fusion, custom call or unfused op) take roofline time plus the per-kernel overhead:
  GEMMs (dots, alone or inside a fusion, and vendor GEMM calls) max(FLOPs / (peak of the dot's dtype
  x gemm_efficiency(FLOPs)), bytes / HBM bandwidth); our Triton kernels the FLOPs their name
  declares and their bytes, over the peak x their kernel_efficiency; everything else its bytes over
  the HBM bandwidth (memory-bound). Bytes are the operands read plus the result written; a fused
  dynamic-slice reads only its slice and a dynamic-update-slice writes only its update (in place).
* A collective's time is the latency plus its bytes in bus-bandwidth terms (nccl-tests): all-gather,
  all-to-all and reduce-scatter move (n-1)/n of the full buffer (a reduce-scatter's result is 1/n of
  it), all-reduce twice that, a collective-permute its buffer; over the intra-node bus bandwidth when
  every group lies inside one node (device id // gpus_per_node; logical ids, the mesh's order), else
  the inter-node one.
* Overlap: an async collective (`*-start` .. `*-done`) starts on the network stream when both it is
  issued and the network is free; its `-done` waits for it, so the compute scheduled between start
  and done hides it. A synchronous collective waits for the network and itself: fully exposed.
* A while loop runs its body (and condition) its known trip count times (1 when XLA did not infer
  it), each trip simulated alike; a conditional its default branch (zaya_jax/analysis/hlo.py's main path); a
  call its callee. A start whose done lies in the next trip (a pipelined collective) is waited for by
  that done, counted from the trip's beginning.

So step = compute + exposed communication. Not modelled: network contention between overlapping
collectives of different loops, compute slowed by concurrent communication, host overheads.
"""

from __future__ import annotations

import dataclasses
import re

from zaya_jax.analysis import hardware
from zaya_jax.analysis import hlo as hlo_lib

_INST = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALL = re.compile(
    r"\b(calls|body|condition|branch_computations|false_computation|to_apply)=(\{[^}]*\}|%?[\w.\-]+)"
)
_PARAM = re.compile(r"\bparameter\((\d+)\)")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS = re.compile(r"\breplica_count=(\d+)")
_DTYPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[")
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8"}
# Ops that launch no kernel and move no data.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "domain", "copy-done", "send-done", "recv-done",
    "async-update", "async-done",
}  # fmt: skip
KINDS = ("gemm", "triton", "memory")  # compute by kind


@dataclasses.dataclass
class Inst:
    """One instruction: name, result type, op, operand names, called computations, the line."""

    name: str
    type: str
    op: str
    operands: list[str]
    calls: dict[str, list[str]]
    line: str
    root: bool = False


def parse(line: str) -> Inst | None:
    m = _INST.match(line)
    if not m:
        return None
    rest = m.group(5)
    operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
    calls = {k: [t.strip().lstrip("%") for t in v.strip("{}").split(",")] for k, v in _CALL.findall(rest)}
    return Inst(m.group(2), m.group(3), m.group(4), operands, calls, line, bool(m.group(1)))


@dataclasses.dataclass
class Cost:
    """Seconds per call: wall time on the compute stream (= compute + exposed), compute by kind,
    communication (all of it, hidden or not) and the exposed part; per collective op [seconds,
    exposed seconds, runs], its exposed seconds the compute stream's waits at its ops (for them and
    for the collectives queued on the network before them); kernels run."""

    seconds: float = 0.0
    compute: float = 0.0
    communication: float = 0.0
    exposed: float = 0.0
    kinds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    collectives: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    kernels: int = 0
    # Per collective instruction (an async pair under its start's name): [seconds, exposed seconds].
    # A start whose done lies in a later trip counts as exposed whole here (its wait is the op's).
    by_name: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def add(self, other: Cost, times: int = 1) -> None:
        """Adds `times` sequential runs of `other`."""
        self.seconds += times * other.seconds
        self.compute += times * other.compute
        self.communication += times * other.communication
        self.exposed += times * other.exposed
        self.kernels += times * other.kernels
        for k, v in other.kinds.items():
            self.kinds[k] += times * v
        for op, (s, e, r) in other.collectives.items():
            row = self.collectives.setdefault(op, [0.0, 0.0, 0])
            row[0], row[1], row[2] = row[0] + times * s, row[1] + times * e, row[2] + times * r
        for name, (s, e) in other.by_name.items():
            row = self.by_name.setdefault(name, [0.0, 0.0])
            row[0], row[1] = row[0] + times * s, row[1] + times * e

    def collective(
        self, op: str, seconds: float = 0.0, exposed: float = 0.0, runs: int = 0, name: str | None = None
    ) -> None:
        row = self.collectives.setdefault(op, [0.0, 0.0, 0])
        row[0], row[1], row[2] = row[0] + seconds, row[1] + exposed, row[2] + runs
        self.communication += seconds
        self.exposed += exposed
        if name is not None:
            mine = self.by_name.setdefault(name, [0.0, 0.0])
            mine[0], mine[1] = mine[0] + seconds, mine[1] + exposed


def _in_place(i: Inst) -> bool:
    return i.op == "dynamic-update-slice" and len(i.operands) > 1


def _dtype(type_text: str) -> str:
    m = _DTYPE.search(type_text)
    t = m.group(1) if m else "bf16"
    return "float8" if t.startswith("f8") else DTYPES.get(t, t)


class Timeline:
    """The simulation of one compiled module on one device of `hw` (see the module docstring)."""

    def __init__(self, hlo: str, hw: dict):
        self.comps, self.entry = hlo_lib.computations(hlo)
        self.hw = hw
        parts, replicas = _PARTITIONS.search(hlo), _REPLICAS.search(hlo)
        self.devices = (int(parts.group(1)) if parts else 1) * (int(replicas.group(1)) if replicas else 1)
        self._insts: dict[str, list[Inst]] = {}
        self._costs: dict[str, Cost] = {}
        self._dots: dict[str, tuple[float, str]] = {}
        self._io: dict[str, tuple[dict[int, int], int | None]] = {}

    def insts(self, comp: str) -> list[Inst]:
        if comp not in self._insts:
            self._insts[comp] = [i for i in map(parse, self.comps.get(comp, [])) if i is not None]
        return self._insts[comp]

    def step(self) -> Cost:
        return self.computation(self.entry)

    # ------------------------------------------------------------------------------ communication
    def collective_seconds(self, op: str, nbytes: int, line: str) -> float:
        """Latency + bus bytes / bus bandwidth of one run of a collective (see the module docstring)."""
        groups = hlo_lib.replica_groups(line)
        n = len(groups[0]) if groups else self.devices
        if n <= 1 or nbytes == 0:
            return 0.0
        moved = hlo_lib.ring_bytes(op, nbytes, n)
        per_node = self.hw["gpus_per_node"]
        inside = (
            all(len({d // per_node for d in g}) == 1 for g in groups) if groups else self.devices <= per_node
        )
        bw = (
            hardware.intra_node_bandwidth(self.hw, n)
            if inside
            else self.hw["inter_node_bus_bytes_per_second"]
        )
        return self.hw["collective_latency_seconds"] + moved / bw

    # ------------------------------------------------------------------------------------ kernels
    def fused_dots(self, comp: str) -> tuple[float, str]:
        """Dot FLOPs inside a fused computation (nested fusions and GEMM calls included) and the
        dtype of its first dot's left operand."""
        if comp not in self._dots:
            types = hlo_lib.declared(self.comps.get(comp, []))
            flops, dtype = 0.0, ""
            for i in self.insts(comp):
                target = m.group(1) if (m := hlo_lib.TARGET_RE.search(i.line)) else ""
                if i.op == "dot" or target.startswith(hlo_lib.GEMM_CALLS):
                    flops += hlo_lib.gemm_flops(i.type, i.line, types)
                    dtype = dtype or _dtype(types.get(i.operands[0], "") if i.operands else i.type)
                for callee in i.calls.get("calls", []):
                    f, d = self.fused_dots(callee)
                    flops, dtype = flops + f, dtype or d
            self._dots[comp] = (flops, dtype)
        return self._dots[comp]

    def fused_io(self, comp: str) -> tuple[dict[int, int], int | None]:
        """({parameter index: bytes read} for parameters read only through dynamic-slices (their
        slices) or only updated in place (0), and the bytes written when the root writes in place
        (a dynamic-update-slice's update, or a tuple of them; None: the whole result)."""
        if comp not in self._io:
            insts = self.insts(comp)
            by_name = {i.name: i for i in insts}
            uses: dict[str, list[tuple[Inst, int]]] = {}
            for i in insts:
                for k, o in enumerate(i.operands):
                    uses.setdefault(o, []).append((i, k))
            # A bitcast moves nothing: XLA's in-place update looks through one on either side of a
            # dynamic-update-slice (CanEmitFusedDynamicUpdateSliceInPlaceForGpu).
            def users(name: str) -> list[tuple[Inst, int]]:
                out = []
                for j, k in uses.get(name, []):
                    out += users(j.name) if j.op == "bitcast" else [(j, k)]
                return out

            read = {}
            for i in insts:
                m = _PARAM.search(i.line) if i.op == "parameter" else None
                u = users(i.name)
                if m and u and all(j.op == "dynamic-slice" and k == 0 for j, k in u):
                    read[int(m.group(1))] = sum(hlo_lib.shape_bytes(j.type) for j, _ in u)
                elif m and u and all(j.op == "dynamic-update-slice" and k == 0 for j, k in u):
                    read[int(m.group(1))] = 0
            root = next((i for i in insts if i.root), None)
            parts = [by_name.get(o) for o in root.operands] if root and root.op == "tuple" else [root]
            unwrap = lambda p: by_name.get(p.operands[0], p) if p.op == "bitcast" and p.operands else p
            parts = [unwrap(p) for p in parts if p is not None]
            updates = [p.operands[1] if _in_place(p) else None for p in parts]
            written = None
            if any(updates):
                written = sum(
                    hlo_lib.shape_bytes(by_name[u].type if u in by_name else "")
                    if u
                    else hlo_lib.shape_bytes(p.type)
                    for p, u in zip(parts, updates)
                )
            self._io[comp] = (read, written)
        return self._io[comp]

    def kernel_bytes(self, i: Inst, types: dict[str, str]) -> int:
        """Bytes a kernel reads and writes (see the module docstring)."""
        if i.op in ("copy", "copy-start", "dynamic-slice"):
            return 2 * hlo_lib.shape_bytes(i.type)
        if i.op == "dynamic-update-slice" and len(i.operands) > 1:
            return 2 * hlo_lib.shape_bytes(types.get(i.operands[1], ""))
        read, written = (
            self.fused_io(i.calls["calls"][0]) if i.op == "fusion" and "calls" in i.calls else ({}, None)
        )
        total = hlo_lib.shape_bytes(i.type) if written is None else written
        for k, o in enumerate(i.operands):
            total += read.get(k, hlo_lib.shape_bytes(types.get(o, "")))
        return total

    def kernel(self, i: Inst, types: dict[str, str]) -> tuple[str, float]:
        """(kind, seconds) of one kernel."""
        hw = self.hw
        nbytes = self.kernel_bytes(i, types)
        memory = nbytes / hw["hbm_bytes_per_second"]
        overhead = hw.get("kernel_overhead_seconds", 0.0)
        target = m.group(1) if (m := hlo_lib.TARGET_RE.search(i.line)) else ""
        if target == hlo_lib.TRITON_CALL:
            name = m.group(1) if (m := hlo_lib.TRITON_NAME_RE.search(i.line)) else ""
            base, tag, count = name.rpartition(hlo_lib.FLOPS_TAG)
            flops = float(count) if tag and count.isdigit() else 0.0
            eff = hardware.kernel_efficiency(hw, base if tag else name)
            compute = flops / (hw["peak_flops_per_second"]["bfloat16"] * eff)
            return "triton", max(compute, memory / eff) + overhead
        if i.op == "fusion" and "calls" in i.calls:
            flops, dtype = self.fused_dots(i.calls["calls"][0])
        elif i.op == "dot" or target.startswith(hlo_lib.GEMM_CALLS):
            flops = hlo_lib.gemm_flops(i.type, i.line, types)
            dtype = _dtype(types.get(i.operands[0], "") if i.operands else i.type)
        else:
            flops, dtype = 0.0, ""
        if flops:
            peaks = hw["peak_flops_per_second"]
            peak = peaks.get(dtype, peaks["bfloat16"]) * hardware.gemm_efficiency(hw, flops)
            return "gemm", max(flops / peak, memory) + overhead
        return "memory", memory + overhead

    # -------------------------------------------------------------------------------- the schedule
    def _collective_op(self, i: Inst) -> tuple[str, str] | None:
        """(collective op, "start" | "done" | "sync") of a collective instruction, else None; an
        `async-start` wrapping a collective counts as that collective's start."""
        for suffix in ("start", "done"):
            base = i.op.removesuffix("-" + suffix)
            if base != i.op and base in hlo_lib.COLLECTIVES:
                return base, suffix
        if i.op == "async-start" and i.calls.get("calls"):
            root = next((j for j in self.insts(i.calls["calls"][0]) if j.root), None)
            if root is not None and root.op in hlo_lib.COLLECTIVES:
                return root.op, "start"
        if i.op == "async-done":
            return "async", "done"  # a collective's when its start is pending, else nothing to wait for
        return (i.op, "sync") if i.op in hlo_lib.COLLECTIVES else None

    def called(self, i: Inst) -> Cost | None:
        """The cost of the computations a control-flow instruction runs, or None for a kernel."""
        if i.op == "while":
            body = i.calls.get("body", []) + i.calls.get("condition", [])
            trips = int(m.group(1)) if (m := hlo_lib.TRIP_COUNT_RE.search(i.line)) else 1
            out = Cost()
            for comp in body:
                out.add(self.computation(comp), trips)
            return out
        if i.op == "conditional":
            branches = i.calls.get("branch_computations") or i.calls.get("false_computation") or []
            return self.computation(branches[0]) if branches else Cost()
        if i.op in ("call", "async-start") and i.calls.get("calls"):
            return self.computation(i.calls["calls"][0])
        return None

    def computation(self, comp: str) -> Cost:
        """One run of computation `comp` (memoized: every run costs the same)."""
        if comp in self._costs:
            return self._costs[comp]
        types = hlo_lib.declared(self.comps.get(comp, []))
        insts = self.insts(comp)
        done_of = {i.operands[0]: i for i in insts if i.op.endswith("done") and i.operands}
        cost, t, net = Cost(), 0.0, 0.0
        pending: dict[str, tuple[str, float]] = {}  # start -> (op, when the network finishes it)
        for i in insts:
            coll = self._collective_op(i)
            if coll is not None:
                op, phase = coll
                if phase == "done":
                    if op == "async" and not (i.operands and i.operands[0] in pending):
                        continue
                    name = None
                    if i.operands and i.operands[0] in pending:
                        name = i.operands[0]
                        _, end = pending.pop(name)
                    else:  # started in the previous trip: counted from this trip's start
                        end = self.collective_seconds(op, hlo_lib.shape_bytes(i.type), i.line)
                    wait = max(0.0, end - t)
                    cost.collective(op, exposed=wait, name=name)
                    t += wait
                    continue
                done = done_of.get(i.name)
                nbytes = hlo_lib.shape_bytes(done.type if done is not None else i.type)
                source = i.line if i.op != "async-start" else next(
                    j.line for j in self.insts(i.calls["calls"][0]) if j.root)  # fmt: skip
                seconds = self.collective_seconds(op, nbytes, source)
                net = max(t, net) + seconds
                if phase == "start":
                    pending[i.name] = (op, net)
                    cost.collective(op, seconds, runs=1, name=i.name)
                else:
                    cost.collective(op, seconds, net - t, 1, name=i.name)
                    t = net
                continue
            sub = self.called(i)
            if sub is not None:
                cost.add(sub)
                t += sub.seconds
            elif i.op not in FREE:
                kind, seconds = self.kernel(i, types)
                cost.kinds[kind] += seconds
                cost.compute += seconds
                cost.kernels += 1
                t += seconds
        for name in pending:  # waited for in a later trip: exposed whole, by name (see Cost.by_name)
            cost.by_name[name][1] = cost.by_name[name][0]
        cost.seconds = t
        self._costs[comp] = cost
        return cost


def step_cost(hlo: str, hw: dict) -> Cost:
    """The cost of one call of a compiled module (a train step) on one device of `hw`."""
    return Timeline(hlo, hw).step()
