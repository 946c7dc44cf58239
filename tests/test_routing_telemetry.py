"""Routing telemetry (zaya_jax/training/routing_telemetry.py): the step's per-layer / per-expert routing
metrics against numpy, the dead-expert window, the model's summed router entropy against its
router probabilities, TensorBoard's per-expert scalars, and end to end: a `python -m zaya_jax.train`
run logs them (checked against its own checkpoint and TensorBoard files) and `python -m
zaya_jax.plot` draws them."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.events import event_tags
from support.plots import is_png
from support.train_runs import ROOT, run_train

from zaya_jax.model import ZayaConfig, ZayaForCausalLM, init_variables
from zaya_jax.optim import balancing as bal
from zaya_jax.training.metrics import MetricsLogger, read_metrics, tensorboard_scalars
from zaya_jax.training.routing_telemetry import STEP_METRICS, DeadExperts, step_metrics


def test_step_metrics_against_numpy():
    counts = np.array([[6, 2, 0, 0, 2], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], np.float32)  # [L=3, E+1=5]
    entropy = np.array([3.0, 0.0, 2.0], np.float32)
    biases = np.arange(15, dtype=np.float32).reshape(3, 5) / 10
    m = jax.tree.map(np.asarray, step_metrics(counts, entropy, biases, num_experts=4))
    assert set(m) == set(STEP_METRICS)
    np.testing.assert_allclose(m["expert_load"], [[0.6, 0.2, 0, 0], [0, 0, 0, 0], [0.25] * 4])
    np.testing.assert_allclose(m["expert_skip_fraction"], [0.2, 0.0, 0.0])
    np.testing.assert_allclose(m["expert_load"].sum(-1) + m["expert_skip_fraction"], [1, 0, 1])
    np.testing.assert_allclose(m["expert_load_max_over_mean"], [3.0, 1.0, 1.0])
    np.testing.assert_allclose(m["router_entropy"], [0.3, 0.0, 0.5])  # per token; a layer without: 0
    np.testing.assert_array_equal(m["balancing_bias"], biases[:, :4])
    np.testing.assert_array_equal(m["balancing_skip_bias"], biases[:, 4])


def test_dead_experts_over_the_window():
    dead = DeadExperts(window=3)
    loads = {  # [L=2, E=3]; expert (0, 2) never gets a token, (1, 1) gets one at step 12 only
        10: [[1, 0, 0], [1, 0, 1]],
        11: [[0, 1, 0], [1, 0, 1]],
        12: [[1, 0, 0], [1, 1, 1]],
        13: [[1, 0, 0], [1, 0, 1]],
        14: [[1, 0, 0], [1, 0, 1]],
        15: [[1, 0, 0], [1, 0, 1]],
    }
    counts = {}
    for step, load in loads.items():
        dead.observe(step, np.asarray(load, np.float32))
        counts[step] = dead.count(step).tolist()
    # No expert is dead before 3 steps were seen; then: idle in each of the last 3 steps.
    assert counts == {10: [0, 0], 11: [0, 0], 12: [1, 0], 13: [1, 0], 14: [2, 0], 15: [2, 1]}
    dead.reset()
    dead.observe(16, np.zeros((2, 3)))
    assert dead.count(16).tolist() == [0, 0]
    with pytest.raises(ValueError, match="window"):
        DeadExperts(0)


def test_model_router_entropy_is_the_summed_entropy_of_its_probabilities():
    cfg = ZayaConfig.tiny(num_experts=4)
    variables = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(0))  # one program
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    mask = jnp.ones((2, 12), jnp.int32).at[1, :5].set(0)  # left padding is not counted
    forward = jax.jit(lambda v, i, m: ZayaForCausalLM(cfg).apply(v, i, attention_mask=m, return_logits=False))
    out = forward(variables, ids, mask)
    p = np.asarray(out.router_probs, np.float64)  # [L, B, S, E+1]
    per_token = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)
    want = np.sum(per_token * np.asarray(mask)[None], axis=(1, 2))
    np.testing.assert_allclose(out.router_entropy, want, rtol=1e-5)
    assert np.asarray(out.expert_counts).sum(-1).tolist() == [19.0] * cfg.num_hidden_layers
    assert (np.asarray(out.router_entropy) / 19 <= math.log(cfg.num_router_classes) + 1e-5).all()


def test_tensorboard_per_expert_scalars_in_one_event(tmp_path):
    assert tensorboard_scalars("train/expert_load", [[0.5, 0.25], [1.0, 0.0]]) == [
        ("train/expert_load/layer_0/expert_0", 0.5),
        ("train/expert_load/layer_0/expert_1", 0.25),
        ("train/expert_load/layer_1/expert_0", 1.0),
        ("train/expert_load/layer_1/expert_1", 0.0),
    ]
    assert tensorboard_scalars("train/mixture/a b", 3) == [("train/mixture/a_b", 3.0)]
    assert tensorboard_scalars("train/x", [[1.0], 2.0]) == [] and tensorboard_scalars("train/x", "t") == []
    with MetricsLogger(tmp_path, console=False) as log:
        log.log_train(5, {"loss": 1.0, "expert_load": [[0.5, 0.25]], "router_entropy": [1.5]})
    tags = event_tags(tmp_path / "tensorboard")
    assert tags["train/expert_load/layer_0/expert_1"] == [(5, 0.25)]
    assert tags["train/router_entropy/layer_0"] == [(5, 1.5)] and tags["train/loss"] == [(5, 1.0)]


@pytest.mark.slow
def test_training_logs_the_telemetry_and_plot_draws_it(tmp_path):
    w = tmp_path / "run"
    run_train(
        w,
        "--config.train.steps=6",
        "--config.logging.tensorboard=True",
        "--config.logging.dead_expert_window=2",
        "--config.eval.every_steps=0",
    )
    train = read_metrics(w, split="train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # SMALL logs every step
    num_layers, num_experts = 2, 4  # test_train.SMALL
    seen = []  # every step's idle experts: the dead count is checkable from the records
    for r in train:
        load = np.asarray(r["expert_load"])
        assert load.shape == (num_layers, num_experts)
        skip = np.asarray(r["expert_skip_fraction"])
        np.testing.assert_allclose(load.sum(-1) + skip, 1.0, atol=1e-6)
        np.testing.assert_allclose(r["expert_load_max_over_mean"], load.max(-1) / load.mean(-1), rtol=1e-5)
        assert all(0 <= h <= math.log(num_experts + 1) + 1e-5 for h in r["router_entropy"])
        assert np.asarray(r["balancing_bias"]).shape == (num_layers, num_experts)
        assert r["balancing_skip_bias"] == [-1.0] * num_layers  # update_skip off: never moves
        seen.append(load == 0)
        want = np.sum(seen[-1] & seen[-2], axis=-1).tolist() if len(seen) >= 2 else [0] * num_layers
        assert r["expert_dead"] == want
    # The logged biases are the state's after the step: the last checkpoint holds them bit for bit.
    from zaya_jax.hf.pretrained import load_model

    saved = np.asarray(bal.get_balancing_biases(load_model(str(w)).variables))
    np.testing.assert_array_equal(np.float32(train[-1]["balancing_bias"]), saved[:, :num_experts])
    tags = event_tags(w / "tensorboard")
    assert [v for _, v in tags["train/expert_load/layer_1/expert_3"]] == [
        np.float32(r["expert_load"][1][3]) for r in train
    ]
    assert "train/balancing_bias/layer_0/expert_0" in tags and "train/expert_dead/layer_1" in tags

    proc = subprocess.run(
        [sys.executable, "-m", "zaya_jax.plot", str(w)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert {w / "expert_load_heatmap.png", w / "balancing_bias.png"} <= {w / p for p in proc.stdout.split()}
    assert is_png(w / "expert_load_heatmap.png") and is_png(w / "balancing_bias.png")


def test_plots_of_many_layers(tmp_path):
    """12 layers (a grid of 3 rows) x 16 experts (ZAYA1's), a dead expert and a skip bias that moves
    in one layer: both PNGs are drawn; records without the telemetry (a run from before it) give None."""
    from zaya_jax.plot import plot_balancing_biases, plot_expert_load_heatmap

    rng = np.random.default_rng(0)
    num_layers, records = 12, []
    for step in range(10, 410, 10):
        load = rng.dirichlet(np.ones(17), size=num_layers)
        load[3, 5] = 0.0  # never routed to
        records.append(
            {
                "step": step,
                "split": "train",
                "expert_load": load[:, :16].tolist(),
                "expert_skip_fraction": load[:, 16].tolist(),
                "router_entropy": [2.0] * num_layers,
                "expert_dead": [1 if layer == 3 else 0 for layer in range(num_layers)],
                "balancing_bias": (rng.standard_normal((num_layers, 16)) * step / 4000).tolist(),
                "balancing_skip_bias": [
                    -1.0 + (step / 1000 if layer == 0 else 0) for layer in range(num_layers)
                ],
            }
        )
    assert is_png(plot_expert_load_heatmap(records, tmp_path / "heatmap.png"))
    assert is_png(plot_balancing_biases(records, tmp_path / "bias.png"))
    old = [{"step": 1, "split": "train", "loss": 2.0, "expert_load_max_over_mean": [1.0]}]
    assert plot_expert_load_heatmap(old, tmp_path / "h.png") is None
    assert plot_balancing_biases(old, tmp_path / "b.png") is None
