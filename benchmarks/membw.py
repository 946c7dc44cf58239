"""Device memory bandwidth with STREAM-like kernels on device arrays, across array sizes.

    python -m benchmarks.membw [--min-bytes 1M] [--max-bytes 4G] [--factor 4] [--dtype float32]
        [--kernels copy,scale,add,triad] [--devices 1] [--warmup 3] [--iters 20] [--out DIR]
        [--cpu-devices N]

Kernels (McCalpin's STREAM; q a scalar), each jit-compiled to one fused XLA kernel:
  copy   c = a          bytes moved = 2 x array bytes (read a, write c)
  scale  b = q * c      2 x array bytes
  add    c = a + b      3 x array bytes (read a, b, write c)
  triad  a = b + q * c  3 x array bytes
GB/s = bytes moved / time (1e9 bytes/s), with the STREAM byte counting above (write-allocate traffic
not counted). "GB/s" uses the median of `--iters` timed calls, "best GB/s" the fastest one (STREAM
reports the best). The array size is per array and per device; with `--devices N > 1` the arrays are
sharded over N devices, every device streams its shard, and the rate is the aggregate (the JSON
also has it per device). The paper measured MI300X HBM saturating near 4.3 TB/s of its 5.3 TB/s.
Writes DIR/membw.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import simulate_cpu_devices, write_report

if __package__ in (None, ""):  # `python benchmarks/membw.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.collectives import BYTES_FLAG, human_bytes, message_sizes
from zaya_jax.runtime import cli

KERNELS = ("copy", "scale", "add", "triad")
# Arrays each kernel reads or writes (STREAM's byte counting).
STREAM_ARRAYS = {"copy": 2, "scale": 2, "add": 3, "triad": 3}
SCALAR = 3.0


def stream_bytes(kernel: str, array_bytes: int) -> int:
    """Bytes a STREAM kernel moves over arrays of `array_bytes` each."""
    return STREAM_ARRAYS[kernel] * array_bytes


def _kernel(kernel: str):
    import jax.numpy as jnp

    if kernel == "copy":
        return lambda a, b, c: jnp.copy(a)
    if kernel == "scale":
        return lambda a, b, c: SCALAR * c
    if kernel == "add":
        return lambda a, b, c: a + b
    if kernel == "triad":
        return lambda a, b, c: b + SCALAR * c
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


def measure(
    kernel: str, count_per_device: int, dtype: str, devices, warmup: int, iters: int
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    sharding = NamedSharding(Mesh(np.asarray(devices), ("x",)), P("x"))
    jdtype = jnp.dtype(dtype)
    arrays = [jax.device_put(jnp.full((n * count_per_device,), v, jdtype), sharding) for v in (1.0, 2.0, 0.5)]
    fn = jax.jit(_kernel(kernel), out_shardings=sharding).lower(*arrays).compile()
    for _ in range(warmup):
        fn(*arrays).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*arrays).block_until_ready()
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    array_bytes = count_per_device * jdtype.itemsize
    moved = stream_bytes(kernel, array_bytes) * n
    return {
        "kernel": kernel,
        "array_bytes_per_device": array_bytes,
        "devices": n,
        "dtype": dtype,
        "bytes_moved": moved,
        "time_s": t,
        "min_time_s": min(times),
        "GBps": moved / t / 1e9,
        "best_GBps": moved / min(times) / 1e9,
        "GBps_per_device": moved / t / 1e9 / n,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'kernel':<8}{'array size':>12}{'devices':>8}{'time (us)':>12}{'GB/s':>11}{'best GB/s':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kernel']:<8}{human_bytes(r['array_bytes_per_device']):>12}{r['devices']:>8}"
            f"{r['time_s'] * 1e6:>12.1f}{r['GBps']:>11.2f}{r['best_GBps']:>11.2f}"
        )
    return "\n".join(lines)


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--min-bytes", type=BYTES_FLAG, default="1M", help="smallest array (per array, per device)"
    )
    p.add_argument("--max-bytes", type=BYTES_FLAG, default="4G")
    p.add_argument("--factor", type=cli.Float(min=1.0, min_open=True), default=4.0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--kernels", type=cli.ListOf(KERNELS), default=",".join(KERNELS))
    p.add_argument(
        "--devices", type=cli.Int(min=1), default=1, help="shard the arrays over this many devices"
    )
    p.add_argument("--warmup", type=cli.Int(min=0), default=3)
    p.add_argument("--iters", type=cli.Int(min=1), default=20)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--cpu-devices", type=cli.Int(min=1), default=None, help="simulate N CPU devices (JAX_PLATFORMS=cpu)"
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    simulate_cpu_devices(args.cpu_devices)
    import jax
    import jax.numpy as jnp

    kernels = args.kernels
    devices = jax.local_devices()
    if not 1 <= args.devices <= len(devices):
        raise SystemExit(f"--devices {args.devices}: {len(devices)} local devices")
    devices = devices[: args.devices]
    itemsize = jnp.dtype(args.dtype).itemsize
    rows = []
    for size in message_sizes(args.min_bytes, args.max_bytes, args.factor):
        count = max(1, size // itemsize)
        for k in kernels:
            rows.append(measure(k, count, args.dtype, devices, args.warmup, args.iters))
    result = {
        "benchmark": "membw",
        "backend": jax.default_backend(),
        "device_kind": getattr(devices[0], "device_kind", devices[0].platform),
        "devices": len(devices),
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "stream_arrays": STREAM_ARRAYS,
        "results": rows,
    }
    print(format_table(rows))
    if args.out:
        write_report(result, args.out, "membw")
    return result


if __name__ == "__main__":
    cli.run(main)
