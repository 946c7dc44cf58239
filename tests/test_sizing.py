"""zaya_jax/sizing/: parameter counts pinned to the released model and to the real init."""

import jax
import numpy as np
import pytest

from zaya_jax.model import ZayaConfig, init_variables
from zaya_jax.parallel.expert import remat_saved_bytes
from zaya_jax.sizing import flops_per_token, mfu, newton_schulz_flops, param_counts


def test_released_model_counts():
    pc = param_counts(ZayaConfig.zaya1_base())
    assert abs(pc.total / 8.84e9 - 1) < 0.005
    assert abs((pc.total - pc.embedding) / 8.30e9 - 1) < 0.005
    assert abs(pc.active / 0.76e9 - 1) < 0.015
    assert pc.embedding == 262272 * 2048


@pytest.mark.parametrize(
    "extras", [{}, dict(attention_bias=True, tie_word_embeddings=False, lm_head_bias=True)]
)
def test_counts_equal_initialised_params(extras):
    cfg = ZayaConfig.tiny(**extras)
    shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0)))["params"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    # Ours has one extra EDA scale in block 0 (multiplies zeros; not in the released model).
    assert n - cfg.router_hidden_size == param_counts(cfg).total


def test_flops_and_mfu():
    cfg = ZayaConfig.zaya1_base()
    f = flops_per_token(cfg, 4096)
    assert 6 * param_counts(cfg).active < f < 6 * (param_counts(cfg).active + cfg.vocab_size * 2048) * 1.5
    assert flops_per_token(cfg, 4096, training=False) * 3 == pytest.approx(f)
    assert mfu(1000.0, cfg, 4096, 8, None) is None
    assert mfu(1000.0, cfg, 4096, 1, f * 1000.0) == pytest.approx(1.0)


def test_newton_schulz_flops_equal_xla_cost_of_orthogonalize():
    """The count equals the matmul FLOPs XLA counts in the Newton-Schulz of every Muon leaf (a
    stacked [l, e, d, 2i] expert tensor, wide and tall [l, in, out] kernels); XLA also counts the
    elementwise work (the normalisation, a X + ...), under 3% more here."""
    from zaya_jax.kernels.newton_schulz import orthogonalize
    from zaya_jax.sizing import param_leaves

    cfg = ZayaConfig.tiny(num_hidden_layers=2)
    xla = 0.0
    for _, shape, label in param_leaves(cfg):
        if label == "muon":
            compiled = jax.jit(lambda x: orthogonalize(x, ns_steps=3)).lower(
                jax.ShapeDtypeStruct(shape, "float32")
            )
            xla += compiled.compile().cost_analysis()["flops"]
    ours = newton_schulz_flops(cfg, ns_steps=3)
    assert ours <= xla < 1.03 * ours
    assert newton_schulz_flops(cfg, ns_steps=6) == 2 * ours


# --------------------------------------------------------------------- FLOPs breakdown, memory, rules
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from zaya_jax import sizing

ROOT = Path(__file__).resolve().parents[1]


def test_flops_breakdown_sums_to_flops_per_token():
    cfg = ZayaConfig.zaya1_base()
    b = sizing.flops_breakdown(cfg, 4096)
    assert b.forward_total == pytest.approx(flops_per_token(cfg, 4096, training=False))
    assert b.training_total == pytest.approx(flops_per_token(cfg, 4096))
    assert b.head == 2 * 262272 * 2048
    assert b.moe_active == 2 * 40 * 3 * 2048 * 2048
    assert b.attention_core == 40 * 2 * 2 * 8 * 128 * 2048  # S/2 = 2048 keys per query
    assert b.dense + b.moe_active == pytest.approx(2 * param_counts(cfg).active)


def test_sliding_window_keys():
    assert sizing.mean_keys_per_query(8) == 4
    assert sizing.mean_keys_per_query(8, 4) == pytest.approx((1 + 2 + 3 + 4 + 4 + 4 + 4 + 4) / 8)
    assert sizing.mean_keys_per_query(8, 16) == 4
    full = ZayaConfig.tiny()
    sliding = ZayaConfig.tiny(layer_types=["hybrid_sliding", "hybrid"], sliding_window=16)
    assert (
        sizing.flops_breakdown(sliding, 256).attention_core < sizing.flops_breakdown(full, 256).attention_core
    )


def test_state_bytes_by_hand():
    """data=2, fsdp=2, expert=2; fp32 params/grads, fp32 Muon momentum, fp32 AdamW m and v."""
    leaves = [
        # embed [V, d]: d over fsdp -> 320 x 32; ZeRO-1 splits V (largest free dim) over data -> 160 x 32.
        ("embed_tokens/embedding", (320, 64), "adamw"),
        # experts [L, E, d, 2I]: E over expert, d over fsdp -> 2 x 2 x 32 x 128; ZeRO-1 splits 2I -> 64.
        ("layers/mlp/experts/gate_up_proj", (2, 4, 64, 128), "muon"),
        # a norm scale [L, d]: replicated -> 2 x 64; ZeRO-1 splits d -> 2 x 32.
        ("layers/input_layernorm/scale", (2, 64), "adamw"),
    ]
    mesh = {"data": 2, "fsdp": 2, "expert": 2}
    got = sizing.state_bytes_per_device(leaves, mesh)
    assert got["params"] == 4 * (320 * 32 + 2 * 2 * 32 * 128 + 2 * 64) == 107008
    assert got["grads"] == got["params"]
    assert got["optimizer_muon"] == 4 * (2 * 2 * 32 * 64) == 32768
    assert got["optimizer_adamw"] == 8 * (160 * 32 + 2 * 32) == 41472
    assert got["muon_params"] == 2 * 4 * 64 * 128 and got["adamw_params"] == 320 * 64 + 128
    off = sizing.state_bytes_per_device(leaves, mesh, zero1=False)
    assert off["optimizer_muon"] == 65536 and off["optimizer_adamw"] == 8 * (320 * 32 + 128)
    # bf16 momentum halves the Muon state.
    assert sizing.state_bytes_per_device(leaves, mesh, muon_mu_bytes=2)["optimizer_muon"] == 16384


def test_memory_per_device_single_device_and_data_parallel():
    cfg = ZayaConfig.tiny()
    n = param_counts(cfg).total + cfg.router_hidden_size  # + our block-0 EDA scale
    one = sizing.memory_per_device(cfg, seq_len=16, micro_batch=1, mesh={"data": 1})
    assert one.muon_params + one.adamw_params == n
    assert one.params == one.grads == 4 * n
    assert one.optimizer_muon == 4 * one.muon_params and one.optimizer_adamw == 8 * one.adamw_params
    assert one.total == one.params + one.grads + one.optimizer + one.activations
    two = sizing.memory_per_device(cfg, seq_len=16, micro_batch=1, mesh="data=2")
    assert two.params == one.params and two.grads == one.grads
    assert two.optimizer == pytest.approx(one.optimizer / 2)  # every tiny leaf has an even dimension
    act = one.activations_by_remat
    assert act["full"] < act["dots_saveable"] < act["none"]
    assert one.activations == act["none"]  # tiny() has remat "none"
    # Full remat keeps the fp32 block carry (h [d] + router state [R]) of every layer per token.
    a1 = sizing.activation_bytes(cfg, seq_len=16, micro_batch=1, remat="full")
    a2 = sizing.activation_bytes(cfg, seq_len=16, micro_batch=2, remat="full")
    block = sum(sizing.activation_terms(cfg, 16).values())
    loss_rows = 16 * cfg.vocab_size * 12
    assert a2 - a1 == pytest.approx(
        16 * (cfg.num_hidden_layers * 4 * (64 + 32) + block + 12 * 64) + loss_rows
    )


def test_grad_reduce_microbatch_keeps_one_gradient_buffer_and_the_sums_shard():
    """With grad_accum > 1, train.grad_reduce "step" holds two whole fp32 gradient buffers, "microbatch"
    one and the sum as the rank's ZeRO-1 shard (1/n); where the loop is not per data rank (two of
    fsdp / expert / context > 1) or nothing is summed (grad_accum 1) the setting changes nothing."""
    cfg = ZayaConfig.tiny()
    size = {"seq_len": 16, "micro_batch": 1}
    one = sizing.memory_per_device(cfg, mesh={"data": 8}, **size)  # grad_accum 1: one buffer
    step = sizing.memory_per_device(cfg, mesh={"data": 8}, accumulate=True, **size)
    micro = sizing.memory_per_device(cfg, mesh={"data": 8}, accumulate=True, grad_reduce="microbatch", **size)
    assert step.grad_buffers == 2 and step.grads == 2 * one.grads and not step.sharded_sum
    assert micro.grad_buffers == 1 and micro.sharded_sum
    assert micro.grads == one.grads + micro.grad_shard
    assert micro.grad_shard == pytest.approx(one.grads / 8, rel=0.02)  # leaves 8 divides none of: whole
    assert micro.update_temporaries == step.update_temporaries  # the update reads the same shards
    same = sizing.memory_per_device(cfg, mesh={"data": 8}, grad_reduce="microbatch", **size)
    assert same.grads == one.grads and not same.sharded_sum
    mesh = {"data": 2, "fsdp": 2, "expert": 2}
    gspmd = [
        sizing.memory_per_device(cfg, mesh=mesh, accumulate=True, grad_reduce=mode, **size).grads
        for mode in ("step", "microbatch")
    ]
    assert gspmd[0] == gspmd[1]


def test_zaya1_base_memory_data_parallel_8():
    cfg = ZayaConfig.zaya1_base()
    m = sizing.memory_per_device(cfg, seq_len=4096, micro_batch=4, mesh={"data": 8}, remat="full")
    n = param_counts(cfg).total + cfg.router_hidden_size
    assert m.params == 4 * n  # ZeRO-1 only: params replicated
    assert m.optimizer == pytest.approx((4 * m.muon_params + 8 * m.adamw_params) / 8, rel=1e-3)
    assert 0 < m.activations < 64 * sizing.GIB
    fsdp = sizing.memory_per_device(cfg, seq_len=4096, micro_batch=4, mesh={"fsdp": 8}, remat="full")
    assert fsdp.params < m.params / 7  # nearly everything is a big matrix split on d
    ep = sizing.memory_per_device(cfg, seq_len=4096, micro_batch=4, mesh={"expert": 8}, remat="full")
    assert ep.params < m.params / 4  # expert tensors are ~87% of the params
    # Remat keeps what each block's expert exchange received (parallel/expert.py), 0 without one:
    # the tokens received, f x T x d (fp32 here, + int8 ids), and their outputs T x d fp32.
    ep1 = sizing.activation_bytes(cfg, seq_len=4096, micro_batch=4, remat="full", expert_axis=8)
    ep1_none = sizing.activation_bytes(cfg, seq_len=4096, micro_batch=4, remat="none", expert_axis=8)
    dense = sizing.activation_bytes(cfg, seq_len=4096, micro_batch=4, remat="full")
    saved = remat_saved_bytes(4 * 4096, 8, 2048, 16, 4, cfg.moe_exchange_capacity_factor)
    assert saved == 8 * 3072 * (2048 * 4 + 1) + 4 * 4096 * 2048 * 4 + 4  # C = 1.5 x 16384 / 8
    assert ep1 - dense == pytest.approx(40 * saved)
    assert ep1_none == sizing.activation_bytes(cfg, seq_len=4096, micro_batch=4, remat="none")


def test_sizing_warnings():
    cfg = ZayaConfig.zaya1_base()
    w = sizing.sizing_warnings(cfg, tokens_per_device=16384, mesh={"data": 8, "fsdp": 1, "expert": 1})
    assert not [x for x in w if x.startswith("WARNING") and "expert GEMMs" not in x]
    assert any("expert GEMMs are small" in x and "1,024 tokens per expert" in x for x in w)
    # Enough tokens per expert: no GEMM warning.
    assert not any(
        "expert GEMMs" in x
        for x in sizing.sizing_warnings(cfg, tokens_per_device=16384 * 8, mesh={"expert": 8})
    )
    bad = ZayaConfig.zaya1_base(hidden_size=2000, head_dim=96, vocab_size=262200)
    w = " | ".join(sizing.sizing_warnings(bad, mesh={"expert": 3}))
    assert "WARNING hidden_size=2000" in w and "WARNING head_dim=96" in w
    assert "WARNING vocab_size=262200" in w and "not divisible by the expert axis 3" in w


def test_parse_mesh_and_peaks():
    assert sizing.parse_mesh("data=8,fsdp=1,expert=1") == {"data": 8, "fsdp": 1, "expert": 1, "context": 1}
    assert sizing.parse_mesh("fsdp=2", num_devices=16, default={"data": -1}) == {
        "data": 8,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
    }
    with pytest.raises(ValueError):
        sizing.parse_mesh("data=-1,fsdp=-1", num_devices=8)
    with pytest.raises(ValueError):
        sizing.parse_mesh("model=2")
    assert sizing.peak_flops_per_device() is None  # CPU
    assert sizing.peak_flops_per_device(dtype="float32") is None


def _count(text: str, label: str) -> int:
    m = re.search(rf"^\s*{label}\s+[\d.]+B\s+\(([\d,]+)", text, re.MULTILINE)
    assert m, f"no {label!r} line in:\n{text}"
    return int(m.group(1).replace(",", ""))


@pytest.mark.parametrize(
    "extra", [[], ["--mesh", "data=8,fsdp=1,expert=1", "--micro-batch", "4", "--remat", "full"]]
)
def test_sizing_cli_zaya1_base(tmp_path, extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = tmp_path / "sizing.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zaya_jax.sizing",
            "--config",
            "configs/zaya1_base.py",
            *extra,
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = proc.stdout
    assert abs(_count(text, "total") / 8.84e9 - 1) < 0.005
    assert abs(_count(text, "non-embedding") / 8.30e9 - 1) < 0.005
    assert abs(_count(text, "embedding") / 0.537e9 - 1) < 0.005
    assert abs(_count(text, "active") / 0.76e9 - 1) < 0.015
    assert "Memory per device" in text
    for row in (
        "params (float32)",
        "grads (float32)",
        "optimizer: Muon momentum",
        "optimizer: AdamW m, v",
        f"activations (remat {'full' if extra else 'matmuls'})",  # the config's: every matmul output
    ):
        assert re.search(rf"^\s*{re.escape(row)}\s+[\d.]+", text, re.MULTILINE), row
    if extra:  # 4 x 4096 tokens per device: 1024 tokens per expert, far below the ~200 GFLOP rule
        assert "expert GEMMs are small" in text and "exceeds the device" not in text
    else:  # the config's 4096-sequence batch on one node of 8 without grad_accum cannot fit
        assert "micro-batch 512 sequences" in text and "exceeds the device" in text
    data = json.loads(out.read_text())
    assert data["params"]["total"] == param_counts(ZayaConfig.zaya1_base()).total
    # Muon's once-per-step Newton-Schulz against the global batch's model FLOPs: small at ZAYA1's batch
    ns = newton_schulz_flops(ZayaConfig.zaya1_base(), 5)
    assert data["newton_schulz_flops_per_step"] == pytest.approx(ns)
    m = re.search(
        r"Muon Newton-Schulz \(5 iterations\)\s+([\d.]+) TFLOP per optimizer step, ([\d.]+)% of", text
    )
    assert m and float(m.group(1)) == pytest.approx(ns / 1e12, abs=1e-3), text
    step_flops = 4096 * 4096 * data["flops_per_token"]["training"]["total"]
    assert float(m.group(2)) == pytest.approx(100 * ns / step_flops, abs=0.01)
    assert data["memory_per_device_bytes"]["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1}


def test_attention_scores_follow_the_resolved_attention_impl():
    """The dense XLA softmax keeps [Nq, S] scores per token (2f + b + 1 bytes each); the flash
    kernels keep the fp32 log-sum-exp, blockwise plus one [Nq, 512, 512] tile per sequence. Phase 3
    (32k tokens over context 2) is sized with the impl its platform resolves 'auto' to."""
    from support.configs import load

    from zaya_jax.config import model_config

    c, s = load("zaya1_base", "phase3"), 32768
    cfg3 = model_config(c)
    nq, score = cfg3.num_attention_heads, 2 * 4 + {"bfloat16": 2, "float32": 4}[cfg3.dtype] + 1
    impls = ("xla", "blockwise", "pallas")
    terms = {a: sizing.activation_terms(cfg3, s, a)["attention_scores"] for a in impls}
    tile = nq * 512 * 512 * score / s  # blockwise's one tile of scores, per token of the sequence
    assert terms == {"xla": nq * s * score, "blockwise": 4 * nq + tile, "pallas": 4 * nq}
    mesh = {"data": 4, "fsdp": 1, "expert": 1, "context": 2}
    est = {p: sizing.config_memory_per_device(c, cfg3, mesh, p) for p in ("cpu", "rocm")}
    m = est["cpu"].micro_batch
    dense = sizing.memory_per_device(cfg3, seq_len=s, micro_batch=m, mesh=mesh, remat="full", attention="xla")
    # remat full: one block's scores at a time, for the S/2 tokens of each sequence a device holds
    assert dense.activations - est["cpu"].activations == pytest.approx(
        m * s // 2 * (terms["xla"] - terms["blockwise"])
    )
    assert est["rocm"].activations < est["cpu"].activations < dense.activations
