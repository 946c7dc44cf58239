"""benchmarks/: the scripts run end to end at toy sizes and write well-formed reports.

Only the plumbing is checked (schema, positive finite throughputs); timings and ratios are never
asserted, they depend on the machine.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.xla_env import FAST_COMPILE_FLAGS, xla_flags

from zaya_jax.runtime import host_memory

ROOT = Path(__file__).resolve().parents[1]
TOY = [
    "--config.model.num_hidden_layers=1",
    "--config.train.batch_size=2",
    "--config.train.seq_len=32",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--repeats",
    "1",
]
FLOOR_KEYS = {"optimizer_flops_per_step", "floor_step_s", "max_ratio_to_torch"}
SIDE_KEYS = {
    "imports_jax",
    "step_time_s",
    "step_times_s",
    "tokens_per_step",
    "tokens_per_s",
    "model_tflops_per_s",
    "mfu",
    "init_s",
    "compile_s",
    "first_step_s",
    "final_loss",
    "precision",
    "peak_rss_bytes",
    "host_memory",
}


def _run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        XLA_FLAGS=xla_flags(2),
    )  # a data=2 mesh, as a node would run
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_train_step_benchmark_writes_report(tmp_path):
    out = tmp_path / "sub" / "train_step.json"
    proc = _run(["-m", "benchmarks.train_step", *TOY, "--loop-steps", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Two rows of ours by default, interleaved with torch: the config's optimizer and AdamW only.
    assert "zaya_jax/torch tokens/s =" in proc.stdout, proc.stdout
    assert "zaya_jax_adamw/torch tokens/s =" in proc.stdout, proc.stdout
    assert "trainer loop/torch_muon =" in proc.stdout and "outside the step" in proc.stdout, proc.stdout
    assert "OMP_WAIT_POLICY default" in proc.stdout, proc.stdout

    report = json.loads(out.read_text())
    keys = {"config", "device", "method", "headline", "results", "ratio_tokens_per_s", "timestamp"}
    assert set(report) == keys
    cfg = report["config"]
    assert (cfg["batch_size"], cfg["seq_len"], cfg["steps"], cfg["repeats"]) == (2, 32, 2, 1)
    assert cfg["model"]["num_hidden_layers"] == 1 and cfg["dtype"] == "float32"
    assert _positive_finite(cfg["flops_per_token"]) and cfg["params_total"] > cfg["params_active"] > 0
    assert report["device"]["jax_backend"] == "cpu" and report["device"]["torch_device"] == "cpu"
    datetime.datetime.fromisoformat(report["timestamp"])

    # torch twice too: AdamW (the baseline) and our Muon / AdamW split (torch_muon)
    res = report["results"]
    assert set(res) == {"zaya_jax", "zaya_jax_adamw", "torch", "torch_muon"}
    for name, same in (("zaya_jax", "torch_muon"), ("zaya_jax_adamw", "torch")):
        r = res[name]
        assert r["ratio_to_torch"] == pytest.approx(r["tokens_per_s"] / res["torch"]["tokens_per_s"]), name
        assert r["ratio_same_optimizer"] == pytest.approx(r["tokens_per_s"] / res[same]["tokens_per_s"]), name
        assert _positive_finite(r["compile_s"]), name
        # the floor: the model's and the optimizer's FLOPs at the measured matmul speed
        peak = report["device"]["jax_matmul_flops_per_s"]
        floor = (2 * 32 * cfg["flops_per_token"] + r["optimizer_flops_per_step"]) / peak
        assert r["floor_step_s"] == pytest.approx(floor), name
        assert r["max_ratio_to_torch"] == pytest.approx(res["torch"]["step_time_s"] / floor), name
    # Newton-Schulz FLOPs on the config's optimizer only, and more than the toy model's own
    assert res["zaya_jax_adamw"]["optimizer_flops_per_step"] == 0
    assert res["zaya_jax"]["optimizer_flops_per_step"] > 2 * 32 * cfg["flops_per_token"]
    for name, r in res.items():
        ratios = (
            {"ratio_to_torch", "ratio_same_optimizer", *FLOOR_KEYS} if name.startswith("zaya_jax") else set()
        )
        assert set(r) == SIDE_KEYS | ratios, name
        assert r["tokens_per_step"] == 2 * 32
        for key in (
            "step_time_s",
            "tokens_per_s",
            "model_tflops_per_s",
            "init_s",
            "first_step_s",
            "final_loss",
        ):
            assert _positive_finite(r[key]), (name, key, r[key])
        assert len(r["step_times_s"]) == 1 and all(_positive_finite(t) for t in r["step_times_s"])
        assert r["mfu"] is None  # no known peak on CPU
    assert res["torch"]["compile_s"] is None and res["torch_muon"]["compile_s"] is None
    assert report["ratio_tokens_per_s"] == report["results"]["zaya_jax"]["ratio_to_torch"]
    assert cfg["moe_impl"] == "auto" and cfg["moe_impl_resolved"] == "tiled"
    assert cfg["scan_layers"] == "auto" and cfg["scan_layers_resolved"] == "unroll"
    assert cfg["optimizer"] == "both"
    assert cfg["host_memory"] == "reuse"  # glibc malloc set as the trainer sets it, in every process
    trainer_sets = "huge_pages" if host_memory.huge_pages_possible() else "reuse"
    assert {res[n]["host_memory"] for n in ("zaya_jax", "zaya_jax_adamw")} == {trainer_sets}
    assert report["headline"]["ours"]["host_memory"] == trainer_sets
    # torch's process holds what a torch user's does, jax not among it (its peak RSS is torch's):
    # huge pages through the tunable it inherits, else glibc's defaults
    torch_has = "huge_pages" if host_memory.huge_pages_possible() else "default"
    assert {res[n]["host_memory"] for n in ("torch", "torch_muon")} == {torch_has}
    assert {n: r["imports_jax"] for n, r in res.items()} == {
        "zaya_jax": True,
        "zaya_jax_adamw": True,
        "torch": False,
        "torch_muon": False,
    }
    # each side's own process and its own peak RSS (not a high-water mark inherited from the parent)
    assert all(_positive_finite(r["peak_rss_bytes"]) for r in res.values())

    # how it was measured: torch as a user runs it (its default threads, OMP_WAIT_POLICY unset)
    method = report["method"]
    assert method["omp_wait_policy"] == "default" and method["omp_wait_policy_env"] is None
    assert method["lean_cpu_compile"] is True  # XLA_FLAGS turns the emitters off (tests/support/xla_env.py)
    assert method["torch_threads_set_by"] == "torch's default" and method["torch_threads"] >= 1
    assert "own spawned process" in method["processes"] and "flipped" in method["processes"]
    assert method["cores"] >= 1 and len(method["load_average_before"]) == 3
    assert "tokens_per_second" in method["trainer_loop"] and "VmHWM" in method["peak_rss"]

    # the headline: the real trainer loop (zaya_jax.train.train, a process per repeat) alternated with
    # torch running the same optimizer
    h = report["headline"]
    ours, theirs = h["ours"], h["torch"]
    assert ours["side"] == "zaya_jax trainer loop" and theirs["side"] == "torch_muon" and ours["steps"] == 2
    assert len(ours["tokens_per_s_repeats"]) == 1 and len(theirs["step_times_s"]) == 1
    for key in ("tokens_per_s", "step_time_s", "model_tflops_per_s", "peak_rss_bytes"):
        assert _positive_finite(ours[key]), (key, ours[key])
    for key in ("tokens_per_s", "step_time_s", "peak_rss_bytes"):
        assert _positive_finite(theirs[key]), (key, theirs[key])
    assert ours["step_time_s"] == pytest.approx(2 * 32 / ours["tokens_per_s"])
    assert theirs["tokens_per_s"] == pytest.approx(2 * 32 / theirs["step_time_s"])
    assert h["ratio_same_optimizer"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    assert h["peak_rss_ratio"] == pytest.approx(ours["peak_rss_bytes"] / theirs["peak_rss_bytes"])
    # time outside the step: the bare step timed after the loop in the loop's own process
    (bare,) = ours["bare_step_time_s_repeats"]
    assert _positive_finite(bare)
    assert h["outside_step_fraction"] == pytest.approx(1 - bare / ours["step_time_s"])
    across = 1 - res["zaya_jax"]["step_time_s"] / ours["step_time_s"]
    assert h["outside_step_fraction_across_processes"] == pytest.approx(across)
    # a data=2 mesh: its programs run on XLA's threads, so a step call is not a whole step
    assert ours["step_call_s_repeats"] == [None] and h["outside_step_fraction_in_window"] is None
    assert "same process" in method["trainer_loop"]


def test_adamw_only_optimizer_routes_every_parameter_to_adamw():
    # The like-for-like row: no Muon state anywhere, one AdamW moment per parameter.
    import jax
    import optax

    from benchmarks.train_config import load_config
    from benchmarks.train_step_sides import make_benchmark_optimizer
    from zaya_jax.model import ZayaConfig
    from zaya_jax.model.transformer import init_variables
    from zaya_jax.optim.muon import MuonState

    c = load_config("configs/tiny.py")
    params = jax.eval_shape(lambda: init_variables(ZayaConfig.tiny(), jax.random.key(0)))["params"]
    is_muon = lambda x: isinstance(x, MuonState)
    for optimizer, want_muon in (("config", True), ("adamw", False)):
        state = jax.eval_shape(make_benchmark_optimizer(c, optimizer).init, params)
        leaves = jax.tree.leaves(state, is_leaf=is_muon)
        assert any(is_muon(x) for x in leaves) == want_muon, optimizer
    adam = [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(x, optax.ScaleByAdamState)
    ]
    assert len(adam) == 1 and jax.tree.structure(adam[0].mu) == jax.tree.structure(params)


def test_sgd_pair_updates_by_lr_times_gradient_on_both_sides():
    # The model-only pair: no optimizer state, one update p <- p - optim.lr * g, ours and torch's.
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from benchmarks.reference import hf_config
    from benchmarks.torch_side import TORCH_SGD, TorchSide
    from benchmarks.train_config import load_config
    from benchmarks.train_step_sides import make_benchmark_optimizer, selected_optimizers
    from zaya_jax.model import ZayaConfig

    assert selected_optimizers("all") == ("config", "adamw", "sgd")  # three pairs in one run
    c = load_config("configs/tiny.py")
    tx = make_benchmark_optimizer(c, "sgd")
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros((4,))}
    grads = {"w": jnp.full((3, 2), 2.0), "b": jnp.arange(4.0)}
    state = tx.init(params)
    assert jax.tree.leaves(state) == []  # no momentum, no moments
    updates, _ = tx.update(grads, state, params)
    for k in params:
        np.testing.assert_allclose(updates[k], -c.optim.lr * grads[k], rtol=1e-6)

    cfg = ZayaConfig.tiny()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8))
    side = TorchSide(hf_config(cfg), c.optim, ids, 0, "cpu", "float32", "autocast", 1, 1, sgd=True)
    assert side.name == TORCH_SGD and type(side.opt) is torch.optim.SGD
    before = {n: p.detach().clone() for n, p in side.model.named_parameters()}
    side.run(1)
    moved = 0
    for n, p in side.model.named_parameters():
        want = before[n] - c.optim.lr * p.grad
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)
        moved += int(not torch.equal(p.detach(), before[n]))
    assert moved > 0 and math.isfinite(side.loss())


def test_torch_muon_mirrors_our_optimizer_chain():
    # The torch Muon row times the same work as ours: the same tensors on Muon (every other one on
    # AdamW) and the same Newton-Schulz iteration, in either orientation.
    import jax
    import numpy as np
    import torch
    from transformers import ZayaForCausalLM as HFZayaForCausalLM

    from benchmarks.reference import hf_config
    from benchmarks.torch_muon import muon_tensor_names, orthogonalize
    from zaya_jax.hf.names import native_map
    from zaya_jax.kernels.newton_schulz import DEFAULT_NS_COEFFS
    from zaya_jax.kernels.newton_schulz import orthogonalize as ours
    from zaya_jax.model import ZayaConfig
    from zaya_jax.model.transformer import init_variables
    from zaya_jax.optim.chain import param_labels
    from zaya_jax.params import MUON

    cfg = ZayaConfig.tiny()
    named = dict(HFZayaForCausalLM(hf_config(cfg)).named_parameters())
    names = muon_tensor_names(cfg, {n: p.ndim for n, p in named.items()})
    params = jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0)))["params"]
    labels = param_labels(params)
    want = set()
    for t in native_map(cfg):
        if t.path[0] == "params":
            leaf = labels
            for key in t.path[1:]:
                leaf = leaf[key]
            if leaf == MUON:
                want.add(t.hf)
    assert names == want and any("experts.gate_up_proj" in n for n in names)
    assert "model.embed_tokens.weight" not in names

    x = np.random.default_rng(0).standard_normal((3, 16, 40)).astype(np.float32)
    for arr in (x, x.transpose(0, 2, 1)):
        got = orthogonalize(torch.as_tensor(arr), DEFAULT_NS_COEFFS, 5, 1e-8).numpy()
        np.testing.assert_allclose(got, np.asarray(ours(arr)), atol=1e-5)


LOOP_ALONE = """
import json
from benchmarks.train_config import load_config
from benchmarks.train_step_sides import trainer_loop_alone
c = load_config("configs/tiny.py")
c.model.num_hidden_layers, c.train.batch_size, c.train.seq_len = 1, 2, 32
print(json.dumps(trainer_loop_alone(c, 2, True)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not host_memory.huge_pages_possible(), reason="glibc >= 2.35 and a kernel with THP")
def test_trainer_loop_times_its_step_calls_where_they_run_inline():
    """One CPU device with huge pages (host_memory.keep_step_buffers): each train_step call lasts its
    whole step, so the window's calls fit inside the window the loop's throughput is taken over."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    env["GLIBC_TUNABLES"] = host_memory.HUGE_PAGES_TUNABLE
    proc = subprocess.run([sys.executable, "-c", LOOP_ALONE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["host_memory"] == "huge_pages" and out["steps"] == 2
    assert _positive_finite(out["step_call_s"]) and out["step_call_s"] <= out["step_time_s"], out
    from benchmarks import train_step

    fraction = train_step._in_window([out], 2 * 32)
    assert fraction == pytest.approx(1 - out["step_call_s"] / out["step_time_s"])
    assert train_step._in_window([{**out, "step_call_s": None}], 2 * 32) is None


@pytest.mark.slow
def test_train_step_benchmark_adamw_only_row(tmp_path):
    out = tmp_path / "adamw.json"
    proc = _run(
        ["-m", "benchmarks.train_step", *TOY, "--skip-torch", "--optimizer", "adamw", "--out", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "every parameter on AdamW" in proc.stdout and "trainer loop skipped" in proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["optimizer"] == "adamw" and report["headline"] is None
    assert report["method"]["torch_threads"] is None
    assert set(report["results"]) == {"zaya_jax_adamw"} and report["ratio_tokens_per_s"] is None
    assert _positive_finite(report["results"]["zaya_jax_adamw"]["tokens_per_s"])


@pytest.mark.slow
def test_train_step_benchmark_sgd_pair(tmp_path):
    # --optimizer sgd: our step and torch's with plain SGD (the models' forward + backward), beside
    # the AdamW baseline; ratios as for the other pairs, no optimizer FLOPs in the floor.
    out = tmp_path / "sgd.json"
    proc = _run(["-m", "benchmarks.train_step", *TOY, "--optimizer", "sgd", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "plain SGD" in proc.stdout and "trainer loop skipped" in proc.stderr
    report = json.loads(out.read_text())
    res = report["results"]
    assert report["config"]["optimizer"] == "sgd" and report["headline"] is None
    assert set(res) == {"zaya_jax_sgd", "torch", "torch_sgd"}
    r = res["zaya_jax_sgd"]
    assert r["ratio_same_optimizer"] == pytest.approx(r["tokens_per_s"] / res["torch_sgd"]["tokens_per_s"])
    assert r["ratio_to_torch"] == pytest.approx(r["tokens_per_s"] / res["torch"]["tokens_per_s"])
    assert set(r) == SIDE_KEYS | FLOOR_KEYS | {"ratio_to_torch", "ratio_same_optimizer"}
    assert r["optimizer_flops_per_step"] == 0
    imports_jax = {n: x["imports_jax"] for n, x in res.items()}
    assert imports_jax == {"zaya_jax_sgd": True, "torch": False, "torch_sgd": False}
    for name, x in res.items():
        assert _positive_finite(x["final_loss"]) and _positive_finite(x["peak_rss_bytes"]), name


def test_train_step_cli_as_script_and_bad_override(tmp_path):
    # Script form (not -m) parses its arguments; an unknown key fails before anything is built.
    proc = _run(["benchmarks/train_step.py", "--help"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--skip-torch" in proc.stdout and "--config.KEY=VALUE" in proc.stdout
    proc = _run(
        [
            "benchmarks/train_step.py",
            "--config.train.no_such_key=1",
            "--skip-torch",
            "--out",
            str(tmp_path / "x.json"),
        ],
        timeout=300,
    )
    assert proc.returncode != 0 and "no_such_key" in proc.stderr
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------- benchmarks.evaluate
EVAL_SIDE_KEYS = {
    "pass_s",
    "pass_times_s",
    "requests_per_s",
    "tokens_per_s",
    "first_pass_s",
    "compile_s",
    "compilations",
    "recompiled_while_timed",
    "buckets",
    "batch_size",
    "batches",
    "computed_tokens",
    "padding_fraction",
    "max_abs_diff_vs_bucketed",
    "greedy_mismatches_vs_bucketed",
}


def test_evaluate_benchmark_writes_report(tmp_path):
    out = tmp_path / "sub" / "evaluate.json"
    args = ["--requests", "20", "--max-len", "32", "--batch-size", "4", "--min-bucket", "8"]
    args += ["--set", "num_hidden_layers=1", "--iters", "2", "--warmup", "1", "--out", str(out)]
    proc = _run(["-m", "benchmarks.evaluate", *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bucketed/unbucketed requests/s =" in proc.stdout and "bucketed/torch =" in proc.stdout
    assert "max |d loglik|" in proc.stdout, proc.stdout

    report = json.loads(out.read_text())
    assert set(report) == {"benchmark", "config", "device", "results", "agreement", "ratios", "timestamp"}
    cfg = report["config"]
    assert (cfg["requests"], cfg["max_len"], cfg["batch_size"], cfg["iters"]) == (20, 32, 4, 2)
    assert cfg["model"]["num_hidden_layers"] == 1 and cfg["model"]["vocab_size"] == 259
    assert (
        8 <= cfg["length_min"] <= cfg["length_max"] <= 32 and 0 < cfg["scored_tokens"] < cfg["request_tokens"]
    )
    assert report["device"]["jax_backend"] == "cpu" and report["device"]["torch_device"] == "cpu"
    datetime.datetime.fromisoformat(report["timestamp"])

    res = report["results"]
    assert set(res) == {"bucketed", "unbucketed", "torch"}
    for name, r in res.items():
        assert set(r) == EVAL_SIDE_KEYS, name
        for key in ("pass_s", "requests_per_s", "tokens_per_s", "first_pass_s"):
            assert _positive_finite(r[key]), (name, key, r[key])
        assert len(r["pass_times_s"]) == 2 and all(_positive_finite(t) for t in r["pass_times_s"])
        assert r["batches"] == 5 and r["batch_size"] == 4
        assert r["computed_tokens"] >= cfg["request_tokens"]
        assert r["tokens_per_s"] == pytest.approx(cfg["request_tokens"] / r["pass_s"])
    b, u, t = res["bucketed"], res["unbucketed"], res["torch"]
    # ours: every compilation in the first pass, at most one per bucket; unbucketed pads all to max_len
    assert b["buckets"] == [8, 16, 32] and 1 <= b["compilations"] <= 3 and not b["recompiled_while_timed"]
    assert u["buckets"] == [32] and u["compilations"] == 1 and not u["recompiled_while_timed"]
    assert u["computed_tokens"] == 5 * 4 * 32 and b["computed_tokens"] <= u["computed_tokens"]
    assert _positive_finite(b["compile_s"]) and _positive_finite(u["compile_s"])
    assert t["compile_s"] is None and t["compilations"] is None and t["buckets"] is None

    # the same weights and requests: the log-likelihoods agree (fp32)
    agr = report["agreement"]
    assert agr["max_abs_diff_torch_vs_bucketed"] < 1e-4, agr
    assert agr["max_abs_diff_unbucketed_vs_bucketed"] < 1e-4, agr
    assert agr["greedy_mismatches_torch_vs_bucketed"] == 0 and agr["max_abs_loglik"] > 1.0
    for key in ("bucketed_over_unbucketed", "bucketed_over_torch", "unbucketed_over_torch"):
        assert _positive_finite(report["ratios"][key]), key
    assert report["ratios"]["bucketed_over_torch"] == pytest.approx(b["requests_per_s"] / t["requests_per_s"])


def test_evaluate_benchmark_cli_as_script_and_bad_override(tmp_path):
    proc = _run(["benchmarks/evaluate.py", "--help"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--torch-batching" in proc.stdout and "--min-bucket" in proc.stdout
    proc = _run(["benchmarks/evaluate.py", "--set", "no_such_field=1", "--out", str(tmp_path / "x.json")])
    assert proc.returncode != 0 and "no_such_field" in proc.stderr
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------- benchmarks.generate
def test_generate_benchmark_writes_report(tmp_path):
    out = tmp_path / "sub" / "generate.json"
    args = ["--batch-size", "2", "--prompt-len", "12", "--new-tokens", "5", "--set", "num_hidden_layers=1"]
    proc = _run(["-m", "benchmarks.generate", *args, "--iters", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cached/recompute new tokens/s =" in proc.stdout and "cached/torch =" in proc.stdout

    report = json.loads(out.read_text())
    assert set(report) == {"benchmark", "config", "device", "results", "ratios", "timestamp"}
    cfg = report["config"]
    assert (cfg["batch_size"], cfg["prompt_len"], cfg["new_tokens"], cfg["iters"]) == (2, 12, 5, 2)
    assert max(cfg["prompt_lengths"]) == 12 and min(cfg["prompt_lengths"]) >= 6
    assert cfg["model"]["num_hidden_layers"] == 1 and report["device"]["torch_device"] == "cpu"
    res = report["results"]
    assert set(res) == {"cached", "recompute", "torch"}
    for name, r in res.items():
        assert len(r["call_times_s"]) == 2, name
        for key in ("call_s", "new_tokens_per_s", "ms_per_step", "first_call_s"):
            assert _positive_finite(r[key]), (name, key, r[key])
        assert r["new_tokens_per_s"] == pytest.approx(2 * 5 / r["call_s"])
        # the same weights and prompts, greedy: every side generates the cached side's tokens
        assert r["vs_cached"] == {"rows_equal": 2, "first_diff_step": None}, name
    assert _positive_finite(res["cached"]["compile_s"]) and res["torch"]["compile_s"] is None
    for key in ("cached_over_recompute", "cached_over_torch", "recompute_over_torch"):
        assert _positive_finite(report["ratios"][key]), key


def test_generate_benchmark_agreement_names_the_first_differing_step():
    import numpy as np

    from benchmarks.generate import agreement

    ref = np.array([[1, 2, 3], [4, 5, 6]])
    assert agreement(ref, ref) == {"rows_equal": 2, "first_diff_step": None}
    assert agreement(np.array([[1, 2, 3], [4, 9, 6]]), ref) == {"rows_equal": 1, "first_diff_step": 1}


def test_generate_benchmark_bad_arguments(tmp_path):
    proc = _run(["benchmarks/generate.py", "--set", "no_such_field=1", "--out", str(tmp_path / "x.json")])
    assert proc.returncode != 0 and "no_such_field" in proc.stderr
    proc = _run(["benchmarks/generate.py", "--new-tokens", "0"])
    assert proc.returncode == 2 and "error: argument --new-tokens: must be an int >= 1" in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_long_context_benchmark_writes_report(tmp_path):
    """benchmarks/long_context.py: one process per (impl, length), a timed row and a compile-only one."""
    out, config = tmp_path / "long.json", tmp_path / "one_block.py"
    # configs/tiny.py with one block: three processes each compile the model, a quarter as much
    config.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('tiny', {str(ROOT / 'configs/tiny.py')!r})\n"
        "tiny = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(tiny)\n\n\n"
        "def get_config():\n"
        "    c = tiny.get_config()\n"
        "    c.model.num_hidden_layers = 1\n"
        "    return c\n"
    )
    args = ["-m", "benchmarks.long_context", "--config", str(config), "--seq", "64"]
    proc = _run([*args, "--steps", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["seq"]) for r in rows] == [("xla", 64), ("blockwise", 64)]
    for r in rows:
        assert _positive_finite(r["step_s"]) and _positive_finite(r["temp_bytes"]), r
        assert _positive_finite(r["peak_rss_bytes"]), r
    proc = _run([*args, "--impls", "xla", "--steps", "0"])
    assert proc.returncode == 0 and "(compiled only)" in proc.stdout, proc.stderr[-2000:]


def test_newton_schulz_benchmark_writes_report(tmp_path):
    """benchmarks/newton_schulz.py: both sides orthogonalise the same Muon matrices (their FLOPs agree,
    from two different parameter layouts: our [l, ...] stacks, transformers' per-layer tensors); the
    step's CPU choice (slice by slice) is what ours runs; a bad override is one `error:` line."""
    out = tmp_path / "ns.json"
    toy = ["--config.model.num_hidden_layers=2", "--config.model.num_experts=4", "--iters", "1"]
    proc = _run(["-m", "benchmarks.newton_schulz", *toy, "--repeats", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zaya_jax/torch_muon speed =" in proc.stdout and "(the same FLOPs)" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    ours, torch = report["results"]["zaya_jax"], report["results"]["torch_muon"]
    assert report["same_flops"] and ours["flops"] == torch["flops"] > 0
    assert ours["impl"] == "xla per slice" and torch["threads"] >= 1
    # Ours: one stack per Muon leaf (10 per block kind); torch's: 2 blocks x the same 10 tensors.
    assert (ours["matrices"], torch["matrices"]) == (10, 20)
    for r in (ours, torch):
        assert _positive_finite(r["time_s"]) and _positive_finite(r["gflop_per_s"])
        assert len(r["repeat_medians_s"]) == 1
    assert report["method"]["torch"] == "its defaults: threads, OMP_WAIT_POLICY unset"
    proc = _run(["-m", "benchmarks.newton_schulz", "--config.optim.muon.ns_steps=0"])
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr


def test_peak_rss_is_the_process_own():
    # A spawned child's VmHWM is its own; getrusage's ru_maxrss would carry this process' high-water
    # mark across fork + exec (what made checkpoint_io report an export's RSS as 23 GB).
    import numpy as np

    from benchmarks.common import in_own_process, peak_rss_bytes, reset_peak_rss, rss_bytes

    big = np.ones(300_000_000 // 8)  # 300 MB, touched
    parent = peak_rss_bytes()
    child = in_own_process(peak_rss_bytes)
    assert parent is not None and child is not None and child < parent - 200e6, (child, parent)
    del big
    if reset_peak_rss():  # the high-water mark falls back to what the process holds now
        assert peak_rss_bytes() < parent - 200e6 and rss_bytes() <= peak_rss_bytes()


def test_train_step_wait_policy_is_torch_default_unless_asked():
    from benchmarks.train_step import parse_args
    from benchmarks.train_step_sides import OMP_WAIT_POLICIES

    assert parse_args([]).omp_wait_policy == "default" and OMP_WAIT_POLICIES["default"] is None
    assert OMP_WAIT_POLICIES[parse_args(["--omp-wait-policy", "passive"]).omp_wait_policy] == "PASSIVE"
    assert parse_args([]).threads == 0  # torch's own thread count


def test_profile_step_names_the_step_time_by_phase_and_site(tmp_path):
    """benchmarks/profile_step.py: a profiled train step's op time, every op named by the model code
    that made it (the compiled HLO's op_name), split into forward, backward and optimizer; a bad
    override is one `error:` line."""
    out = tmp_path / "profile.json"
    toy = ["--config.model.num_hidden_layers=1", "--config.train.batch_size=2", "--config.train.seq_len=32"]
    steps = ["--steps", "2", "--timed", "2", "--warmup", "1"]
    proc = _run(["-m", "benchmarks.profile_step", *toy, *steps, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile_step:" in proc.stdout and "ms of ops in" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    phases = report["phases_ms"]
    assert set(phases) == {"forward", "backward", "recompute", "optimizer"}
    assert all(phases[p] > 0 for p in ("forward", "backward", "optimizer")), phases
    assert report["op_ms"] == pytest.approx(sum(phases.values()))
    assert report["op_ms"] == pytest.approx(sum(r["ms"] for r in report["sites"]))
    assert report["op_ms"] == pytest.approx(sum(r["ms"] for r in report["ops"]))
    sites = {r["site"]: r for r in report["sites"]}
    # the model's blocks by module, the experts' work in both directions, Muon's matmuls in the update
    assert sites["mlp/experts"]["forward"] > 0 and sites["mlp/experts"]["backward"] > 0, sites.keys()
    assert any(s.startswith("self_attn/") for s in sites), sites.keys()
    muon = [r for r in report["ops"] if r["phase"] == "optimizer" and r["op_name"].endswith("dot_general")]
    assert muon and all("optimizer_update" in r["op_name"] for r in muon)
    ms = [r["ms"] for r in report["sites"]]
    assert ms == sorted(ms, reverse=True)
    for key in ("step_ms", "profiled_step_ms", "trace_overhead", "op_calls"):
        assert _positive_finite(report[key]), (key, report[key])
    assert report["host_memory"] in ("huge_pages", "reuse")
    # the machine: two 2-core boxes here differed 2-3x in matmul speed
    device = report["device"]
    assert isinstance(device["cpu_model"], str) and isinstance(device["cpu_vector_flags"], list)
    proc = _run(["-m", "benchmarks.profile_step", "--config.optim.muon.ns_steps=0"])
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr


def test_op_names_reads_each_instruction_source():
    from zaya_jax.analysis import hlo

    text = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

ENTRY %main.3 (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  %sine.2 = f32[4]{0} sine(%x.1), metadata={op_name="jit(f)/layers/mlp/sin" source_file="m.py"}
  ROOT %copy.3 = f32[4]{0} copy(%sine.2)
}
"""
    assert hlo.op_names(text) == {"x.1": "", "sine.2": "jit(f)/layers/mlp/sin", "copy.3": ""}


# ------------------------------------------------------------------------- benchmarks/kernels
@pytest.mark.slow
def test_kernel_benchmark_check_mode(tmp_path):
    """benchmarks/kernels.py on CPU: check mode (tiny shapes, interpret), table + JSON report."""
    from benchmarks import kernels as bench

    out = tmp_path / "k.json"
    result = bench.main(["--kernels", "ns", "--iters", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["mode"] == "check" and saved["errors"] == [] and len(saved["results"]) == 2
    assert saved["peak_tflops"]["bfloat16"] is None  # CPU
    assert result["max_rel_err"] < 1e-5


# ------------------------------------------------------------------- benchmarks/checkpoint_io
@pytest.mark.slow
def test_checkpoint_io_benchmark_runs(tmp_path):
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.checkpoint_io",
            "--out",
            str(tmp_path),
            "--repeats",
            "1",
            "--steps",
            "2",
            "--dir",
            str(tmp_path / "scratch"),
            "--config.train.batch_size=2",
            "--config.train.seq_len=32",
            "--config.model.num_hidden_layers=1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "checkpoint_io.json").read_text())
    assert r["save"]["MBps"] > 0 and r["restore"]["MBps"] > 0 and r["disk"]["write_MBps"] > 0
    assert r["async_save"]["stall_s"] >= 0
    # a trained state (random moments: incompressible), its size on disk next to its size in memory
    assert "random" in r["method"]["state_fill"] and "moments" in r["method"]["state_fill"]
    assert r["checkpoint_bytes_on_disk"] > 0.5 * r["state_bytes"] > 0
    assert r["on_disk_over_state"] == r["checkpoint_bytes_on_disk"] / r["state_bytes"]
    assert r["save"]["fraction_of_disk_write"] > 0 and len(r["save"]["seconds"]) == 1
    # each operation's own process and its own peak RSS (never a parent's high-water mark)
    assert "own" in r["method"]["processes"] and "VmHWM" in r["method"]["peak_rss"]
    for part in (r["save"], r["restore"]):
        assert part["peak_rss_bytes"] > 0 and part["extra_peak_rss_bytes"] >= 0, part
    assert r["restore"]["peak_over_state"] == r["restore"]["peak_rss_bytes"] / r["state_bytes"]
    export = r["export"]
    for dtype in ("float32", "bfloat16"):
        e = export[dtype]
        assert e["peak_rss_bytes"] > 0 and e["hf_bytes"] > 0, e
        assert e["extra_rss_bytes"] == e["peak_rss_bytes"] - export["baseline_peak_rss_bytes"]
        assert e["peak_over_state"] == e["peak_rss_bytes"] / r["state_bytes"]
    assert "orbax save" in proc.stdout and "export float32: peak RSS" in proc.stdout
    assert not (tmp_path / "scratch").exists()


# ------------------------------------------------------------------------- benchmarks/gpu_check
def test_gpu_check_cases_are_valid_one_device_configs():
    from benchmarks import gpu_check
    from zaya_jax import config as config_lib

    shapes = {}
    for name in gpu_check.CASES:
        c = gpu_check.case_config(name)
        cfg = config_lib.validate(c, "cuda")
        shapes[name] = (cfg.num_hidden_layers, c.train.batch_size, c.train.seq_len, c.mesh.data)
    assert shapes["zaya1_2l"] == (2, 4, 4096, 1) and shapes["long"] == (2, 1, 32768, 1)
    assert shapes["tiny"][3] == 1
    assert gpu_check.signed_error(1.2, 1.0) == pytest.approx(0.2)
    assert gpu_check.signed_error(0.9, 1.0) == pytest.approx(-0.1)


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    """The script's whole path (compile, predict, run, time, report) on one CPU device; without
    --allow-cpu it refuses the CPU with one error line."""
    from support.cli_runs import one_error

    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS}  # the script sets its device count
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--cases",
        "tiny",
        "--config.model.num_hidden_layers=1",
    ]
    cmd += ["--config.train.batch_size=2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
    assert "no GPU here" in one_error(proc)
    proc = subprocess.run(
        [*cmd, "--allow-cpu"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())["cases"]
    assert row["case"] == "tiny" and len(row["measured_all_seconds"]) == 2
    assert row["measured_seconds"] > 0 and row["predicted_seconds"] > 0
    assert row["error"] == pytest.approx(
        (row["predicted_seconds"] - row["measured_seconds"]) / row["measured_seconds"]
    )
    assert "tiny" in proc.stdout and "%" in proc.stdout
