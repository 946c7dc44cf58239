"""Tests for the `python -m zaya_jax.plot` CLI on a synthetic metrics.jsonl."""

import json
import math

import pytest
from support.plots import is_png, run_plot


def _write_run(workdir, num_layers=3, with_load=True):
    """200 train steps with a decaying noisy loss and per-layer load falling from ~3 to ~1.2,
    an eval every 50 steps, one diverged (NaN) record that must not break the plot."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        for step in range(1, 201):
            rec = {
                "step": step,
                "split": "train",
                "loss": 5.0 * math.exp(-step / 60) + 2.0 + 0.1 * math.sin(step),
                "lr": 1e-3,
            }
            if with_load:
                rec["expert_load_max_over_mean"] = [
                    1.2 + (1.8 + 0.3 * i) * math.exp(-step / 40) for i in range(num_layers)
                ]
                rec["expert_skip_fraction"] = [0.02 * (i + 1) for i in range(num_layers)]
            f.write(json.dumps(rec) + "\n")
            if step % 50 == 0:
                f.write(
                    json.dumps({"step": step, "split": "eval", "eval_loss": 5.0 * math.exp(-step / 60) + 2.1})
                    + "\n"
                )
        f.write(json.dumps({"step": 201, "split": "train", "loss": float("nan")}) + "\n")


def test_cli_writes_pngs(tmp_path):
    workdir, out = tmp_path / "run", tmp_path / "plots"
    _write_run(workdir)
    res = run_plot(workdir, "--out", out, "--log-y", "--smooth", "0.6")
    assert res.returncode == 0, res.stderr
    written = res.stdout.split()
    assert written == [str(out / "loss.png"), str(out / "expert_load.png")]
    assert is_png(out / "loss.png") and is_png(out / "expert_load.png")


def test_cli_default_out_and_no_load(tmp_path):
    _write_run(tmp_path, with_load=False)
    res = run_plot(tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(tmp_path / "loss.png")]
    assert is_png(tmp_path / "loss.png") and not (tmp_path / "expert_load.png").exists()
    assert "expert_load.png not written" in res.stderr


@pytest.mark.parametrize("case", ["no_workdir", "no_metrics", "no_loss"])
def test_cli_errors(tmp_path, case):
    workdir = tmp_path / "run"
    if case != "no_workdir":
        workdir.mkdir()
    if case == "no_loss":
        (workdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train"}) + "\n")
    res = run_plot(workdir)
    assert res.returncode == 2 and res.stdout == ""
    expected = {
        "no_workdir": "does not exist",
        "no_metrics": "no metrics.jsonl",
        "no_loss": "no train 'loss'",
    }[case]
    assert expected in res.stderr


def _ink_on_border(png):
    """Whether any pixel of the image's outermost 2-pixel frame is not white (a clipped drawing)."""
    import matplotlib.image

    rgb = matplotlib.image.imread(png)[..., :3]
    frame = [rgb[:2], rgb[-2:], rgb[:, :2], rgb[:, -2:]]
    return any((f < 0.99).any() for f in frame)


@pytest.mark.parametrize("num_layers, num_experts", [(1, 4), (2, 4), (6, 16)])
def test_heatmap_colour_bar_label_inside_the_image(tmp_path, num_layers, num_experts):
    """The expert-load heatmap's colour bar and its label are drawn whole, whatever the grid."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            load = [
                [(e + step + layer) % 3 / num_experts for e in range(num_experts)]
                for layer in range(num_layers)
            ]
            rec = {"step": step, "split": "train", "loss": 3.0 - step / 20, "expert_load": load}
            rec["balancing_bias"] = [[0.01 * e for e in range(num_experts)] for _ in range(num_layers)]
            f.write(json.dumps(rec) + "\n")
    res = run_plot(tmp_path)
    assert res.returncode == 0, res.stderr
    assert is_png(tmp_path / "expert_load_heatmap.png")
    assert not _ink_on_border(tmp_path / "expert_load_heatmap.png")
