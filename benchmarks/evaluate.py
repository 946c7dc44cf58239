"""Evaluation throughput, side by side: our bucketed Scorer vs the same Scorer unbucketed vs transformers.

    python -m benchmarks.evaluate [--requests 256] [--max-len 256] [--batch-size 8] [--min-bucket 64]
        [--lengths loguniform|uniform] [--iters 3] [--warmup 1] [--set KEY=VALUE ...]
        [--torch-batching padded|single] [--skip-torch] [--mesh none|auto|data=N,...]
        [--out results/evaluate.json] [--cpu-devices N]

(`python benchmarks/evaluate.py ...` works too.) One random tiny model (`ZayaConfig.tiny(vocab_size=259)`,
the byte tokenizer's vocabulary, `--set` to change it) is built as transformers' ZayaForCausalLM with
every weight randomised (norms, scales, biases and balancing biases too), saved as an HF directory and
loaded back by `zaya_jax.hf.load_pretrained`, so both frameworks hold the same fp32 weights. The
requests are multiple-choice-like: random ASCII contexts with 4 short choices each, turned into
`Request`s by `zaya_jax.evaluate.multiple_choice.choice_requests`; example lengths are drawn from
[8, --max-len] (log-uniform by default: most tasks are short next to max_len). Three sides score the
same requests:

  bucketed    Scorer(batch_size, max_len, min_bucket): sorted by length, every batch padded to the
              smallest power-of-two bucket that fits; one compilation per bucket used
  unbucketed  Scorer(..., min_bucket=max_len): every batch padded to max_len; one compilation
  torch       transformers' ZayaForCausalLM (eval, inference_mode), the same length-sorted batches of
              --batch-size right-padded to their longest row (or one unpadded request at a time with
              --torch-batching single); log_softmax + gather over the scored targets

Every side first runs one untimed pass (ours: all compilations happen there; the trace + lower +
XLA compile time is summed from jax.monitoring events), then --warmup - 1 more untimed passes, then
--iters timed passes, interleaved across the sides (order reversed every iteration); a pass is one
`score(requests)` call end to end (host-side batching and the device round trip included) and the
reported time is the median. The per-request log-likelihoods of the sides are compared (max abs
difference in nats). See benchmarks/README.md for the columns and the JSON.
"""

from __future__ import annotations

import os

# As in train_step.py: passive OpenMP waiting keeps torch's CPU timings sane on a busy small machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import datetime
import math
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/evaluate.py`: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks.common import (
    add_out_arg,
    first_calls,
    fmt,
    format_rows,
    host_info,
    print_and_write,
    simulate_cpu_devices,
    timed_calls,
)
from benchmarks.reference import (
    add_model_args,
    add_torch_args,
    model_report,
    overrides_or_exit,
    parse_overrides,
    tiny_config,
    weights,
)
from zaya_jax.parallel.mesh import MESH_FLAG
from zaya_jax.runtime import cli

BUCKETED, UNBUCKETED, TORCH = "bucketed", "unbucketed", "torch"
CHOICES_PER_EXAMPLE = 4
MAX_CHOICE_TOKENS = 16  # " " + up to 15 characters
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz     "))  # ~1 space in 6 characters


# ---------------------------------------------------------------------------------------- requests
def make_examples(num_requests: int, max_len: int, lengths: str, seed: int):
    """Multiple-choice examples of random ASCII text (1 byte = 1 token), enough for `num_requests`
    choices. Each example draws a length L in [8, max_len]; its choices are 2..16 tokens (with the
    delimiter) and its context fills L up to the longest choice (at least 8 tokens with the shortest),
    so requests are 8..max(L, 22) tokens; choice_requests cuts longer contexts to max_len."""
    from zaya_jax.evaluate.multiple_choice import Example

    rng = np.random.default_rng(seed)

    def text(n: int) -> str:
        s = "".join(rng.choice(LETTERS, size=n))
        return s[:-1] + "x" if s.endswith(" ") else s  # trailing spaces would move to the choices

    examples = []
    for e in range(-(-num_requests // CHOICES_PER_EXAMPLE)):
        if lengths == "uniform":
            L = int(rng.integers(8, max_len + 1))
        else:
            L = round(math.exp(rng.uniform(math.log(8), math.log(max_len))))
        k = rng.integers(2, min(MAX_CHOICE_TOKENS, L) + 1, size=CHOICES_PER_EXAMPLE)
        choices = tuple(text(int(n) - 1).replace(" ", "y") for n in k)  # the delimiter is the 1st token
        context = max(L - int(k.max()), 8 - int(k.min()))  # every request 8..max(L, 22) tokens
        examples.append(Example(text(context), choices, 0, id=e))
    return examples


def make_requests(num_requests: int, max_len: int, lengths: str, seed: int):
    from zaya_jax.data.tokenizer import ByteTokenizer
    from zaya_jax.evaluate.multiple_choice import choice_requests

    tok = ByteTokenizer()
    examples = make_examples(num_requests, max_len, lengths, seed)
    flat = [r for e in examples for r in choice_requests(e, tok, tok.eos_id, max_len)]
    return flat[:num_requests]


# ------------------------------------------------------------------------------------------- sides
@dataclasses.dataclass
class Scores:
    logprob: np.ndarray  # [requests] float64
    greedy: np.ndarray  # [requests] bool


class OursSide:
    """One `zaya_jax.evaluate.Scorer`."""

    def __init__(self, name: str, cfg, variables, mesh, batch_size: int, max_len: int, min_bucket: int):
        from zaya_jax.evaluate.scoring import Scorer

        self.name, self.variables = name, variables
        self.scorer = Scorer(cfg, mesh=mesh, batch_size=batch_size, max_len=max_len, min_bucket=min_bucket)

    def score(self, requests) -> Scores:
        out = self.scorer.score(self.variables, requests)
        return Scores(np.array([s.logprob for s in out]), np.array([s.greedy for s in out]))

    def computed_tokens(self, requests) -> tuple[int, int]:
        """(batches, padded positions the model computes), as Scorer.score batches them."""
        from zaya_jax.evaluate.scoring import length_sorted_batches

        b = self.scorer.batch_size
        batches = length_sorted_batches(requests, b)
        return len(batches), sum(
            b * self.scorer.bucket_for(len(requests[rows[0]].inputs)) for rows in batches
        )


class TorchSide:
    """transformers' ZayaForCausalLM, length-sorted right-padded batches (or one request at a time)."""

    name = TORCH

    def __init__(self, model, batch_size: int, device: str):
        import torch

        self.torch, self.model, self.batch_size, self.device = torch, model, batch_size, torch.device(device)

    def computed_tokens(self, requests) -> tuple[int, int]:
        from zaya_jax.evaluate.scoring import length_sorted_batches

        batches = length_sorted_batches(requests, self.batch_size)
        return len(batches), sum(len(rows) * len(requests[rows[0]].inputs) for rows in batches)

    def score(self, requests) -> Scores:
        from zaya_jax.evaluate.scoring import length_sorted_batches, right_padded_batch

        torch = self.torch
        logprob = np.zeros(len(requests))
        greedy = np.zeros(len(requests), bool)
        with torch.inference_mode():
            for rows in length_sorted_batches(requests, self.batch_size):
                # as our sides batch them, but each batch only as wide as its longest request
                batch = right_padded_batch(requests, rows, len(rows), len(requests[rows[0]].inputs))
                as_t = lambda x: torch.as_tensor(x, device=self.device)
                as_long = lambda x: as_t(x).long()  # torch indexes (embedding, gather) with int64
                logits = self.model(
                    input_ids=as_long(batch["input_ids"]),
                    attention_mask=as_long(batch["attention_mask"]),
                    use_cache=False,
                ).logits.float()
                t, m = as_long(batch["targets"]), as_t(batch["score_mask"])
                logp = torch.log_softmax(logits, dim=-1).gather(-1, t[..., None])[..., 0]
                lp = torch.where(m, logp, 0.0).sum(-1).double().cpu().numpy()
                gr = ((logits.argmax(-1) == t) | ~m).all(-1).cpu().numpy()
                logprob[rows], greedy[rows] = lp, gr
        return Scores(logprob, greedy)


# --------------------------------------------------------------------------------------- benchmark
def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b))) if len(a) else 0.0


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from zaya_jax.evaluate import parse_mesh

    cfg = tiny_config(parse_overrides(args.set or []))
    requests = make_requests(args.requests, args.max_len, args.lengths, args.seed)
    lengths = np.array([len(r.inputs) for r in requests])
    scored = np.array([len(r.targets) - r.score_from for r in requests])
    mesh = parse_mesh(args.mesh)
    device = {
        **host_info(),
        "mesh": None if mesh is None else dict(mesh.shape),
        "jax_compilation_cache_dir": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
    }
    variables, ref = weights(cfg, args)
    if mesh is not None:  # laid out once, so that score() does not move them on every pass
        from zaya_jax.hf.pretrained import variable_shardings

        variables = jax.device_put(variables, variable_shardings(variables, mesh))
    sides: list[Any] = [
        OursSide(BUCKETED, cfg, variables, mesh, args.batch_size, args.max_len, args.min_bucket),
        OursSide(UNBUCKETED, cfg, variables, mesh, args.batch_size, args.max_len, args.max_len),
    ]
    if ref is not None:
        batch = 1 if args.torch_batching == "single" else args.batch_size
        sides.append(TorchSide(ref.model, batch, ref.device_info["torch_device"]))
        device.update(ref.device_info)

    # First (untimed) pass of every side: our compilations happen here.
    first = first_calls(sides, lambda side: side.score(requests), args.warmup)
    traces_after_warmup = {s.name: s.scorer.num_traces for s in sides if isinstance(s, OursSide)}
    times = timed_calls(sides, lambda side: side.score(requests), args.iters)
    scores = {name: f.output for name, f in first.items()}

    num_tokens = int(lengths.sum())
    results: dict[str, Any] = {BUCKETED: None, UNBUCKETED: None, TORCH: None}
    for side in sides:
        pass_s = statistics.median(times[side.name])
        batches, computed = side.computed_tokens(requests)
        ours = isinstance(side, OursSide)
        results[side.name] = {
            "pass_s": pass_s,
            "pass_times_s": times[side.name],
            "requests_per_s": len(requests) / pass_s,
            "tokens_per_s": num_tokens / pass_s,
            "first_pass_s": first[side.name].seconds,
            "compile_s": first[side.name].compile_s if ours else None,
            "compilations": side.scorer.num_traces if ours else None,
            "recompiled_while_timed": (side.scorer.num_traces != traces_after_warmup[side.name])
            if ours
            else None,
            "buckets": list(side.scorer.buckets) if ours else None,
            "batch_size": side.scorer.batch_size if ours else side.batch_size,
            "batches": batches,
            "computed_tokens": computed,
            "padding_fraction": 1.0 - num_tokens / computed,
            "max_abs_diff_vs_bucketed": _max_abs(scores[side.name].logprob, scores[BUCKETED].logprob),
            "greedy_mismatches_vs_bucketed": int(np.sum(scores[side.name].greedy != scores[BUCKETED].greedy)),
        }
    ratio = lambda a, b: (
        results[a]["requests_per_s"] / results[b]["requests_per_s"] if results[a] and results[b] else None
    )
    tor = results[TORCH]
    return {
        "benchmark": "evaluate",
        "config": {
            "requests": len(requests),
            "max_len": args.max_len,
            "batch_size": args.batch_size,
            "min_bucket": args.min_bucket,
            "lengths": args.lengths,
            "iters": args.iters,
            "warmup": args.warmup,
            "seed": args.seed,
            "torch_batching": None if tor is None else args.torch_batching,
            "request_tokens": num_tokens,
            "scored_tokens": int(scored.sum()),
            "length_min": int(lengths.min()),
            "length_mean": float(lengths.mean()),
            "length_max": int(lengths.max()),
            **model_report(cfg, args.set),
        },
        "device": device,
        "results": results,
        "agreement": {
            "max_abs_diff_unbucketed_vs_bucketed": results[UNBUCKETED]["max_abs_diff_vs_bucketed"],
            "max_abs_diff_torch_vs_bucketed": None if tor is None else tor["max_abs_diff_vs_bucketed"],
            "greedy_mismatches_torch_vs_bucketed": None
            if tor is None
            else tor["greedy_mismatches_vs_bucketed"],
            "max_abs_loglik": float(np.max(np.abs(scores[BUCKETED].logprob))),
        },
        "ratios": {
            "bucketed_over_unbucketed": ratio(BUCKETED, UNBUCKETED),
            "bucketed_over_torch": ratio(BUCKETED, TORCH),
            "unbucketed_over_torch": ratio(UNBUCKETED, TORCH),
        },
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------------------------------ report
def format_table(report: dict[str, Any]) -> str:
    header = (
        "side",
        "batches",
        "pad %",
        "compiles",
        "compile s",
        "1st pass s",
        "pass ms",
        "requests/s",
        "tokens/s",
        "vs bucketed",
        "max |d loglik|",
    )
    base = report["results"][BUCKETED]["requests_per_s"]
    rows = [header]
    for name, r in report["results"].items():
        if r is None:
            continue
        rows.append(
            (
                name,
                str(r["batches"]),
                fmt(100 * r["padding_fraction"], ".1f"),
                fmt(r["compilations"], "d"),
                fmt(r["compile_s"], ".2f"),
                fmt(r["first_pass_s"], ".2f"),
                fmt(1e3 * r["pass_s"], ".1f"),
                fmt(r["requests_per_s"], ",.0f"),
                fmt(r["tokens_per_s"], ",.0f"),
                fmt(r["requests_per_s"] / base, ".2f") + "x",
                "-" if name == BUCKETED else f"{r['max_abs_diff_vs_bucketed']:.1e}",
            )
        )
    return format_rows(rows)


def summary_line(report: dict[str, Any]) -> str:
    c, rat, agr = report["config"], report["ratios"], report["agreement"]
    where = (
        f"{c['requests']} requests, {c['lengths']} lengths {c['length_min']}-{c['length_max']} "
        f"(mean {c['length_mean']:.0f}), B={c['batch_size']}, max_len={c['max_len']}, "
        f"{report['device']['jax_backend']}"
    )
    line = f"evaluate: bucketed/unbucketed requests/s = {rat['bucketed_over_unbucketed']:.2f}x"
    if rat["bucketed_over_torch"] is None:
        return f"{line} ({where}; torch skipped)"
    return (
        f"{line}, bucketed/torch = {rat['bucketed_over_torch']:.2f}x, unbucketed/torch = "
        f"{rat['unbucketed_over_torch']:.2f}x; max |loglik ours - torch| = "
        f"{agr['max_abs_diff_torch_vs_bucketed']:.1e} nats ({where})"
    )


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m benchmarks.evaluate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--requests", type=cli.Int(min=1), default=256, help="requests (choices) to score (default 256)"
    )
    p.add_argument(
        "--max-len", type=cli.Int(min=8), default=256, help="longest request / largest bucket (default 256)"
    )
    p.add_argument(
        "--batch-size", type=cli.Int(min=1), default=8, help="rows per batch, all sides (default 8)"
    )
    p.add_argument(
        "--min-bucket",
        type=cli.Int(min=1),
        default=64,
        help="smallest bucket of the bucketed side (Scorer default 64)",
    )
    p.add_argument(
        "--lengths",
        choices=("loguniform", "uniform"),
        default="loguniform",
        help="how example lengths are drawn from [8, max_len] (default loguniform)",
    )
    p.add_argument(
        "--iters", type=cli.Int(min=1), default=3, help="timed passes per side, median taken (default 3)"
    )
    p.add_argument(
        "--warmup",
        type=cli.Int(min=1),
        default=1,
        help="untimed passes per side before timing, the first one compiles (default 1, >= 1)",
    )
    add_model_args(p)
    p.add_argument(
        "--torch-batching",
        choices=("padded", "single"),
        default="padded",
        help="torch side: right-padded batches of --batch-size (default) or one request at a time",
    )
    add_torch_args(p)
    p.add_argument(
        "--mesh",
        type=MESH_FLAG,
        default="none",
        help="our sides' mesh: none (one device, default), auto, data=2,expert=4",
    )
    add_out_arg(p, "evaluate")
    p.add_argument(
        "--cpu-devices", type=cli.Int(min=1), default=None, help="simulate N CPU devices (JAX_PLATFORMS=cpu)"
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    simulate_cpu_devices(args.cpu_devices)  # before jax is imported
    overrides_or_exit(args.set)
    report = run_benchmark(args)
    print_and_write(report, format_table(report), summary_line(report), args.out, "evaluate")
    return report


if __name__ == "__main__":
    cli.run(main)
