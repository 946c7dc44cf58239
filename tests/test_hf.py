"""zaya_jax.hf against the real reference: transformers' ZayaForCausalLM (PyTorch, CPU)."""

from __future__ import annotations

import dataclasses
import json
import os

import flax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from support.hf_reference import Case, hf_logits, random_case, random_hf_model, random_inputs
from transformers import AutoModelForCausalLM

from zaya_jax import hf, model
from zaya_jax.hf import names
from zaya_jax.hf.safetensors_io import SafetensorsError, write_file
from zaya_jax.runtime.cli import UserError

TOL = 1e-4  # max abs logits difference, fp32


def ours(cfg, variables, ids, mask=None):
    out = model.ZayaForCausalLM(cfg).apply(
        variables, jnp.asarray(ids), None if mask is None else jnp.asarray(mask)
    )
    return out


def assert_logits_match(ref, got, mask):
    got = np.asarray(got)
    valid = np.ones(ref.shape[:2], bool) if mask is None else mask.astype(bool)
    err = np.abs(ref - got)[valid].max()
    assert err < TOL, f"max abs logits error {err:.3g} on valid tokens (|logits| max {np.abs(ref).max():.3g})"
    return err


def saved(model_hf, path):
    model_hf.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("seed", range(6))
def test_logits_match_transformers(seed, tmp_path):
    case = random_case(seed)
    ref_model = random_hf_model(case)
    ids, mask = random_inputs(case)
    cfg, variables = hf.load_pretrained(saved(ref_model, tmp_path))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        case.layers,
        case.q_heads,
        case.kv_heads,
        case.head_dim,
    )
    assert_logits_match(hf_logits(ref_model, ids, mask), ours(cfg, variables, ids, mask).logits, mask)


def test_grid_covers_acceptance_ranges():
    cases = [random_case(s) for s in range(6)]
    assert any(c.padded for c in cases) and any(not c.padded for c in cases)
    assert {c.t0 for c in cases} | {c.t1 for c in cases} == {2, 3}
    assert len({c.kv_heads for c in cases}) >= 2 and len({c.layers for c in cases}) >= 2


@pytest.mark.parametrize(
    "extra",
    [
        dict(attention_bias=True, overrides=dict(lm_head_bias=True, tie_word_embeddings=False)),
        dict(overrides=dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], sliding_window=5)),
    ],
    ids=["biases_untied_head", "sliding_window"],
)
def test_logits_match_transformers_variants(extra, tmp_path):
    case = Case(
        seed=11,
        layers=3,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        t0=3,
        t1=2,
        experts=4,
        theta=1e4,
        batch=2,
        seq=23,
        padded=True,
        attention_bias=extra.get("attention_bias", False),
    )
    ref_model = random_hf_model(case, **extra["overrides"])
    ids, mask = random_inputs(case)
    cfg, variables = hf.load_pretrained(saved(ref_model, tmp_path))
    assert_logits_match(hf_logits(ref_model, ids, mask), ours(cfg, variables, ids, mask).logits, mask)


def _biased_case_model():
    case = Case(
        seed=5,
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        t0=2,
        t1=2,
        experts=4,
        theta=1e4,
        batch=2,
        seq=32,
        padded=False,
    )
    ref_model = random_hf_model(case)
    with torch.no_grad():
        for layer in ref_model.model.layers:
            # Large enough to overturn many unbiased argmaxes; skip class reachable but not dominant.
            layer.mlp.gate.balancing_biases.copy_(torch.tensor([0.0, 0.25, -0.1, 0.15, 0.3]))
    return case, ref_model


def test_balancing_bias_changes_choice_and_skip_class(tmp_path):
    case, ref_model = _biased_case_model()
    ids, _ = random_inputs(case)
    cfg, variables = hf.load_pretrained(saved(ref_model, tmp_path))
    out = ours(cfg, variables, ids)
    assert_logits_match(hf_logits(ref_model, ids, None), out.logits, None)

    probs = np.asarray(out.router_probs)  # [L, B, S, E+1]
    biases = np.asarray(variables["balancing"]["layers"]["mlp"]["gate"]["balancing_biases"])  # [L, E+1]
    chosen = np.argmax(probs + biases[:, None, None, :], axis=-1)
    assert (chosen != probs.argmax(-1)).any(), "the case must contain tokens whose biased choice differs"
    counts = np.asarray(out.expert_counts)
    np.testing.assert_array_equal(counts, np.stack([np.bincount(c.ravel(), minlength=5) for c in chosen]))
    assert 0 < counts[:, case.experts].sum() < counts.sum(), "some, not all, tokens take the skip class"

    # Sensitivity: ignoring the biases would have been caught.
    unbiased = flax.core.copy(
        variables, {"balancing": {"layers": {"mlp": {"gate": {"balancing_biases": jnp.zeros_like(biases)}}}}}
    )
    err = np.abs(np.asarray(ours(cfg, unbiased, ids).logits) - hf_logits(ref_model, ids, None)).max()
    assert err > 100 * TOL


def test_round_trip_is_exact_and_loads_in_transformers(tmp_path):
    case = random_case(3)
    src = saved(random_hf_model(case), tmp_path / "src")
    cfg, variables = hf.load_pretrained(src)
    hf.save_pretrained(cfg, variables, str(tmp_path / "dst"), dtype="float32")
    a, b = (
        load_file(os.path.join(src, "model.safetensors")),
        load_file(str(tmp_path / "dst/model.safetensors")),
    )
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(reloaded).__name__ == "ZayaForCausalLM"
    # a non-empty directory is replaced only with overwrite=True
    written = (tmp_path / "dst/model.safetensors").read_bytes()
    with pytest.raises(UserError, match="is a directory that is not empty.*overwrite=True"):
        hf.save_pretrained(cfg, variables, str(tmp_path / "dst"), dtype="bfloat16")
    assert (tmp_path / "dst/model.safetensors").read_bytes() == written
    hf.save_pretrained(cfg, variables, str(tmp_path / "dst"), dtype="bfloat16", overwrite=True)
    assert (tmp_path / "dst/model.safetensors").read_bytes() != written


def test_bf16_sharded_export_loads_in_transformers(tmp_path):
    case = random_case(1)
    cfg, variables = hf.load_pretrained(saved(random_hf_model(case), tmp_path / "src"))
    out_dir = tmp_path / "bf16"
    hf.save_pretrained(cfg, variables, str(out_dir), dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out_dir / s).exists() for s in shards)
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = reloaded.state_dict()
    q = np.asarray(variables["params"]["layers"]["self_attn"]["q_proj"]["kernel"][0])
    expected = torch.from_numpy(q.T.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert torch.equal(state["model.layers.0.self_attn.qkv_proj.q_proj.weight"].float(), expected)
    assert state["model.layers.0.mlp.gate.balancing_biases"].dtype == torch.float32
    # Our own reader takes the sharded bf16 directory back.
    cfg2, variables2 = hf.load_pretrained(str(out_dir))
    assert cfg2 == cfg
    np.testing.assert_array_equal(
        np.asarray(variables2["params"]["embed_tokens"]["embedding"]),
        np.asarray(variables["params"]["embed_tokens"]["embedding"])
        .astype(ml_dtypes.bfloat16)
        .astype(np.float32),
    )


@pytest.mark.parametrize("layout", ["native", "legacy"])
def test_name_map_covers_every_variable(layout):
    """Every element of every variable comes from exactly one HF tensor (bar block 0's EDA scale)."""
    import jax

    extras = (
        dict(attention_bias=True, lm_head_bias=True, tie_word_embeddings=False) if layout == "native" else {}
    )
    cfg = model.ZayaConfig.tiny(num_hidden_layers=3, **extras)
    table = names.native_map(cfg) if layout == "native" else names.legacy_map(cfg)
    shapes = flax.traverse_util.flatten_dict(
        jax.eval_shape(lambda: model.init_variables(cfg, jax.random.key(0)))
    )
    filled = {path: np.zeros(spec.shape, np.int32) for path, spec in shapes.items()}
    for m in table:
        filled[m.path][m.index] += 1
    filled[("params", "layers", "mlp", "gate", "router_states_scale")][0] += 1
    for path, count in filled.items():
        assert (count == 1).all(), f"{'/'.join(path)}: elements covered {np.unique(count)} times"


def _legacy_dir(tmp_path, cfg, variables):
    """Writes our variables in the legacy ZAYA1-base layout (names per docs/model.md §3.2)."""
    flat = flax.traverse_util.flatten_dict(variables)
    table = names.legacy_map(cfg)
    by_name = {m.hf: m for m in table}
    produce = lambda n: by_name[n].transform.to_hf(np.asarray(flat[by_name[n].path][by_name[n].index]))
    specs = [(m.hf, produce(m.hf).shape, np.dtype(np.float32)) for m in table]
    path = tmp_path / "legacy"
    path.mkdir()
    write_file(str(path / "model.safetensors"), specs, produce)
    (path / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": cfg.hidden_size,
                "num_attention_heads": cfg.hidden_size // cfg.head_dim,
                "norm_epsilon": cfg.rms_norm_eps,
                "rope_theta": cfg.rope_theta,
                "partial_rotary_factor": cfg.partial_rotary_factor,
                "num_hidden_layers": 999,
            }
        )
    )
    return str(path)


def test_legacy_layout_imports(tmp_path):
    case = Case(
        seed=7,
        layers=3,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        t0=2,
        t1=3,
        experts=3,
        theta=1e4,
        batch=2,
        seq=17,
        padded=False,
        hidden=64,
    )
    ref_model = random_hf_model(case)
    with torch.no_grad():  # no token takes the skip class, where legacy and native differ
        for layer in ref_model.model.layers:
            layer.mlp.gate.balancing_biases[-1] = -10.0
    cfg, variables = hf.load_pretrained(saved(ref_model, tmp_path / "native"))
    legacy = _legacy_dir(tmp_path, cfg, variables)
    cfg_l, variables_l = hf.load_pretrained(legacy)
    assert cfg_l.skip_expert_output == "weighted_input"
    assert dataclasses.replace(cfg_l, skip_expert_output="zero") == dataclasses.replace(
        cfg,
        max_position_embeddings=cfg_l.max_position_embeddings,
        eos_token_id=cfg_l.eos_token_id,
        bos_token_id=cfg_l.bos_token_id,
        pad_token_id=cfg_l.pad_token_id,
        initializer_range=cfg_l.initializer_range,
    )
    for (k, a), (_, b) in zip(
        sorted(flax.traverse_util.flatten_dict(variables).items()),
        sorted(flax.traverse_util.flatten_dict(variables_l).items()),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg="/".join(k))
    ids, _ = random_inputs(case)
    assert_logits_match(hf_logits(ref_model, ids, None), ours(cfg_l, variables_l, ids).logits, None)
    with pytest.raises(ValueError, match="weighted_input"):
        hf.save_pretrained(cfg_l, variables_l, str(tmp_path / "out"))


def test_legacy_skip_class_outputs_weighted_input():
    cfg = model.ZayaConfig.tiny(num_hidden_layers=1)
    import jax

    variables = jax.jit(model.init_variables, static_argnums=0)(cfg, jax.random.key(0))  # one program
    variables = flax.core.copy(
        variables,
        {"balancing": {"layers": {"mlp": {"gate": {"balancing_biases": jnp.array([[0, 0, 0, 0, 5.0]])}}}}},
    )  # every token skips
    ids = np.arange(10)[None] % cfg.vocab_size
    native = ours(cfg, variables, ids).logits
    legacy = ours(dataclasses.replace(cfg, skip_expert_output="weighted_input"), variables, ids).logits
    assert not np.allclose(native, legacy)


def test_unknown_missing_and_misshaped_tensors_are_named(tmp_path):
    case = random_case(0)
    src = saved(random_hf_model(case), tmp_path / "src")
    tensors = load_file(os.path.join(src, "model.safetensors"))

    def variant(name, mutate):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "src/config.json").read_text())
        t = dict(tensors)
        mutate(t)
        specs = [(n, a.shape, a.dtype) for n, a in t.items()]
        write_file(str(d / "model.safetensors"), specs, lambda n: t[n])
        return str(d)

    with pytest.raises(ValueError, match="model.layers.0.mlp.extra_thing"):
        hf.load_pretrained(
            variant(
                "unknown", lambda t: t.update({"model.layers.0.mlp.extra_thing": np.zeros(3, np.float32)})
            )
        )
    with pytest.raises(ValueError, match="model.layers.0.self_attn.o_proj.weight"):
        hf.load_pretrained(variant("missing", lambda t: t.pop("model.layers.0.self_attn.o_proj.weight")))
    with pytest.raises(ValueError, match=r"model.norm.weight.*shape"):
        hf.load_pretrained(
            variant("shape", lambda t: t.update({"model.norm.weight": np.ones(5, np.float32)}))
        )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load_pretrained(str(tmp_path / "nowhere"))

    truncated = variant("truncated", lambda t: None)
    f = os.path.join(truncated, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(SafetensorsError, match="truncated or corrupt"):
        hf.load_pretrained(truncated)
