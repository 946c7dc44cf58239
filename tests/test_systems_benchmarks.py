"""benchmarks/collectives.py, gemm.py, membw.py: the nccl-tests / STREAM formulas against hand-computed
values, and each script run end to end at CI sizes on 8 simulated CPU devices (schema, positive
finite bandwidths and throughputs, plots); the expert exchange's all-to-all bytes of the compiled
train step next to the ideal. Timings themselves are never asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.xla_env import xla_flags

from benchmarks import collectives, gemm, membw
from zaya_jax.analysis import exchange
from zaya_jax.parallel import make_mesh

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# ------------------------------------------------------------------------------ formulas by hand
@pytest.mark.parametrize(
    "name, n, factor",
    [
        ("all_reduce", 8, 1.75),
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 1, 0.0),
        ("reduce_scatter", 8, 0.875),
        ("reduce_scatter", 4, 0.75),
        ("all_gather", 2, 0.5),
        ("all_gather", 8, 0.875),
        ("broadcast", 8, 1.0),
        ("broadcast", 2, 1.0),
        ("all_to_all", 8, 0.875),
        ("all_to_all", 4, 0.75),
    ],
)
def test_busbw_factors(name, n, factor):
    assert collectives.busbw_factor(name, n) == pytest.approx(factor)


def test_algbw_and_busbw_by_hand():
    # 1 GB in 0.5 s = 2 GB/s algorithm bandwidth; an 8-rank all-reduce carries 2*7/8 of it per link.
    assert collectives.algbw(1e9, 0.5) == pytest.approx(2.0)
    assert collectives.busbw("all_reduce", 1e9, 0.5, 8) == pytest.approx(3.5)
    assert collectives.busbw("all_gather", 2**30, 1e-3, 4) == pytest.approx(2**30 / 1e-3 / 1e9 * 0.75)
    assert collectives.busbw("broadcast", 4e6, 2e-3, 8) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        collectives.busbw_factor("gather", 4)


def test_sizes():
    assert collectives.parse_bytes("1K") == 1024
    assert collectives.parse_bytes("64KiB") == 65536
    assert collectives.parse_bytes("1G") == 2**30
    assert collectives.parse_bytes("4096") == 4096
    assert collectives.message_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert collectives.message_sizes(2**10, 2**30, 2)[-1] == 2**30
    assert len(collectives.message_sizes(2**10, 2**30, 2)) == 21
    # bf16 1 KiB on 8 ranks: 512 elements; on 6 ranks rounded down to a multiple of 6.
    assert collectives.element_count(1024, 2, 8) == 512
    assert collectives.element_count(1024, 2, 6) == 510
    assert collectives.element_count(2, 4, 8) == 8
    assert collectives.default_device_counts(8) == [2, 4, 8]
    assert collectives.default_device_counts(6) == [2, 4]
    assert collectives.launched_multi_process({"SLURM_NTASKS": "16"})
    assert not collectives.launched_multi_process({"SLURM_NTASKS": "1"})
    assert not collectives.launched_multi_process({})


def test_stream_bytes_and_gemm_shapes():
    assert membw.stream_bytes("copy", 100) == 200
    assert membw.stream_bytes("scale", 100) == 200
    assert membw.stream_bytes("add", 100) == 300
    assert membw.stream_bytes("triad", 100) == 300
    sweep = gemm.sweep_shapes(1024, 8192, [4096])
    dims = [s[1] for s in sweep]
    assert dims == [1024, 2048, 4095, 4096, 4097, 8192]
    zaya = {name: (m, n, k) for name, m, n, k in gemm.zaya_shapes(16384)}
    assert zaya["zaya1 q_proj"] == (16384, 1024, 2048)
    assert zaya["zaya1 expert gate_up"] == (1024, 4096, 2048)  # 16384 tokens / 16 experts
    assert zaya["zaya1 expert down"] == (1024, 2048, 2048)
    assert zaya["zaya1 lm head"] == (2048, 262272, 2048)
    assert "zaya1 lm head" not in {s[0] for s in gemm.zaya_shapes(16384, head_tokens=0)}


# ----------------------------------------------------------------------------- end-to-end on CPU
def test_collectives_cpu(tmp_path):
    proc = _run(
        [
            "-m",
            "benchmarks.collectives",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "64K",
            "--factor",
            "8",
            "--device-counts",
            "2,8",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "collectives.json").read_text())
    assert report["benchmark"] == "collectives" and report["num_devices"] == 8
    rows = report["results"]
    assert len(rows) == 5 * 2 * 3  # collectives x device counts x sizes
    assert {r["collective"] for r in rows} == set(collectives.COLLECTIVES)
    for r in rows:
        for key in ("time_s", "algbw_GBps", "busbw_GBps", "bytes", "count"):
            assert _positive_finite(r[key]), (key, r)
        assert r["devices"] in (2, 8)
        assert r["bytes"] == r["count"] * 2  # bfloat16
        assert r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * collectives.busbw_factor(r["collective"], r["devices"])
        )
    for name in collectives.COLLECTIVES:
        png = tmp_path / f"{name}.png"
        assert png.exists() and png.stat().st_size > 1000
    assert "busbw GB/s" in proc.stdout


def test_gemm_cpu(tmp_path):
    proc = _run(
        [
            "-m",
            "benchmarks.gemm",
            "--min-dim",
            "32",
            "--max-dim",
            "128",
            "--near-miss",
            "64",
            "--tokens",
            "32",
            "--head-tokens",
            "0",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gemm.json").read_text())
    rows = report["results"]
    names = {r["name"] for r in rows}
    assert {
        "square 32",
        "square 128",
        "near-miss 63",
        "near-miss 65",
        "zaya1 q_proj",
        "zaya1 expert gate_up",
    } <= names
    assert "zaya1 lm head" not in names  # --head-tokens 0
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert _positive_finite(r["tflops"]) and _positive_finite(r["time_s"])
        assert r["flops"] == 2 * r["m"] * r["n"] * r["k"]
        assert r["fraction_of_peak"] is None  # CPU: no known peak
    assert "n/a" in proc.stdout


def test_membw_cpu(tmp_path):
    proc = _run(
        [
            "-m",
            "benchmarks.membw",
            "--min-bytes",
            "64K",
            "--max-bytes",
            "256K",
            "--factor",
            "4",
            "--devices",
            "2",
            "--warmup",
            "1",
            "--iters",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "membw.json").read_text())
    rows = report["results"]
    assert len(rows) == 4 * 2 and {r["kernel"] for r in rows} == set(membw.KERNELS)
    for r in rows:
        assert _positive_finite(r["GBps"]) and _positive_finite(r["best_GBps"]) and r["devices"] == 2
        assert r["bytes_moved"] == membw.STREAM_ARRAYS[r["kernel"]] * r["array_bytes_per_device"] * 2


# ------------------------------------------------------------------ expert exchange
EXCHANGE_CONFIG = """
from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig


def get_config():
    c = base_config()
    set_model(c, ZayaConfig.tiny(hidden_size=64, num_hidden_layers=2, num_experts=8,
                                 moe_intermediate_size=32, vocab_size=128))
    c.model.remat = "full"
    c.train.batch_size, c.train.seq_len = 8, 64
    return c
"""


@pytest.mark.slow
def test_train_step_all_to_all_bytes_near_ideal(tmp_path, capsys):
    """`python -m benchmarks.collectives --expert-exchange CONFIG` (in process) on the compiled train
    step at data=2 x expert=4 (64 tokens per device, fp32, remat "full"): the main path moves C = 24
    slots per peer (1.5 x T/n, rounded to 8) each way, forward and backward, i.e. 1.5x the ideal
    plus one byte per slot for the expert ids: 4 exchanges, as without remat (the backward reuses
    what the forward received). The spill (in the cond) has T - C = 40 slots and is replayed
    when taken (6 exchanges: its outputs are not kept). The C = T exchange (factor 4 = n, every
    token's slot to every peer) moves 4x the ideal."""
    (tmp_path / "exchange.py").write_text(EXCHANGE_CONFIG)
    argv = ["--expert-exchange", str(tmp_path / "exchange.py"), "--exchange-mesh", "2,1,4"]
    rows = collectives.main([*argv, "--out", str(tmp_path)])["results"]
    n, t, d, itemsize = 4, 64, 64, 4  # EXCHANGE_CONFIG's hidden_size
    ideal = exchange.ideal_exchange_bytes(t, d, itemsize)
    assert [r["exchange_factor"] for r in rows] == [1.5, 4.0]  # default: 1.5 and n
    for row, cap in zip(rows, (24, 64)):
        assert row["tokens_per_device"] == t and row["ideal_bytes_per_block"] == ideal
        assert row["bytes_per_block"] == 4 * n * cap * d * itemsize + n * cap  # x / ids / y / dy / dx
        assert row["spill_bytes_per_block"] == (6 * n * (t - cap) * d * itemsize + 2 * n * (t - cap))
    assert rows[0]["ratio_to_ideal"] <= 2.0
    assert rows[1]["ratio_to_ideal"] >= 4.0
    assert "x ideal" in capsys.readouterr().out
    assert json.loads((tmp_path / "expert_exchange.json").read_text())["results"] == rows


def test_all_to_all_bytes_main_path_and_spill():
    """exchange.all_to_all_bytes on a small compiled program: an all-to-all in a 3-trip loop, and one in each
    branch of a cond (branch 0 = main path, branch 1 = spill)."""
    mesh = make_mesh(1, 1, 8)

    def body(x):
        x = jax.lax.fori_loop(0, 3, lambda i, v: jax.lax.all_to_all(v, "expert", 0, 0, tiled=True), x)
        flag = jax.lax.pmax((jnp.sum(x) > 0).astype(jnp.int32), "expert") > 0
        a2a = lambda v: jax.lax.all_to_all(v * 2, "expert", 0, 0, tiled=True)
        return jax.lax.cond(
            flag, lambda v: a2a(jnp.concatenate([v, v])), lambda v: a2a(v)[:8].repeat(2, 0), x
        )

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), check_vma=False)
    x = jax.device_put(jnp.ones((64, 4)), NamedSharding(mesh, P("expert")))
    main, spill = exchange.all_to_all_bytes(jax.jit(fn).lower(x).compile().as_text())
    assert (main, spill) == (3 * 8 * 4 * 4 + 8 * 4 * 4, 16 * 4 * 4)
