"""Plot a run's metrics: ``python -m zaya_jax.plot WORKDIR [--out DIR] [--log-y] [--smooth A]``.

Reads ``WORKDIR/metrics.jsonl`` (written by :class:`zaya_jax.training.metrics.MetricsLogger`) and writes

* ``loss.png`` — train loss vs step (a line; with ``--smooth`` the raw curve is faded behind
  an exponential moving average) and eval loss as points;
* ``expert_load.png`` — per-layer max/mean expert load vs step (1 = balanced, E = collapsed onto
  one expert), from the per-layer list ``expert_load_max_over_mean`` [L] of the train records;
  with a second panel for the per-layer skip fraction when ``expert_skip_fraction`` is logged.
  Skipped (with a note) when no record has the load.
* ``expert_load_heatmap.png`` — one panel per layer, experts (rows) x steps (columns), coloured by
  each expert's share of the layer's tokens relative to the balanced share 1/E (``expert_load``
  [L][E] of the routing telemetry, zaya_jax/training/routing_telemetry.py): white = balanced, red =
  overloaded, blue = underloaded (log scale, 1/8x to 8x), black = no token at all; each panel's
  title gives the layer's skip fraction, router entropy (of at most ln(E+1)) and dead experts at
  the last logged step.
* ``balancing_bias.png`` — one panel per layer, a line per expert: the balancing biases
  (``balancing_bias`` [L][E]) over steps; the skip class's bias (``balancing_skip_bias``) on a
  second axis when it moves, in the title when it does not.
  Both skipped when the records carry no routing telemetry (runs from before it).
* ``expert_exchange.png`` — the expert exchange's spill round (runs with mesh.expert > 1,
  dropless): MoE block calls that took it per step (``expert_exchange/spill_blocks``, the mean
  over each logging interval) and the fraction of steps with any
  (``expert_exchange/spill_step_fraction``). Not written when no record has them.

Prints the path of every file written. Uses matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from zaya_jax.runtime import cli
from zaya_jax.training.metrics import METRICS_FILE, read_metrics

# Record keys holding per-layer [L] values; the first one present is used. The unprefixed names
# are what zaya_jax.optim.balancing returns, in case a trainer logs them as they come.
LOAD_KEYS = ("expert_load_max_over_mean", "load_max_over_mean")
SKIP_KEYS = ("expert_skip_fraction", "skip_fraction")
# The trainer's spill metrics (zaya_jax/training/train_state.py SPILL_BLOCKS, SPILL_STEP_FRACTION).
SPILL_BLOCKS, SPILL_STEP_FRACTION = "expert_exchange/spill_blocks", "expert_exchange/spill_step_fraction"


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


def plot_expert_exchange(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Spill rounds of the expert exchange vs step (two panels), or None if no record has them."""
    train = [r for r in records if r.get("split", "train") == "train"]
    steps, blocks = _series(train, SPILL_BLOCKS)
    if not steps:
        return None
    frac_steps, fraction = _series(train, SPILL_STEP_FRACTION)
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True)
    top.plot(steps, blocks, color="C1", marker="." if len(steps) < 50 else None)
    top.set_ylabel("MoE blocks / step")
    top.set_title("expert exchange: blocks that took the spill round (mean per logging interval)")
    bottom.plot(frac_steps, fraction, color="C3", marker="." if len(frac_steps) < 50 else None)
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_ylabel("fraction of steps")
    bottom.set_title("steps with any spill round")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _expert_rows(records: list[dict[str, Any]], key: str) -> tuple[list[int], Any]:
    """(steps, values [n, L, E] float array) of the train records whose ``key`` is a per-layer
    per-expert [L][E] list of the most common shape (a run restarted with another model is
    drawn as the current one)."""
    import numpy as np

    rows = [
        (r["step"], np.asarray(r[key], np.float64))
        for r in records
        if r.get("split", "train") == "train" and isinstance(r.get(key), list) and r[key]
    ]
    rows = [(s, v) for s, v in rows if v.ndim == 2]
    if not rows:
        return [], None
    shape = rows[-1][1].shape
    rows = sorted(((s, v) for s, v in rows if v.shape == shape), key=lambda sv: sv[0])
    return [s for s, _ in rows], np.stack([v for _, v in rows])


def _step_edges(steps: list[int]) -> Any:
    """Cell edges for columns centred on `steps` (half way between neighbours)."""
    import numpy as np

    x = np.asarray(steps, np.float64)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    return np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])


def _layer_grid(plt, num_layers: int, panel_w: float, panel_h: float):
    """(figure, flat list of num_layers axes) on a grid of at most 4 columns; spare axes hidden."""
    cols = min(num_layers, 4)
    rows = math.ceil(num_layers / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(panel_w * cols + 1.5, panel_h * rows + 1.0),
        dpi=100,
        squeeze=False,
        sharex=True,
        layout="constrained",  # room for each panel's tick labels, the colour bar and the legend
    )
    flat = list(axes.ravel())
    for ax in flat[num_layers:]:
        ax.set_visible(False)
    return fig, flat[:num_layers]


def _label_edges(axes: list, ylabel: str) -> None:
    """`ylabel` on the first column of a _layer_grid, "step" under its bottom row."""
    cols = min(len(axes), 4)
    for i, ax in enumerate(axes):
        if i % cols == 0:
            ax.set_ylabel(ylabel)
        if i >= len(axes) - cols:
            ax.set_xlabel("step")


def _last(records: list[dict[str, Any]], key: str, layer: int) -> float | None:
    """`key`[layer] of the last train record that has it."""
    for r in reversed(records):
        v = r.get(key)
        if (
            r.get("split", "train") == "train"
            and isinstance(v, list)
            and layer < len(v)
            and _finite(v[layer])
        ):
            return v[layer]
    return None


def _layer_note(records: list[dict[str, Any]], layer: int, num_experts: int) -> str:
    """'layer l · skip s% · entropy h / ln(E+1) · k dead' at the last logged step."""
    parts = [f"layer {layer}"]
    skip = _last(records, "expert_skip_fraction", layer)
    if skip is not None:
        parts.append(f"skip {100 * skip:.1f}%")
    entropy = _last(records, "router_entropy", layer)
    if entropy is not None:
        parts.append(f"entropy {entropy:.2f}/{math.log(num_experts + 1):.2f}")
    dead = _last(records, "expert_dead", layer)
    if dead:
        parts.append(f"{int(dead)} dead")
    return " · ".join(parts)


def plot_expert_load_heatmap(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-layer experts x steps heatmap of ``expert_load`` (module docstring), or None without it."""
    import numpy as np
    from matplotlib.colors import ListedColormap, Normalize

    steps, load = _expert_rows(records, "expert_load")
    if load is None:
        return None
    plt = _pyplot()
    num_layers, num_experts = load.shape[1:]
    # log2 of (share / balanced share), clipped to 1/8x..8x; no token at all is masked (drawn black).
    ratio = load * num_experts
    with np.errstate(divide="ignore"):
        level = np.ma.masked_invalid(np.log2(np.where(ratio > 0, ratio, np.nan)))
    cmap = ListedColormap(plt.get_cmap("RdBu_r")(np.linspace(0, 1, 256))).with_extremes(bad="black")
    norm = Normalize(-3, 3)
    fig, axes = _layer_grid(plt, num_layers, 4.2, 0.15 * num_experts + 1.0)
    x, y = _step_edges(steps), np.arange(num_experts + 1) - 0.5
    for layer, ax in enumerate(axes):
        mesh = ax.pcolormesh(x, y, np.clip(level[:, layer, :].T, -3, 3), cmap=cmap, norm=norm, shading="flat")
        ax.set_title(_layer_note(records, layer, num_experts), fontsize="small")
        ax.set_ylim(num_experts - 0.5, -0.5)  # expert 0 on top
        ax.set_yticks(range(0, num_experts, max(1, num_experts // 8)))
    _label_edges(axes, "expert")
    # below the panels: a label along a vertical bar would outgrow a grid of few experts
    bar = fig.colorbar(mesh, ax=axes, orientation="horizontal", shrink=0.6, aspect=40, pad=0.02)
    bar.set_ticks(range(-3, 4))
    bar.set_ticklabels(["1/8", "1/4", "1/2", "1", "2", "4", "8"])
    bar.set_label(f"expert's share of tokens / balanced share (1/{num_experts}); black: none")
    fig.suptitle("expert load per layer over training (expert_load)")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_balancing_biases(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-layer trajectories of the balancing biases (module docstring), or None without them."""
    import numpy as np

    steps, bias = _expert_rows(records, "balancing_bias")
    if bias is None:
        return None
    plt = _pyplot()
    num_layers, num_experts = bias.shape[1:]
    skip_key, skip = _layer_series(
        [r for r in records if r.get("split", "train") == "train"], ("balancing_skip_bias",)
    )
    cmap = plt.get_cmap("tab20" if num_experts > 10 else "tab10")
    fig, axes = _layer_grid(plt, num_layers, 4.2, 2.8)
    for layer, ax in enumerate(axes):
        for e in range(num_experts):
            ax.plot(steps, bias[:, layer, e], color=cmap(e % cmap.N), linewidth=1, label=f"expert {e}")
        title = f"layer {layer}"
        if skip_key and layer < len(skip) and skip[layer][1]:
            s_steps, s_values = skip[layer]
            if np.ptp(s_values) > 0:
                twin = ax.twinx()
                twin.plot(s_steps, s_values, color="black", linestyle="--", linewidth=1)
                twin.set_ylabel("skip bias (dashed)", fontsize="small")
            else:
                title += f" · skip bias {s_values[-1]:g} (fixed)"
        ax.set_title(title, fontsize="small")
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.grid(True, alpha=0.3)
    _label_edges(axes, "bias")
    if num_experts <= 20:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    fig.suptitle("balancing biases per layer (balancing_bias): up = the controller pulls tokens in")
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
    spills = plot_expert_exchange(records, out / "expert_exchange.png")
    written += [spills] if spills else []
    routing = [
        plot_expert_load_heatmap(records, out / "expert_load_heatmap.png"),
        plot_balancing_biases(records, out / "balancing_bias.png"),
    ]
    if None in routing:
        print(
            "no routing telemetry (expert_load / balancing_bias) in the records; "
            "expert_load_heatmap.png / balancing_bias.png not written",
            file=sys.stderr,
        )
    written += [p for p in routing if p is not None]
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    cli.run(main)
