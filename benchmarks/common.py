"""Pieces every benchmark shares: simulated CPU devices, the host description, the side-by-side
timing protocol, the printed table and the JSON report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def simulate_cpu_devices(n: int | None) -> None:
    """Before jax's backends start: run on `n` simulated CPU devices (unless XLA_FLAGS already sets
    a count). jax may be imported already (importing zaya_jax does): its platforms are then pinned
    through its config, which it read from JAX_PLATFORMS at import."""
    if not n:
        return
    from zaya_jax.runtime import xla_flags  # here, not at the top: a torch side's process imports no jax

    xla_flags.set_flag(xla_flags.DEVICE_COUNT, n)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def host_info() -> dict[str, Any]:
    """The jax device and the host, for a report's "device" section (imports jax)."""
    import jax

    return {
        "jax_backend": jax.default_backend(),
        "jax_device_kind": jax.devices()[0].device_kind,
        "jax_device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        **cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # what moves a CPU's matmul speed most


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and which of VECTOR_FLAGS it has: two machines with the same core count
    can differ 2-3x in matmul speed (docs/performance.md: 315 against 477 GFLOP/s fp32), so every
    report says which one it ran on."""
    try:
        with open(cpuinfo) as f:
            first = f.read().split("\n\n")[0]  # the first processor's block
    except OSError:
        return {"cpu_model": platform.processor(), "cpu_vector_flags": None}
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = set(fields.get("flags", "").split())
    vector = [f for f in VECTOR_FLAGS if f in flags]
    return {"cpu_model": fields.get("model name", ""), "cpu_vector_flags": vector}


class CompileClock:
    """Sums jax's trace / lower / XLA-compile durations while installed."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self)


@dataclasses.dataclass
class FirstCall:
    output: Any  # what the side's first call returned (compared across sides)
    seconds: float  # wall time of the first call, compilation included
    compile_s: float  # jax trace + lower + compile time inside it (0 for a side without jax)


def first_calls(sides: Sequence[Any], call: Callable[[Any], Any], warmup: int) -> dict[str, FirstCall]:
    """One untimed first call of every side (`side.name`), where jit compilation happens, then
    `warmup - 1` more untimed calls each."""
    out = {}
    for side in sides:
        print(f"first call: {side.name}...", file=sys.stderr, flush=True)
        with CompileClock() as clock:
            t0 = time.perf_counter()
            output = call(side)
            out[side.name] = FirstCall(output, time.perf_counter() - t0, clock.seconds)
        for _ in range(warmup - 1):
            call(side)
    return out


def timed_calls(sides: Sequence[Any], call: Callable[[Any], Any], iters: int) -> dict[str, list[float]]:
    """`iters` timed calls per side, interleaved across the sides with the order reversed every
    iteration, so that drifting machine load falls on all of them alike; seconds per call."""
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    for it in range(iters):
        for side in sides if it % 2 == 0 else sides[::-1]:
            t0 = time.perf_counter()
            call(side)
            times[side.name].append(time.perf_counter() - t0)
        progress = ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items())
        print(f"  iter {it + 1}/{iters}: {progress}", file=sys.stderr, flush=True)
    return times


def add_out_arg(p: argparse.ArgumentParser, name: str) -> None:
    """--out, as print_and_write reads it: default results/NAME.json."""
    p.add_argument(
        "--out",
        default=f"results/{name}.json",
        help=f"JSON report: a .json path, or a directory for DIR/{name}.json ('' = do not write)",
    )


def print_and_write(report: dict[str, Any], table: str, summary: str, out: str, name: str) -> None:
    """Prints the table and the summary line; writes the JSON report where --out says ('' = nowhere)."""
    print(table)
    print(summary)
    if out:
        write_report(report, *report_path(out, name))


def write_report(result: dict[str, Any], out_dir: str, name: str) -> str:
    """Writes `result` to OUT_DIR/NAME.json and says where."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return path


def report_path(out: str, name: str) -> tuple[str, str]:
    """An --out value as write_report's (out_dir, name): a .json path, or a directory for DIR/NAME.json."""
    if out.endswith(".json"):
        return os.path.dirname(os.path.abspath(out)), os.path.basename(out)[:-5]
    return out, name


def fmt(x: float | None, spec: str) -> str:
    """`format(x, spec)`, or "-" for a missing value (a side that was skipped)."""
    return "-" if x is None else format(x, spec)


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """rows[0] is the header: first column left-aligned, the others right-aligned, a rule under it."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ own processes
def peak_rss_bytes() -> int | None:
    """This process' own peak RSS (Linux VmHWM: since its exec, or since `reset_peak_rss`); None
    where /proc is absent. Not getrusage's ru_maxrss: Linux carries that across fork + exec, so a
    child of a large process reports its parent's high-water mark (measured here: 322 MB for a
    29 MB child spawned by a 300 MB parent; the same for wait4's rusage of a subprocess)."""
    return _proc_status_kb("VmHWM")


def rss_bytes() -> int | None:
    """This process' resident set now (VmRSS); None where /proc is absent."""
    return _proc_status_kb("VmRSS")


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0), so that `peak_rss_bytes` then measures one
    operation (a save) over what the process already holds; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def in_own_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a fresh spawned process (fn and its arguments picklable, fn at module
    level); returns its result or raises its exception. Its memory (`peak_rss_bytes` read inside
    fn), its threads and its imports are its own, and nothing it leaves behind reaches the caller."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def apply_env(environ: MutableMapping[str, str], env: dict[str, str | None]) -> None:
    """Sets (a str) or removes (None) the variables `env` names in `environ`, in place."""
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


def set_env(env: dict[str, str | None]) -> None:
    """apply_env on this process' environment: in a spawned child, before the library that reads
    them is imported (libgomp reads OMP_WAIT_POLICY when it loads)."""
    apply_env(os.environ, env)
