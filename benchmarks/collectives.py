"""Collective bandwidth over the devices, nccl-tests style: all-reduce, reduce-scatter, all-gather,
broadcast and all-to-all across message sizes and device counts.

    python -m benchmarks.collectives [--collectives all_reduce,reduce_scatter,all_gather,broadcast,all_to_all]
        [--min-bytes 1K] [--max-bytes 1G] [--factor 2] [--device-counts 2,4,8] [--dtype bfloat16]
        [--warmup 5] [--iters 20] [--out DIR] [--no-plot] [--cpu-devices N]
        [--distributed | --coordinator HOST:PORT --num-processes N --process-id I]

Each collective is a `jax.shard_map` over a 1-D mesh of the first n devices, jit-compiled; every
size is run `--warmup` times untimed, then `--iters` times, each timed with block_until_ready; the
reported time is the median. Sizes follow nccl-tests (doc/PERFORMANCE.md in NVIDIA/nccl-tests):

  collective      size S (bytes)                         busbw = algbw x factor
  all_reduce      the buffer every rank reduces          2 (n - 1) / n
  reduce_scatter  the full input of a rank (n chunks)    (n - 1) / n
  all_gather      the full output of a rank (n chunks)   (n - 1) / n
  broadcast       the buffer sent from rank 0            1
  all_to_all      the full send buffer of a rank         (n - 1) / n

with algbw = S / t (GB/s = 1e9 bytes/s). busbw is comparable to the hardware's link bandwidth
whatever n is (for a ring algorithm it is what each link carries); nccl-tests' all-to-all also uses
(n - 1) / n (the 1/n of the buffer that stays local does not cross a link).

Broadcast uses `jax.lax.pbroadcast` (XLA CollectiveBroadcast) where the backend lowers it, else a
masked psum (an all-reduce of a buffer that is zero except on rank 0, as `pbroadcast` is documented
to equal); each row records which (`impl`), since a masked psum moves all-reduce traffic.

Multi-process (one process per node or per GPU): `--distributed` (implied under `srun` / `mpirun`
with more than one task) calls `jax.distributed.initialize()` with no arguments (SLURM / Open MPI
auto-detection), or give `--coordinator/--num-processes/--process-id` explicitly. Device subsets are the first n of
`jax.devices()` (process-major); a process with no device in a subset skips it, and process 0 writes
the table, JSON and plots. Outputs: a printed table, DIR/collectives.json, DIR/<collective>.png
(busbw vs message size, one line per device count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import simulate_cpu_devices, write_report
from zaya_jax.analysis.exchange import all_to_all_bytes, ideal_exchange_bytes
from zaya_jax.runtime import cli

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


# ------------------------------------------------------------------ nccl-tests bandwidth formulas
def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md, and src/alltoall.cu for all-to-all).

    all_reduce: 2(n-1)/n (a ring reduce-scatter then all-gather, each moving (n-1)/n of S per rank);
    reduce_scatter, all_gather, all_to_all: (n-1)/n; broadcast: 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth S / t in GB/s (1e9 bytes per second), as nccl-tests prints it."""
    return size_bytes / seconds / 1e9


def busbw(collective: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw x busbw_factor(collective, n)."""
    return algbw(size_bytes, seconds) * busbw_factor(collective, n)


# ---------------------------------------------------------------------------------------- sizes
def parse_bytes(text: str | int) -> int:
    """'1024', '1K', '64KiB', '1M', '1G' -> bytes (binary multiples)."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


BYTES_FLAG = cli.Int(
    min=1, convert=parse_bytes, what="a size in bytes (4096, 64K, 1M, 1G)"
)  # --min-bytes / --max-bytes (membw's too)


def message_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min*factor, ... up to max (inclusive), as nccl-tests' -b/-e/-f."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor <= 1:
        raise ValueError(
            f"need 0 < min_bytes <= max_bytes and factor > 1, got {min_bytes}, {max_bytes}, {factor}"
        )
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        out.append(round(s))
        s *= factor
    return out


def element_count(size_bytes: int, itemsize: int, n: int) -> int:
    """Elements of a buffer of about `size_bytes`, a multiple of n (>= n) so it splits into n chunks."""
    count = max(1, size_bytes // itemsize)
    return max(n, count - count % n)


def human_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:g} {unit}"
    return f"{int(b)} B"


def expert_exchange(c, factors: Sequence[float], devices: Sequence[Any]) -> list[dict[str, Any]]:
    """All-to-all bytes per MoE block of config `c`'s compiled train step on `devices`, for each
    dropless exchange capacity factor (a factor of mesh.expert or more is the C = T exchange, every
    token's slot sent to every peer), against the ideal 4 x T x d x itemsize."""
    import jax.numpy as jnp

    from zaya_jax.analysis.compiled import compile_step

    rows = []
    for f in factors:
        c = c.copy_and_resolve_references()
        c.model.moe_exchange_capacity_factor = float(f)
        step = compile_step(c, list(devices))
        cfg, mesh = step.cfg, step.mesh
        main, spill = all_to_all_bytes(step.compiled.as_text())
        blocks = cfg.num_hidden_layers * c.train.grad_accum  # MoE block calls per step
        tokens = c.train.batch_size * c.train.seq_len // (len(devices) * c.train.grad_accum)
        ideal = ideal_exchange_bytes(tokens, cfg.hidden_size, jnp.dtype(cfg.dtype).itemsize)
        rows.append(
            {
                "exchange_factor": float(f),
                "mesh": {a: int(s) for a, s in mesh.shape.items()},
                "tokens_per_device": tokens,
                "remat": cfg.remat,
                "bytes_per_block": main / blocks,
                "spill_bytes_per_block": spill / blocks,
                "ideal_bytes_per_block": ideal,
                "ratio_to_ideal": main / blocks / ideal,
            }
        )
    return rows


# ------------------------------------------------------------------------------------ benchmark
def _setup_environment(args: argparse.Namespace) -> None:
    """Before jax is imported: simulated CPU devices on request."""
    simulate_cpu_devices(args.cpu_devices)


def launched_multi_process(environ: dict[str, str] | None = None) -> bool:
    """True under a multi-task launcher that jax.distributed.initialize() auto-detects (srun, mpirun)."""
    env = os.environ if environ is None else environ
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(env.get(key, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def _initialize_distributed(args: argparse.Namespace) -> None:
    import jax

    if args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    elif args.distributed or launched_multi_process():
        jax.distributed.initialize()


def build_collective(name: str, mesh, broadcast_impl: str = "auto") -> tuple[Callable, str]:
    """A jitted function of the global input [n * local] sharded over the mesh axis "x", and the
    implementation used (relevant for broadcast)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    axis = "x"
    impl = name
    if name == "all_reduce":
        body = lambda v: jax.lax.psum(v, axis)
    elif name == "reduce_scatter":
        body = lambda v: jax.lax.psum_scatter(v, axis, scatter_dimension=0, tiled=True)
    elif name == "all_gather":
        body = lambda v: jax.lax.all_gather(v, axis, tiled=True)
    elif name == "all_to_all":
        body = lambda v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True)
    elif name == "broadcast":

        def masked(v):
            keep = jax.lax.axis_index(axis) == 0
            return jax.lax.psum(jnp.where(keep, v, jnp.zeros_like(v)), axis)

        native = lambda v: jax.lax.pbroadcast(v, axis, 0)
        if broadcast_impl == "masked_psum":
            body, impl = masked, "broadcast:masked_psum"
        else:
            body, impl = native, "broadcast:pbroadcast"
    else:
        raise ValueError(f"unknown collective {name!r}")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    return fn, impl


def _local_shape(name: str, count: int, n: int) -> int:
    """Elements of each rank's input: the whole buffer, except all-gather (one chunk per rank)."""
    return count // n if name == "all_gather" else count


def time_collective(fn: Callable, x, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def run_one(
    name: str,
    devices: Sequence[Any],
    size_bytes: int,
    dtype: str,
    warmup: int,
    iters: int,
    broadcast_impl: str = "auto",
) -> dict[str, Any] | None:
    """One (collective, device subset, size) measurement; None if this process has no device in it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    if not any(d.process_index == jax.process_index() for d in devices):
        return None
    mesh = Mesh(np.asarray(devices), ("x",))
    jdtype = jnp.dtype(dtype)
    count = element_count(size_bytes, jdtype.itemsize, n)
    local = _local_shape(name, count, n)
    sharding = NamedSharding(mesh, P("x"))
    x = jax.make_array_from_callback((n * local,), sharding, lambda idx: np.ones((local,), dtype=jdtype))
    impls = [broadcast_impl] if name != "broadcast" or broadcast_impl != "auto" else ["native", "masked_psum"]
    last_error = None
    for impl_choice in impls:
        fn, impl = build_collective(name, mesh, impl_choice)
        try:
            fn = fn.lower(x).compile()
            times = time_collective(fn, x, warmup, iters)
            break
        except Exception as e:  # e.g. pbroadcast has no lowering on this backend: use the masked psum
            last_error = e
    else:
        raise RuntimeError(f"{name}: no implementation compiled: {last_error}")
    t = statistics.median(times)
    size = count * jdtype.itemsize  # the nccl-tests size S of this row
    return {
        "collective": name,
        "impl": impl,
        "devices": n,
        "bytes": size,
        "count": count,
        "dtype": dtype,
        "time_s": t,
        "time_us": t * 1e6,
        "min_time_s": min(times),
        "algbw_GBps": algbw(size, t),
        "busbw_GBps": busbw(name, size, t, n),
        "busbw_factor": busbw_factor(name, n),
        "iters": iters,
    }


def default_device_counts(total: int) -> list[int]:
    out, n = [], 2
    while n <= total:
        out.append(n)
        n *= 2
    return out or [total]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'collective':<15}{'n':>4}{'size':>12}{'count':>13}{'time (us)':>12}"
        f"{'algbw GB/s':>12}{'busbw GB/s':>12}  impl"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['collective']:<15}{r['devices']:>4}{human_bytes(r['bytes']):>12}{r['count']:>13,}"
            f"{r['time_us']:>12.1f}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}  {r['impl']}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: str, device_kind: str) -> dict[str, str]:
    """One PNG per collective: busbw vs message size (log2 x), one line per device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for name in sorted({r["collective"] for r in rows}, key=COLLECTIVES.index):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sel = [r for r in rows if r["collective"] == name]
        for n in sorted({r["devices"] for r in sel}):
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in sel if r["devices"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{n} devices")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes, nccl-tests convention)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{name} on {device_kind}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths[name] = path
    return paths


def format_exchange_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'factor':>8}{'MiB/block':>14}{'ideal MiB':>14}{'x ideal':>9}{'spill MiB':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['exchange_factor']:>8g}{r['bytes_per_block'] / 2**20:>14,.2f}"
            f"{r['ideal_bytes_per_block'] / 2**20:>14,.2f}{r['ratio_to_ideal']:>9.2f}"
            f"{r['spill_bytes_per_block'] / 2**20:>14,.2f}"
        )
    return "\n".join(lines)


def expert_exchange_main(args: argparse.Namespace) -> dict[str, Any]:
    """--expert-exchange: the `expert_exchange` rows of a config, printed and written to --out."""
    import jax

    from benchmarks.train_config import load_config

    c = load_config(args.expert_exchange)
    if args.exchange_mesh:
        c.mesh.data, c.mesh.fsdp, c.mesh.expert = args.exchange_mesh
    n = c.mesh.expert if c.mesh.expert > 0 else jax.device_count()
    factors = args.exchange_factors or [1.5, float(n)]
    rows = expert_exchange(c, factors, jax.devices())
    result = {"benchmark": "expert_exchange", "config": args.expert_exchange, "results": rows}
    print(
        f"{args.expert_exchange}: mesh {rows[0]['mesh']}, {rows[0]['tokens_per_device']} tokens per device, "
        f"remat {rows[0]['remat']} (the backward reuses what the forward exchange received)"
    )
    print(format_exchange_table(rows))
    if args.out:
        write_report(result, args.out, "expert_exchange")
    return result


def _mesh_size(text: str) -> int:
    size = int(text)
    if size < 1 and size != -1:
        raise ValueError("a size is >= 1 or -1")
    return size


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--collectives", type=cli.ListOf(COLLECTIVES), default=",".join(COLLECTIVES))
    p.add_argument("--min-bytes", type=BYTES_FLAG, default="1K", help="smallest message (1K = 1024 bytes)")
    p.add_argument("--max-bytes", type=BYTES_FLAG, default="1G", help="largest message")
    p.add_argument(
        "--factor", type=cli.Float(min=1.0, min_open=True), default=2.0, help="size multiplier between steps"
    )
    p.add_argument(
        "--device-counts",
        type=cli.ListOf(cli.Int(min=1)),
        default=None,
        help="comma list (default powers of two up to all devices)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--warmup", type=cli.Int(min=0), default=5)
    p.add_argument("--iters", type=cli.Int(min=1), default=20)
    p.add_argument("--broadcast-impl", default="auto", choices=("auto", "native", "masked_psum"))
    p.add_argument("--out", default=None, help="directory for collectives.json and the PNGs")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--cpu-devices",
        type=cli.Int(min=1),
        default=None,
        help="simulate N CPU devices (sets XLA_FLAGS before jax loads; implies JAX_PLATFORMS=cpu)",
    )
    p.add_argument(
        "--expert-exchange",
        metavar="CONFIG",
        default=None,
        help="instead of the sweep: all-to-all bytes per MoE block of CONFIG's compiled train step "
        "(file.py[:arg]) against the ideal 4 x T x d x itemsize",
    )
    p.add_argument(
        "--exchange-mesh",
        type=cli.ListOf(cli.Parsed(_mesh_size, "a size >= 1 or -1", invalid=("0", "-2")), length=3),
        default=None,
        help="data,fsdp,expert for --expert-exchange",
    )
    p.add_argument(
        "--exchange-factors",
        type=cli.ListOf(cli.Float(min=0.0, min_open=True)),
        default=None,
        help="comma list of moe_exchange_capacity_factor (default 1.5,n)",
    )
    p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() (auto-detect)")
    p.add_argument("--coordinator", default=os.environ.get("ZAYA_COORDINATOR"))
    p.add_argument("--num-processes", type=cli.Int(min=1), default=None)
    p.add_argument("--process-id", type=cli.Int(min=0), default=None)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _setup_environment(args)
    import jax

    _initialize_distributed(args)
    if args.expert_exchange:
        return expert_exchange_main(args)
    names = args.collectives
    devices = jax.devices()
    counts = args.device_counts or default_device_counts(len(devices))
    bad = [c for c in counts if c < 1 or c > len(devices)]
    if bad:
        raise SystemExit(f"--device-counts {bad}: only {len(devices)} devices available")
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    lead = jax.process_index() == 0
    rows = []
    for name in names:
        for n in counts:
            for size in sizes:
                row = run_one(
                    name, devices[:n], size, args.dtype, args.warmup, args.iters, args.broadcast_impl
                )
                if row is not None:
                    rows.append(row)
                    if lead:
                        print(
                            f"{name:<15}{n:>4}{human_bytes(row['bytes']):>12}{row['time_us']:>12.1f} us"
                            f"{row['busbw_GBps']:>12.3f} GB/s busbw",
                            file=sys.stderr,
                            flush=True,
                        )
    device_kind = getattr(devices[0], "device_kind", devices[0].platform)
    result = {
        "benchmark": "collectives",
        "backend": jax.default_backend(),
        "device_kind": device_kind,
        "num_devices": len(devices),
        "num_processes": jax.process_count(),
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "device_counts": counts,
        "sizes": sizes,
        "units": {
            "bytes": "nccl-tests size S",
            "time_s": "median seconds",
            "algbw_GBps": "S / t, 1e9 B/s",
            "busbw_GBps": "algbw x busbw_factor",
        },
        "busbw_factors": {
            "all_reduce": "2(n-1)/n",
            "reduce_scatter": "(n-1)/n",
            "all_gather": "(n-1)/n",
            "broadcast": "1",
            "all_to_all": "(n-1)/n",
        },
        "results": rows,
        "plots": {},
    }
    if lead:
        print(format_table(rows))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            if not args.no_plot and rows:
                result["plots"] = plot(rows, args.out, device_kind)
            write_report(result, args.out, "collectives")
    return result


if __name__ == "__main__":
    cli.run(main)
