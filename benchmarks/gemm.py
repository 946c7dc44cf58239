"""GEMM throughput on one device: a square sweep (powers of two and near-misses such as 4095 / 4097,
which show the sizing rule), and the ZAYA1 layer shapes at a given tokens-per-microbatch.

    python -m benchmarks.gemm [--dtypes float32,bfloat16] [--min-dim 256] [--max-dim 8192]
        [--near-miss 1024,4096] [--tokens 16384] [--no-zaya] [--no-sweep] [--head-tokens N]
        [--warmup 3] [--iters 10] [--out DIR] [--cpu-devices N]

C[M, N] = A[M, K] @ B[K, N] under jax.jit, inputs and output in the given dtype (fp32 accumulation
is XLA's choice for bf16), the median of `--iters` timed calls (block_until_ready) after `--warmup`.
FLOPs = 2 M N K; TFLOP/s = FLOPs / median time; "% peak" = TFLOP/s over the device's dense peak for
that dtype (zaya_jax.sizing.peak_flops_per_device; "n/a" on CPU or unknown devices). "GFLOP" is the
work of one call: the paper measured that an MI300X GEMM needs ~200 GFLOP to reach peak.

ZAYA1 shapes (zaya_jax.sizing.gemm_shapes of ZayaConfig.zaya1_base(), M = `--tokens`): q/k/v/o
projections, router down / MLP / out, expert gate_up and down at tokens-per-expert = tokens / 16
(top-1, uniform routing), and the lm head at `--head-tokens` rows (default min(tokens, 2048): the
loss-chunk rows, 4 sequences x 512 positions; 0 leaves the head out). Writes DIR/gemm.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import simulate_cpu_devices, write_report
from zaya_jax.runtime import cli

DTYPES = ("float32", "bfloat16")


def sweep_shapes(min_dim: int, max_dim: int, near_miss: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """Square (n, n, n) for powers of two in [min_dim, max_dim], plus (p-1)^3 and (p+1)^3 for each
    p in `near_miss`."""
    shapes = []
    n = 1
    while n < min_dim:
        n *= 2
    while n <= max_dim:
        shapes.append((f"square {n}", n, n, n))
        n *= 2
    for p in near_miss:
        for q in (p - 1, p + 1):
            shapes.append((f"near-miss {q}", q, q, q))
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def zaya_shapes(tokens: int, head_tokens: int | None = None) -> list[tuple[str, int, int, int]]:
    from zaya_jax.model import ZayaConfig
    from zaya_jax.sizing import gemm_shapes

    cfg = ZayaConfig.zaya1_base()
    head = min(tokens, 2048) if head_tokens is None else head_tokens
    return [
        (f"zaya1 {name}", m, n, k)
        for name, m, n, k in gemm_shapes(cfg, tokens, 1, head_tokens=head or 1)
        if head or name != "lm head"
    ]


def time_gemm(m: int, n: int, k: int, dtype: str, warmup: int, iters: int, device=None) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = device or jax.devices()[0]
    # Random operands (GEMMs on constant data draw less power and can run faster than real ones),
    # drawn on the host (no per-shape compilation) and cast there with ml_dtypes.
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.standard_normal((m, k), dtype=np.float32).astype(jnp.dtype(dtype)), device)
    b = jax.device_put(rng.standard_normal((k, n), dtype=np.float32).astype(jnp.dtype(dtype)), device)
    fn = jax.jit(jnp.matmul).lower(a, b).compile()
    for _ in range(warmup):
        fn(a, b).block_until_ready()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times


def measure(
    name: str, m: int, n: int, k: int, dtype: str, warmup: int, iters: int, peak: float | None
) -> dict[str, Any]:
    times = time_gemm(m, n, k, dtype, warmup, iters)
    t = statistics.median(times)
    flops = 2.0 * m * n * k
    tflops = flops / t / 1e12
    return {
        "name": name,
        "m": m,
        "n": n,
        "k": k,
        "dtype": dtype,
        "flops": flops,
        "time_s": t,
        "min_time_s": min(times),
        "tflops": tflops,
        "peak_tflops": peak / 1e12 if peak else None,
        "fraction_of_peak": tflops * 1e12 / peak if peak else None,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'gemm':<26}{'dtype':>9}{'M':>9}{'N':>9}{'K':>7}{'GFLOP':>10}{'time (ms)':>11}"
        f"{'TFLOP/s':>10}{'% peak':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        frac = "n/a" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.1f}"
        lines.append(
            f"{r['name']:<26}{r['dtype']:>9}{r['m']:>9,}{r['n']:>9,}{r['k']:>7,}"
            f"{r['flops'] / 1e9:>10.2f}{r['time_s'] * 1e3:>11.3f}{r['tflops']:>10.3f}{frac:>8}"
        )
    return "\n".join(lines)


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtypes", type=cli.ListOf(DTYPES), default="float32,bfloat16")
    p.add_argument("--min-dim", type=cli.Int(min=1), default=256)
    p.add_argument("--max-dim", type=cli.Int(min=1), default=8192)
    p.add_argument(
        "--near-miss",
        type=cli.ListOf(cli.Int(min=2)),
        default="1024,4096",
        help="powers p whose (p-1)^3 and (p+1)^3 run too",
    )
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument(
        "--tokens", type=cli.Int(min=1), default=16384, help="tokens per microbatch per device (ZAYA1 shapes)"
    )
    p.add_argument(
        "--head-tokens",
        type=cli.Int(min=0),
        default=None,
        help="rows of the lm-head GEMM (default min(tokens, 2048); 0 = leave it out)",
    )
    p.add_argument("--no-zaya", action="store_true")
    p.add_argument("--warmup", type=cli.Int(min=0), default=3)
    p.add_argument("--iters", type=cli.Int(min=1), default=10)
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

    from zaya_jax.sizing import peak_flops_per_device

    dtypes = args.dtypes
    shapes = []
    if not args.no_sweep:
        shapes += sweep_shapes(args.min_dim, args.max_dim, args.near_miss or [])
    if not args.no_zaya:
        shapes += zaya_shapes(args.tokens, args.head_tokens)
    device = jax.devices()[0]
    rows = []
    for dtype in dtypes:
        peak = peak_flops_per_device(device, dtype)
        for name, m, n, k in shapes:
            rows.append(measure(name, m, n, k, dtype, args.warmup, args.iters, peak))
    result = {
        "benchmark": "gemm",
        "backend": jax.default_backend(),
        "device_kind": getattr(device, "device_kind", device.platform),
        "tokens": args.tokens,
        "warmup": args.warmup,
        "iters": args.iters,
        "peak_tflops": {d: (p / 1e12 if (p := peak_flops_per_device(device, d)) else None) for d in dtypes},
        "results": rows,
    }
    print(format_table(rows))
    if args.out:
        write_report(result, args.out, "gemm")
    return result


if __name__ == "__main__":
    cli.run(main)
