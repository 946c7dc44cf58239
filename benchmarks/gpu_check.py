"""The predicted step time (zaya_jax/analysis/timeline.py, `train --dry_run`) against the measured one, on one
GPU: the prepared check to run whenever a GPU is at hand.

    python -m benchmarks.gpu_check [--cases tiny,zaya1_2l,long] [--hardware h200|h100|mi300x|FILE]
        [--steps 5] [--warmup 2] [--out results/gpu_check.json]

Each case is a config that fits one device (mesh of 1):

  tiny       configs/tiny.py as it is
  zaya1_2l   configs/zaya1_base.py:phase1 (ZAYA1's widths) with 2 layers, 4 sequences of 4096
  long       the same 2 layers with one sequence of 32768 (flash attention's long-context path)

For each, the train step the trainer jits is compiled for this device
(zaya_jax.analysis.compiled.compile_step: the same program, shardings and donation), its HLO predicted on the hardware's figures
(zaya_jax.analysis.prediction.predict), then that same executable run on a real initial state and a random
token batch: `--warmup` untimed steps, then `--steps` steps each timed to completion; measured is
their median. The error is signed: (predicted - measured) / measured (positive: the prediction is
slow). Targets: within 20%; a case far off names which figures (the efficiency tables of the
hardware file) to correct.

`--allow-cpu` runs the same on the CPU (the figures still those of `--hardware`): only to check the
script itself where no GPU is (tests/test_timeline.py); its errors mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/gpu_check.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("tiny", "zaya1_2l", "long")


def case_config(name: str, overrides: tuple[str, ...] = ()) -> Any:
    """The config of case `name` on one device, then `overrides` (`key=value`, as `--config.key=value`)."""
    from benchmarks.train_config import apply_override, load_config

    if name == "tiny":
        c = load_config(os.path.join(ROOT, "configs/tiny.py"))
    elif name in ("zaya1_2l", "long"):
        c = load_config(os.path.join(ROOT, "configs/zaya1_base.py"))
        c.model.num_hidden_layers = 2
        c.train.batch_ramp = None
        c.train.seq_len, c.train.batch_size = (4096, 4) if name == "zaya1_2l" else (32768, 1)
        c.model.max_position_embeddings = max(c.model.max_position_embeddings, c.train.seq_len)
        c.mesh.context = 1
        c.mesh.context_layout = "contiguous"
    else:
        raise ValueError(f"--cases: unknown case {name!r} (known: {', '.join(CASES)})")
    c.mesh.data = 1
    c.train.grad_accum = 1
    for assignment in overrides:
        apply_override(c, assignment)
    return c


def signed_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: positive when the prediction is slower than the device."""
    return (predicted - measured) / measured


def measure(step: Any, c: Any, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` timed runs of the compiled step (after `warmup`), each to completion."""
    import jax
    import numpy as np

    from zaya_jax.training.train_state import abstract_batch, train_program

    program = train_program(c, step.cfg, step.mesh)
    state = program.initial_state()
    rng = np.random.default_rng(0)
    shapes = abstract_batch(c.train.batch_size, c.train.seq_len, step.mesh)
    tokens = rng.integers(0, step.cfg.vocab_size, (c.train.batch_size, c.train.seq_len + 1), dtype=np.int32)
    arrays = {
        "input_ids": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": np.ones(tokens[:, 1:].shape),
    }
    batch = {k: jax.device_put(arrays[k].astype(s.dtype), s.sharding) for k, s in shapes.items()}
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run_case(name: str, hw: dict, args: argparse.Namespace) -> dict[str, Any]:
    """One case: predicted (from the compiled step's HLO) and measured step seconds, signed error."""
    import jax

    from zaya_jax.analysis import compiled, prediction

    c = case_config(name, tuple(args.set))
    step = compiled.compile_step(c, jax.devices()[:1])
    predicted = prediction.predict(step.compiled.as_text(), c, step.cfg, 1, hw)
    times = measure(step, c, args.warmup, args.steps)
    measured = statistics.median(times)
    return {
        "case": name,
        "tokens_per_step": c.train.batch_size * c.train.seq_len,
        "layers": step.cfg.num_hidden_layers,
        "predicted_seconds": predicted["step_seconds"],
        "measured_seconds": measured,
        "measured_all_seconds": times,
        "error": signed_error(predicted["step_seconds"], measured),
        "predicted_mfu": predicted["mfu"],
        "measured_mfu": predicted["model_flops_per_device"]
        / (measured * hw["peak_flops_per_second"]["bfloat16"]),
        "prediction": predicted,
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        f"{'case':<10}{'tokens':>9}{'predicted s':>13}{'measured s':>12}{'error':>9}{'MFU pred':>10}{'MFU meas':>10}"
    ]
    for r in rows:
        out.append(
            f"{r['case']:<10}{r['tokens_per_step']:>9}{r['predicted_seconds']:>13.4f}{r['measured_seconds']:>12.4f}"
            f"{100 * r['error']:>+8.1f}%{100 * r['predicted_mfu']:>9.1f}%{100 * r['measured_mfu']:>9.1f}%"
        )
    return "\n".join(out)


def arg_parser():
    from zaya_jax.runtime import cli

    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=cli.ListOf(CASES), default=list(CASES))
    p.add_argument(
        "--hardware", default="h200", help="a target with figures (h200, h100, mi300x) or a JSON file"
    )
    p.add_argument("--steps", type=cli.Int(min=1), default=5)
    p.add_argument("--warmup", type=cli.Int(min=0), default=2)
    p.add_argument("--out", default="results/gpu_check.json")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU (checks the script only)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.train_config import parse_with_overrides

    return parse_with_overrides(arg_parser(), argv)  # --config.KEY=VALUE: for every case


def hardware_figures(spec: str) -> dict:
    from zaya_jax.analysis import hardware

    if spec in hardware.FILES:
        return hardware.builtin(spec)
    return hardware.merged(None, hardware.read_file(spec))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hw = hardware_figures(args.hardware)
    import jax

    platform = jax.devices()[0].platform
    if platform == "cpu" and not args.allow_cpu:
        raise ValueError(
            "no GPU here (jax runs on cpu): run on a GPU machine, or --allow-cpu to check the script"
        )
    rows = [run_case(name, hw, args) for name in args.cases]
    print(table(rows))
    report = {
        "device": str(jax.devices()[0].device_kind),
        "platform": platform,
        "hardware": hw,
        "cases": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from zaya_jax.runtime import cli

    cli.run(main)
