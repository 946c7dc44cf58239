"""Generation throughput, side by side: our cached decoding vs recomputing without a cache vs transformers.

    python -m benchmarks.generate [--batch-size 4] [--prompt-len 64] [--new-tokens 64] [--iters 3]
        [--warmup 1] [--set KEY=VALUE ...] [--skip-torch] [--torch-device auto] [--threads 0]
        [--seed 0] [--out results/generate.json] [--cpu-devices N]

(`python benchmarks/generate.py ...` works too.) One random tiny model (`ZayaConfig.tiny(vocab_size=259)`,
`--set` to change it) is built as transformers' ZayaForCausalLM with every weight randomised and loaded
back by `zaya_jax.hf.load_pretrained` (benchmarks/reference.py), so all sides hold the same fp32
weights. The prompts are --batch-size random token rows with lengths drawn from
[--prompt-len / 2, --prompt-len], left padded; every side continues them greedily by exactly
--new-tokens tokens (no EOS stop):

  cached      zaya_jax.generate.generate: prefill, then one token per step against the per-layer
              cache (K/V, CCA conv state, delayed value), all in one jitted lax.while_loop
  recompute   the same model without a cache: every step runs the full forward pass over the whole
              [B, prompt + new] buffer (not-yet-generated slots masked) and takes the next token's
              logits; one jitted lax.fori_loop, so the two sides differ only by the cache
  torch       transformers' ZayaForCausalLM.generate(do_sample=False), its own cache

Every side first runs one untimed call (ours: the compilation happens there, its trace + lower +
XLA compile time summed from jax.monitoring events), then --warmup - 1 more, then --iters timed calls
interleaved across the sides (order reversed every iteration); a call is one `generate` end to end,
host-side padding and the device round trip included, and the reported time is the median. The
generated tokens of every side are compared with the cached side's (rows equal, first differing step).
"""

from __future__ import annotations

import os

# As in train_step.py: passive OpenMP waiting keeps torch's CPU timings sane on a busy small machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import datetime
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/generate.py`: make the repo root importable
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
from zaya_jax.runtime import cli

CACHED, RECOMPUTE, TORCH = "cached", "recompute", "torch"


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random rows of lengths in [max(1, prompt_len // 2), prompt_len]; the longest is prompt_len."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, size=batch_size)
    lengths[0] = prompt_len
    return [rng.integers(3, vocab_size, size=int(n)).tolist() for n in lengths]


# ------------------------------------------------------------------------------------------- sides
class CachedSide:
    name = CACHED

    def __init__(self, cfg, variables, new_tokens: int):
        self.cfg, self.variables, self.new_tokens = cfg, variables, new_tokens

    def generate(self, prompts) -> np.ndarray:
        from zaya_jax.generate import generate

        return np.array(generate(self.cfg, self.variables, prompts, self.new_tokens))


def recompute_loop(cfg, variables, ids_bs, mask_bs, new_tokens: int):
    """Greedy decoding without a cache: every step is the full forward pass over the whole buffer.
    Returns the new tokens [B, new_tokens]."""
    import jax
    import jax.numpy as jnp

    from zaya_jax.model import ZayaForCausalLM

    model = ZayaForCausalLM(cfg)
    s = ids_bs.shape[1]
    buf = jnp.pad(ids_bs, ((0, 0), (0, new_tokens)))
    mask = jnp.pad(mask_bs, ((0, 0), (0, new_tokens)))

    def body(t, carry):
        buf, mask = carry
        # positions count real tokens, as zaya_jax.generate.prefill (and transformers' generate)
        positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
        hidden = model.apply(variables, buf, mask, positions=positions, return_logits=False).hidden
        last = jax.lax.dynamic_index_in_dim(hidden, s + t - 1, axis=1, keepdims=False)
        logits = model.apply(variables, last, method="logits_from_hidden")
        token = jnp.argmax(logits, axis=-1).astype(buf.dtype)
        return buf.at[:, s + t].set(token), mask.at[:, s + t].set(1)

    buf, _ = jax.lax.fori_loop(0, new_tokens, body, (buf, mask))
    return buf[:, s:]


class RecomputeSide:
    name = RECOMPUTE

    def __init__(self, cfg, variables, new_tokens: int):
        import jax

        self.cfg, self.variables, self.new_tokens = cfg, variables, new_tokens
        self._loop = jax.jit(recompute_loop, static_argnums=(0, 4))

    def generate(self, prompts) -> np.ndarray:
        import jax.numpy as jnp

        from zaya_jax.generate import left_pad

        ids, mask = left_pad(prompts)
        out = self._loop(self.cfg, self.variables, jnp.asarray(ids), jnp.asarray(mask), self.new_tokens)
        return np.asarray(out)


class TorchSide:
    name = TORCH

    def __init__(self, model, new_tokens: int, device: str):
        import torch

        self.torch, self.model, self.new_tokens, self.device = torch, model, new_tokens, device
        # exactly new_tokens tokens, as our sides: no EOS stop (min_new_tokens would instead mask the
        # EOS logit and change the greedy choice)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0

    def generate(self, prompts) -> np.ndarray:
        from zaya_jax.generate import left_pad

        torch = self.torch
        ids, mask = left_pad(prompts)
        as_t = lambda x: torch.as_tensor(x, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                as_t(ids), attention_mask=as_t(mask), do_sample=False, max_new_tokens=self.new_tokens
            )
        return out[:, ids.shape[1] :].cpu().numpy()


# --------------------------------------------------------------------------------------- benchmark
def agreement(tokens: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    """Rows equal to the reference's, and the first step where any row differs (None: none)."""
    same = tokens == reference
    steps = np.flatnonzero(~same.all(axis=0))
    return {
        "rows_equal": int(same.all(axis=1).sum()),
        "first_diff_step": int(steps[0]) if len(steps) else None,
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    cfg = tiny_config(parse_overrides(args.set or []))
    prompts = make_prompts(args.batch_size, args.prompt_len, cfg.vocab_size, args.seed)
    device = host_info()
    variables, ref = weights(cfg, args)
    sides: list[Any] = [
        CachedSide(cfg, variables, args.new_tokens),
        RecomputeSide(cfg, variables, args.new_tokens),
    ]
    if ref is not None:
        sides.append(TorchSide(ref.model, args.new_tokens, ref.device_info["torch_device"]))
        device.update(ref.device_info)

    first = first_calls(sides, lambda side: side.generate(prompts), args.warmup)
    times = timed_calls(sides, lambda side: side.generate(prompts), args.iters)

    new = args.batch_size * args.new_tokens
    results: dict[str, Any] = {CACHED: None, RECOMPUTE: None, TORCH: None}
    for side in sides:
        call_s = statistics.median(times[side.name])
        ours = side.name != TORCH
        results[side.name] = {
            "call_s": call_s,
            "call_times_s": times[side.name],
            "new_tokens_per_s": new / call_s,
            "ms_per_step": 1e3 * call_s / args.new_tokens,
            "first_call_s": first[side.name].seconds,
            "compile_s": first[side.name].compile_s if ours else None,
            "vs_cached": agreement(first[side.name].output, first[CACHED].output),
        }
    ratio = lambda a, b: (
        results[a]["new_tokens_per_s"] / results[b]["new_tokens_per_s"] if results[a] and results[b] else None
    )
    lengths = [len(p) for p in prompts]
    return {
        "benchmark": "generate",
        "config": {
            "batch_size": args.batch_size,
            "prompt_len": args.prompt_len,
            "prompt_lengths": lengths,
            "new_tokens": args.new_tokens,
            "iters": args.iters,
            "warmup": args.warmup,
            "seed": args.seed,
            **model_report(cfg, args.set),
        },
        "device": device,
        "results": results,
        "ratios": {
            "cached_over_recompute": ratio(CACHED, RECOMPUTE),
            "cached_over_torch": ratio(CACHED, TORCH),
            "recompute_over_torch": ratio(RECOMPUTE, TORCH),
        },
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------------------------------ report
def format_table(report: dict[str, Any]) -> str:
    header = (
        "side",
        "compile s",
        "1st call s",
        "call ms",
        "ms/step",
        "new tok/s",
        "vs cached",
        "rows = cached",
    )
    base = report["results"][CACHED]["new_tokens_per_s"]
    rows = [header]
    for name, r in report["results"].items():
        if r is None:
            continue
        rows.append(
            (
                name,
                fmt(r["compile_s"], ".2f"),
                fmt(r["first_call_s"], ".2f"),
                fmt(1e3 * r["call_s"], ".1f"),
                fmt(r["ms_per_step"], ".2f"),
                fmt(r["new_tokens_per_s"], ",.0f"),
                fmt(r["new_tokens_per_s"] / base, ".2f") + "x",
                f"{r['vs_cached']['rows_equal']}/{report['config']['batch_size']}",
            )
        )
    return format_rows(rows)


def summary_line(report: dict[str, Any]) -> str:
    c, rat, res = report["config"], report["ratios"], report["results"]
    where = (
        f"B={c['batch_size']}, prompts {min(c['prompt_lengths'])}-{c['prompt_len']} tokens, "
        f"{c['new_tokens']} new, {report['device']['jax_backend']}"
    )
    line = f"generate: cached/recompute new tokens/s = {rat['cached_over_recompute']:.2f}x"
    if rat["cached_over_torch"] is None:
        return f"{line} ({where}; torch skipped)"
    return (
        f"{line}, cached/torch = {rat['cached_over_torch']:.2f}x; rows equal to torch "
        f"{res[TORCH]['vs_cached']['rows_equal']}/{c['batch_size']} ({where})"
    )


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m benchmarks.generate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch-size", type=cli.Int(min=1), default=4, help="prompts per call (default 4)")
    p.add_argument(
        "--prompt-len", type=cli.Int(min=1), default=64, help="longest prompt, tokens (default 64)"
    )
    p.add_argument(
        "--new-tokens", type=cli.Int(min=1), default=64, help="tokens generated per prompt (default 64)"
    )
    p.add_argument(
        "--iters", type=cli.Int(min=1), default=3, help="timed calls per side, median taken (default 3)"
    )
    p.add_argument(
        "--warmup",
        type=cli.Int(min=1),
        default=1,
        help="untimed calls per side, the first one compiles (default 1)",
    )
    add_model_args(p)
    add_torch_args(p)
    add_out_arg(p, "generate")
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
    print_and_write(report, format_table(report), summary_line(report), args.out, "generate")
    return report


if __name__ == "__main__":
    cli.run(main)
