"""Pallas kernels vs their XLA references: time, TFLOP/s, fraction of peak and max error.

    python -m benchmarks.kernels [--mode auto|perf|check] [--kernels attention,gmm,swiglu,ns]
        [--dtype bfloat16|float32] [--batch 2] [--tokens 16384] [--long] [--warmup 3] [--iters 10]
        [--out results/kernels.json]

perf (default on a GPU): each kernel and its XLA reference at ZAYA1 sizes, compiled for the device
(Pallas Triton lowering: CUDA or ROCm):
  attention  flash_attention vs reference_attention (the model's xla_attention), hd 128, 8 q / 2
             kv heads, seq 4096, causal: plain, packed documents (segment ids), sliding window
             1024; forward and forward+backward. `--long` adds seq 32768 (phase 3; the reference
             is skipped when its [B, Nkv, G, S, S] fp32 logits would exceed 16 GiB).
  gmm        grouped_matmul vs jax.lax.ragged_dot: the expert GEMMs of ZAYA1 (d = I = 2048, 16
             experts) and of the 1B ablation (d = I = 1024), `--tokens` rows per device, uniform and
             skewed routing (some experts empty, 1/8 of the tokens unrouted); forward, fwd+bwd.
  swiglu     swiglu_grouped_pallas vs zaya_jax.model.moe.swiglu_grouped (the whole expert MLP).
  ns         newton_schulz vs zaya_jax.kernels.newton_schulz.orthogonalize on one layer's expert stacks
             ([16, 2048, 4096], [16, 2048, 2048]) and the ablation's; fp32 iteration (Muon's
             default) and bf16.
check (the mode on CPU, where Pallas GPU kernels can only be interpreted): the same kernels at
tiny shapes in interpret mode; the report is the max error vs the reference (values and
gradients), times are not meaningful.

FLOPs are model FLOPs: attention 4 * B * Nq * hd * (allowed query-key pairs) forward and 2.5x that
for the backward (FlashAttention-2's convention; the kernels recompute QK^T in both backward
kernels, which is not counted); gmm 2 * rows * K * N (x3 with backward); NS per matrix and step
4 m^2 n + 2 m^3 (m <= n; the kernel's symmetric-tile savings are not subtracted). TFLOP/s = FLOPs /
median time; "% peak" uses zaya_jax.sizing.peak_flops_per_device for the dtype (n/a on CPU).
Errors: max|kernel - reference| / max|reference| over every output (gradients included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from zaya_jax.runtime import cli

KERNELS = ("attention", "gmm", "swiglu", "ns")
# Interpret-mode programs are big while loops: XLA's CPU optimisation passes only cost time.
_CPU_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ utils
def _compile(fn: Callable, args: Sequence[Any]):
    import jax

    lowered = jax.jit(fn).lower(*args)
    if jax.default_backend() == "cpu":
        return lowered.compile(compiler_options=_CPU_COMPILE)
    return lowered.compile()


def _gpu() -> dict[str, str]:
    """perf mode's kernel keywords: Triton for this process' GPU (its warps: cuda or rocm)."""
    import jax

    from zaya_jax.parallel.mesh import device_platform

    return {"platform": device_platform(jax.devices()[0])}


def _time(compiled, args: Sequence[Any], warmup: int, iters: int) -> list[float]:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return times


def _max_rel_err(got, want) -> float:
    import jax
    import numpy as np

    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        errs.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
    return max(errs) if errs else 0.0


def _peak(dtype: str) -> float | None:
    import jax

    from zaya_jax.sizing import peak_flops_per_device

    try:
        return peak_flops_per_device(jax.devices()[0], dtype)
    except TypeError:  # older signature without dtype
        return peak_flops_per_device(jax.devices()[0])


def _with_grads(fn: Callable, nargs: int) -> Callable:
    """fn(*diff_args, *rest) -> (out, grads wrt the first nargs args) with a fixed random cotangent
    (the ones-like cotangent of sum() would hide sign errors)."""
    import jax
    import jax.numpy as jnp

    def g(*args):
        out, vjp = jax.vjp(lambda *d: fn(*d, *args[nargs:]), *args[:nargs])
        ct = jax.random.normal(jax.random.PRNGKey(7), out.shape, jnp.float32).astype(out.dtype)
        return out, vjp(ct)

    return g


def run_case(
    name: str,
    kernel: str,
    kern: Callable,
    ref: Callable | None,
    args: Sequence[Any],
    flops: float,
    *,
    dtype: str,
    perf: bool,
    warmup: int,
    iters: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compile + check + (perf) time one kernel / reference pair."""
    row: dict[str, Any] = {"name": name, "kernel": kernel, "dtype": dtype, "flops": flops, **(extra or {})}
    _log(f"[kernels] {name} ...")
    try:
        ck = _compile(kern, args)
        got = ck(*args)
        row["max_rel_err"] = None
        cr = None
        if ref is not None:
            cr = _compile(ref, args)
            row["max_rel_err"] = _max_rel_err(got, cr(*args))
        if perf:
            peak = _peak(dtype)
            for side, comp in (("kernel", ck), ("reference", cr)):
                if comp is None:
                    row[f"{side}_ms"] = row[f"{side}_tflops"] = row[f"{side}_fraction_of_peak"] = None
                    continue
                t = statistics.median(_time(comp, args, warmup, iters))
                row[f"{side}_ms"] = t * 1e3
                row[f"{side}_tflops"] = flops / t / 1e12
                row[f"{side}_fraction_of_peak"] = flops / t / peak if peak else None
            k, r = row.get("kernel_ms"), row.get("reference_ms")
            row["speedup"] = r / k if k and r else None
        else:
            t = statistics.median(_time(ck, args, 0, max(1, min(iters, 2))))
            row.update(
                kernel_ms=t * 1e3,
                kernel_tflops=None,
                kernel_fraction_of_peak=None,
                reference_ms=None,
                reference_tflops=None,
                reference_fraction_of_peak=None,
                speedup=None,
            )
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        _log(f"[kernels] {name} FAILED: {row['error']}")
    return row


# ------------------------------------------------------------------------------------ attention
def _pairs(b: int, s: int, window: int | None, seg=None, key_mask=None) -> float:
    """Allowed (query, key) pairs per (batch, head) of a causal seq-s self-attention: counted from
    the reference mask up to s = 8192, analytically (segments ignored) beyond."""
    if s <= 8192:
        import numpy as np

        from zaya_jax.kernels import reference_mask

        allowed = reference_mask(
            s, s, batch=b, q_segment_ids=seg, kv_segment_ids=seg, key_mask=key_mask, sliding_window=window
        )
        return float(np.asarray(allowed).sum()) / b
    if not window:
        return s * (s + 1) / 2
    return float(sum(min(i + 1, window) for i in range(s)))


def attention_cases(args, perf: bool) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.kernels import flash_attention, reference_attention

    dtype = jnp.dtype(args.dtype)
    if perf:
        shapes = [("zaya1 s4096", args.batch, 4096, 8, 2, 128)]
        if args.long:
            shapes.append(("zaya1 phase3 s32768", 1, 32768, 8, 2, 128))
        variants = [("causal", {}), ("packed docs", {"segments": True}), ("window 1024", {"window": 1024})]
    else:
        shapes = [("tiny s45", 2, 45, 4, 2, 32)]
        variants = [("causal", {}), ("packed docs+pad+window", {"segments": True, "window": 9, "pad": True})]
    rows = []
    for shape_name, b, s, nq, nkv, hd in shapes:
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(ks[0], (b, s, nq, hd), jnp.float32).astype(dtype)
        k = jax.random.normal(ks[1], (b, s, nkv, hd), jnp.float32).astype(dtype)
        v = jax.random.normal(ks[2], (b, s, nkv, hd), jnp.float32).astype(dtype)
        ref_bytes = 4 * b * nq * s * s
        for var_name, var in variants:
            rng = np.random.default_rng(0)
            seg = (
                jnp.asarray(np.cumsum(rng.random((b, s)) < 4.0 / s, axis=1), jnp.int32)
                if var.get("segments")
                else None
            )
            km = jnp.ones((b, s), jnp.int32).at[-1, : s // 8].set(0) if var.get("pad") else None
            w = var.get("window")
            extra_args = [x for x in (seg, km) if x is not None]

            def make(fn, interp):
                def f(q, k, v, *rest):
                    rest = list(rest)
                    sg = rest.pop(0) if seg is not None else None
                    m = rest.pop(0) if km is not None else None
                    kw = dict(
                        scale=hd**-0.5, q_segment_ids=sg, kv_segment_ids=sg, key_mask=m, sliding_window=w
                    )
                    if interp:  # check mode: small tiles so the tiny shapes span several of them
                        kw.update(interpret=True, block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
                    else:
                        kw.update(_gpu())
                    return fn(q, k, v, **kw)

                return f

            interp = not perf
            kern, ref = make(flash_attention, interp), make(reference_attention, None)
            if perf and ref_bytes > 16 * 2**30:
                ref = None
            pairs = _pairs(b, s, w, seg, km)
            fwd = 4.0 * b * nq * hd * pairs
            tag = f"attention {shape_name} {var_name}"
            cargs = [q, k, v, *extra_args]
            rows.append(
                run_case(
                    f"{tag} fwd",
                    "flash_attention",
                    kern,
                    ref,
                    cargs,
                    fwd,
                    dtype=args.dtype,
                    perf=perf,
                    warmup=args.warmup,
                    iters=args.iters,
                    extra={"batch": b, "seq": s, "heads": f"{nq}/{nkv}", "head_dim": hd},
                )
            )
            rows.append(
                run_case(
                    f"{tag} fwd+bwd",
                    "flash_attention",
                    _with_grads(kern, 3),
                    _with_grads(ref, 3) if ref else None,
                    cargs,
                    3.5 * fwd,
                    dtype=args.dtype,
                    perf=perf,
                    warmup=args.warmup,
                    iters=args.iters,
                    extra={"batch": b, "seq": s, "heads": f"{nq}/{nkv}", "head_dim": hd},
                )
            )
    return rows


# ------------------------------------------------------------------------------------------- gmm
def _group_sizes(t: int, e: int, skew: bool):
    import numpy as np

    if not skew:
        base = np.full(e, t // e)
        base[: t - base.sum()] += 1
        return base.astype(np.int32)
    routed = t - t // 8  # 1/8 unrouted (the skip class)
    w = 1.0 / np.arange(1, e + 1) ** 1.1
    w[[3, 9]] = 0.0  # two empty experts
    sizes = np.floor(routed * w / w.sum()).astype(np.int32)
    sizes[0] += routed - sizes.sum()
    return sizes


def gmm_cases(args, perf: bool, swiglu: bool) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from zaya_jax.kernels import grouped_matmul, reference_grouped_matmul, swiglu_grouped_pallas
    from zaya_jax.model.moe import ACTIVATIONS, swiglu_grouped

    dtype = jnp.dtype(args.dtype)
    if perf:
        models = [("zaya1", args.tokens, 2048, 2048, 16), ("ablation-1b", args.tokens, 1024, 1024, 16)]
    else:
        models = [("tiny", 40, 32, 16, 4)]
    rows = []
    for model, t, d, i, e in models:
        for skew in (False, True):
            gs = jnp.asarray(
                _group_sizes(t, e, skew) if perf else ([9, 0, 17, 6] if skew else [10, 10, 10, 10]), jnp.int32
            )
            routed = int(gs.sum())
            ks = jax.random.split(jax.random.PRNGKey(1), 3)
            x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(dtype)
            gate_up = (0.02 * jax.random.normal(ks[1], (e, d, 2 * i), jnp.float32)).astype(dtype)
            down = (0.02 * jax.random.normal(ks[2], (e, i, d), jnp.float32)).astype(dtype)
            routing = "skewed" if skew else "uniform"
            extra = {"tokens": t, "routed": routed, "d": d, "I": i, "experts": e, "routing": routing}
            interp = _gpu() if perf else dict(interpret=True, block_m=16, block_n=16, block_k=16)
            if not swiglu:
                a = jax.random.normal(ks[0], (t, i), jnp.float32).astype(dtype)  # the down GEMM's input
                for wname, lhs, w in (("gate_up", x, gate_up), ("down", a, down)):

                    def kern(x, w, gs):
                        return grouped_matmul(x, w, gs, preferred_element_type=jnp.float32, **interp)

                    def ref(x, w, gs):
                        return reference_grouped_matmul(x, w, gs, preferred_element_type=jnp.float32)

                    k_dim, n = w.shape[1:]
                    flops = 2.0 * routed * k_dim * n
                    tag = f"gmm {model} {wname} {routing}"
                    rows.append(
                        run_case(
                            f"{tag} fwd",
                            "grouped_matmul",
                            kern,
                            ref,
                            [lhs, w, gs],
                            flops,
                            dtype=args.dtype,
                            perf=perf,
                            warmup=args.warmup,
                            iters=args.iters,
                            extra={**extra, "k": k_dim, "n": n},
                        )
                    )
                    rows.append(
                        run_case(
                            f"{tag} fwd+bwd",
                            "grouped_matmul",
                            _with_grads(kern, 2),
                            _with_grads(ref, 2),
                            [lhs, w, gs],
                            3 * flops,
                            dtype=args.dtype,
                            perf=perf,
                            warmup=args.warmup,
                            iters=args.iters,
                            extra={**extra, "k": k_dim, "n": n},
                        )
                    )
            else:
                act = ACTIVATIONS["silu"]

                def kern(x, gu, dn, gs):
                    return swiglu_grouped_pallas(x, gu, dn, gs, act, **interp)

                def ref(x, gu, dn, gs):
                    return swiglu_grouped(x, gu, dn, gs, act)

                flops = 6.0 * routed * d * i
                tag = f"swiglu {model} {routing}"
                cargs = [x, gate_up, down, gs]
                rows.append(
                    run_case(
                        f"{tag} fwd",
                        "swiglu_grouped_pallas",
                        kern,
                        ref,
                        cargs,
                        flops,
                        dtype=args.dtype,
                        perf=perf,
                        warmup=args.warmup,
                        iters=args.iters,
                        extra=extra,
                    )
                )
                rows.append(
                    run_case(
                        f"{tag} fwd+bwd",
                        "swiglu_grouped_pallas",
                        _with_grads(kern, 3),
                        _with_grads(ref, 3),
                        cargs,
                        3 * flops,
                        dtype=args.dtype,
                        perf=perf,
                        warmup=args.warmup,
                        iters=args.iters,
                        extra=extra,
                    )
                )
    return rows


# -------------------------------------------------------------------------------------------- ns
def ns_cases(args, perf: bool) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from zaya_jax.kernels import newton_schulz
    from zaya_jax.kernels.newton_schulz import orthogonalize

    if perf:
        stacks = [
            ("zaya1 experts gate_up", (16, 2048, 4096)),
            ("zaya1 experts down", (16, 2048, 2048)),
            ("ablation experts gate_up", (16, 1024, 2048)),
        ]
        ns_dtypes = ("float32", "bfloat16")
    else:
        stacks = [("tiny stack", (3, 24, 40)), ("tiny tall", (2, 50, 20))]
        ns_dtypes = ("float32",)
    rows = []
    for name, shape in stacks:
        x = jax.random.normal(jax.random.PRNGKey(2), shape, jnp.float32)
        bt = 1
        for dim in shape[:-2]:
            bt *= dim
        m, n = sorted(shape[-2:])
        flops = 5 * bt * (4.0 * m * m * n + 2.0 * m**3)
        for nsd in ns_dtypes:
            interp = _gpu() if perf else dict(interpret=True, block=16, block_k=16)
            kern = lambda x, nsd=nsd: newton_schulz(x, ns_dtype=nsd, **interp)
            ref = lambda x, nsd=nsd: orthogonalize(x, ns_dtype=nsd)
            rows.append(
                run_case(
                    f"ns {name} ns_dtype={nsd}",
                    "newton_schulz",
                    kern,
                    ref,
                    [x],
                    flops,
                    dtype=nsd,
                    perf=perf,
                    warmup=args.warmup,
                    iters=args.iters,
                    extra={"shape": list(shape), "ns_steps": 5},
                )
            )
    return rows


# -------------------------------------------------------------------------------------- report
def format_table(rows: list[dict[str, Any]]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    head = (
        f"{'case':<52}{'dtype':>9}{'GFLOP':>10}{'kern ms':>10}{'TFLOP/s':>9}{'%peak':>7}"
        f"{'ref ms':>10}{'TFLOP/s':>9}{'%peak':>7}{'speedup':>8}{'max err':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<52}{r['dtype']:>9}  ERROR {r['error'][:80]}")
            continue
        kp, rp = r.get("kernel_fraction_of_peak"), r.get("reference_fraction_of_peak")
        lines.append(
            f"{r['name']:<52}{r['dtype']:>9}{r['flops'] / 1e9:>10.2f}{f(r.get('kernel_ms'), '.3f'):>10}"
            f"{f(r.get('kernel_tflops'), '.1f'):>9}{f(None if kp is None else 100 * kp, '.1f'):>7}"
            f"{f(r.get('reference_ms'), '.3f'):>10}{f(r.get('reference_tflops'), '.1f'):>9}"
            f"{f(None if rp is None else 100 * rp, '.1f'):>7}{f(r.get('speedup'), '.2f'):>8}"
            f"{f(r.get('max_rel_err'), '.1e'):>10}"
        )
    return "\n".join(lines)


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mode",
        choices=("auto", "perf", "check"),
        default="auto",
        help="auto: perf on a GPU, check (tiny shapes, interpret mode) on CPU",
    )
    p.add_argument("--kernels", type=cli.ListOf(KERNELS), default=",".join(KERNELS))
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="operand dtype of attention / gmm / swiglu",
    )
    p.add_argument("--batch", type=cli.Int(min=1), default=2, help="attention batch (sequences) per device")
    p.add_argument(
        "--tokens", type=cli.Int(min=1), default=16384, help="expert GEMM rows (tokens) per device"
    )
    p.add_argument("--long", action="store_true", help="add the 32k-token attention case")
    p.add_argument("--warmup", type=cli.Int(min=0), default=3)
    p.add_argument("--iters", type=cli.Int(min=1), default=10)
    p.add_argument("--out", default=None, help="JSON report: a .json path or a directory")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import jax

    kernels = args.kernels
    backend = jax.default_backend()
    mode = args.mode if args.mode != "auto" else ("check" if backend == "cpu" else "perf")
    perf = mode == "perf"
    if perf and backend == "cpu":
        _log("[kernels] --mode perf on CPU: Pallas GPU kernels only run interpreted; numbers are meaningless")
    rows: list[dict[str, Any]] = []
    if "attention" in kernels:
        rows += attention_cases(args, perf)
    if "gmm" in kernels:
        rows += gmm_cases(args, perf, swiglu=False)
    if "swiglu" in kernels:
        rows += gmm_cases(args, perf, swiglu=True)
    if "ns" in kernels:
        rows += ns_cases(args, perf)
    device = jax.devices()[0]
    result = {
        "benchmark": "kernels",
        "mode": mode,
        "backend": backend,
        "device_kind": getattr(device, "device_kind", device.platform),
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "peak_tflops": {d: (p / 1e12 if (p := _peak(d)) else None) for d in ("bfloat16", "float32")},
        "max_rel_err": max(
            (r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None), default=None
        ),
        "errors": [r["name"] for r in rows if "error" in r],
        "results": rows,
    }
    print(format_table(rows))
    if args.out:
        path = args.out if args.out.endswith(".json") else os.path.join(args.out, "kernels.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    cli.run(main)
