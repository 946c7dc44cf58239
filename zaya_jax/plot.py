"""Plot a run's metrics: ``python -m zaya_jax.plot WORKDIR [--out DIR] [--log-y] [--smooth A]``.

Reads ``WORKDIR/metrics.jsonl`` (written by :class:`zaya_jax.metrics.MetricsLogger`) and writes

* ``loss.png`` — train loss vs step (a line; with ``--smooth`` the raw curve is faded behind
  an exponential moving average) and eval loss as points;
* ``expert_load.png`` — per-layer max/mean expert load vs step (1 = balanced, E = collapsed onto
  one expert), from the per-layer list ``expert_load_max_over_mean`` [L] of the train records;
  with a second panel for the per-layer skip fraction when ``expert_skip_fraction`` is logged.
  Skipped (with a note) when no record has the load.

Prints the path of every file written. Uses matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from zaya_jax import cli
from zaya_jax.metrics import METRICS_FILE, read_metrics

# Record keys holding per-layer [L] values; the first one present is used. The unprefixed names
# are what zaya_jax.balancing returns, in case a trainer logs them as they come.
LOAD_KEYS = ("expert_load_max_over_mean", "load_max_over_mean")
SKIP_KEYS = ("expert_skip_fraction", "skip_fraction")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # before pyplot is imported: headless, also under a DISPLAY-less ssh
    import matplotlib.pyplot as plt

    return plt


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records with a finite scalar ``key``."""
    pts = [(r["step"], r[key]) for r in records if _finite(r.get(key))]
    return [s for s, _ in pts], [v for _, v in pts]


def _layer_series(records: list[dict[str, Any]], keys: tuple[str, ...]):
    """(key, steps, per-layer lists [L][n]) for the first of ``keys`` that any record has."""
    for key in keys:
        rows = [(r["step"], r[key]) for r in records if isinstance(r.get(key), list) and r[key]]
        if rows:
            num_layers = max(len(v) for _, v in rows)
            layers = [
                (
                    [s for s, v in rows if i < len(v) and _finite(v[i])],
                    [v[i] for s, v in rows if i < len(v) and _finite(v[i])],
                )
                for i in range(num_layers)
            ]
            return key, layers
    return None, []


def ema(values: list[float], alpha: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing); alpha = weight of
    the past, 0 = no smoothing."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        norm = alpha * norm + (1 - alpha)
        out.append(acc / norm)
    return out


def plot_loss(records: list[dict[str, Any]], path: Path, *, log_y: bool = False, smooth: float = 0.0) -> Path:
    plt = _pyplot()
    train = [r for r in records if r.get("split", "train") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    steps, loss = _series(train, "loss")
    eval_steps, eval_loss = _series(evals, "eval_loss")
    if not steps and not eval_steps:
        raise ValueError("no train 'loss' or 'eval_loss' values to plot")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    if steps:
        if smooth > 0:
            ax.plot(steps, loss, color="C0", alpha=0.25, linewidth=1)
            ax.plot(steps, ema(loss, smooth), color="C0", label=f"train (EMA {smooth:g})")
        else:
            ax.plot(steps, loss, color="C0", label="train")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o", color="C3", markersize=5, label="eval")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_expert_load(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-layer load plot, or None if no record carries the per-layer load."""
    train = [r for r in records if r.get("split", "train") == "train"]
    load_key, load = _layer_series(train, LOAD_KEYS)
    if load_key is None:
        return None
    skip_key, skip = _layer_series(train, SKIP_KEYS)
    plt = _pyplot()
    panels = 2 if skip_key else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 4 * panels), dpi=100, sharex=True, squeeze=False)
    ax = axes[0, 0]
    # Colour runs from early (dark) to late (light, short of viridis's pale yellow) layers; a
    # legend entry per layer only while it stays readable.
    cmap = plt.get_cmap("viridis")
    n = len(load)
    for i, (steps, values) in enumerate(load):
        ax.plot(
            steps,
            values,
            color=cmap(0.85 * i / max(n - 1, 1)),
            linewidth=1,
            label=f"layer {i}" if n <= 12 else None,
        )
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="balanced")
    ax.set_ylabel("max / mean expert load")
    ax.set_title(f"expert load per layer ({load_key})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2 if n > 6 else 1)
    if skip_key:
        ax = axes[1, 0]
        for i, (steps, values) in enumerate(skip):
            ax.plot(steps, values, color=cmap(0.85 * i / max(len(skip) - 1, 1)), linewidth=1)
        ax.set_ylabel("skip fraction")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def arg_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m zaya_jax.plot", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", type=Path, help=f"run directory holding {METRICS_FILE}")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: WORKDIR)")
    parser.add_argument("--log-y", action="store_true", help="log-scale loss axis")
    parser.add_argument(
        "--smooth",
        type=cli.Float(min=0.0, max=1.0, max_open=True),
        default=0.0,
        help="EMA weight of the past for the train loss (default 0: raw)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    if not args.workdir.is_dir():
        parser.error(f"workdir {args.workdir} does not exist or is not a directory")
    if not (args.workdir / METRICS_FILE).is_file():
        parser.error(f"no {METRICS_FILE} in {args.workdir} (has the run logged anything yet?)")
    records = read_metrics(args.workdir)
    out = args.out or args.workdir
    out.mkdir(parents=True, exist_ok=True)
    try:
        written = [plot_loss(records, out / "loss.png", log_y=args.log_y, smooth=args.smooth)]
    except ValueError as e:
        parser.error(f"{args.workdir / METRICS_FILE}: {e}")
    load = plot_expert_load(records, out / "expert_load.png")
    if load is None:
        print(
            f"no per-layer expert load ({' / '.join(LOAD_KEYS)}) in the records; expert_load.png not written",
            file=sys.stderr,
        )
    else:
        written.append(load)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    cli.run(main)
