"""zaya_jax/params.py: the one parameter registry. It lists every variable of the model, and every
consumer (sharding, the optimizer chain, the HF mapping, sizing) reads it and rejects a parameter of
two or more dimensions that it does not list."""

import dataclasses
import functools
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax import hf, params, sizing
from zaya_jax.hf import names
from zaya_jax.model import ZayaConfig, init_variables
from zaya_jax.optim.chain import describe_routing, make_optimizer, param_labels, weight_decay_mask
from zaya_jax.parallel import make_mesh, param_shardings
from zaya_jax.parallel.sharding import logical_axes

# Every optional variable present: attention biases, an untied head with a bias.
CFG = ZayaConfig.tiny(attention_bias=True, lm_head_bias=True, tie_word_embeddings=False)
NEW = "layers/mlp/new_proj/kernel"  # a parameter nobody registered


@functools.cache
def _shapes():
    return flax.traverse_util.flatten_dict(jax.eval_shape(lambda: init_variables(CFG, jax.random.key(0))))


def _params_with(extra_shape):
    """Tiny zero params of CFG plus NEW of `extra_shape` (numpy: nothing compiles)."""
    flat = {k[1:]: np.zeros(v.shape, np.float32) for k, v in _shapes().items() if k[0] == "params"}
    flat[tuple(NEW.split("/"))] = np.zeros(extra_shape, np.float32)
    return flax.traverse_util.unflatten_dict(flat)


def test_registry_lists_exactly_the_variables_of_the_model():
    listed = {p.full_path for p in params.PARAMS}
    model = {"/".join(k) for k in _shapes()}
    assert listed == model
    for key, spec in _shapes().items():
        p = params.lookup("/".join(key[1:]), len(spec.shape), key[0])
        assert p is not None and p.collection == key[0]
        assert p.axes is None or len(p.axes) == len(spec.shape), p.path
        assert (p.optimizer is None) == (key[0] == "balancing"), p.path
        assert p.layout in names.LAYOUTS and p.when in names.CONDITIONS, p.path
    assert len({p.hf for p in params.PARAMS}) == len(params.PARAMS)  # one HF name each


def test_consumers_read_the_registry():
    p_by_path = {p.path: p for p in params.PARAMS if p.collection == "params"}
    flat = {k[1:]: v for k, v in _shapes().items() if k[0] == "params"}
    for path, shape, label in describe_routing(flax.traverse_util.unflatten_dict(flat)):
        p = p_by_path[path]
        assert label == (p.optimizer.label if len(shape) >= 2 else "adamw"), path
        assert logical_axes(path, len(shape)) == (p.axes or (None,) * len(shape)), path
    assert sizing.param_leaves(CFG) == describe_routing(flax.traverse_util.unflatten_dict(flat))
    block0 = {m.hf: "/".join(m.path) for m in names.native_map(CFG) if m.index in ((), (0,))}
    for p in params.PARAMS:
        if p.when != "after_first_block":  # block 0 has no EDA scale in transformers
            assert block0[p.hf.format(k=0)] == p.full_path


@pytest.mark.parametrize("shape", [(2, 8, 8), (8, 8)])
def test_an_unlisted_matrix_is_an_error_everywhere(shape):
    tree = _params_with(shape)
    with pytest.raises(ValueError, match=f"{NEW}.*not in the parameter registry"):
        param_shardings(tree, make_mesh(data=2, fsdp=2, expert=2))
    with pytest.raises(ValueError, match=f"{NEW}.*not in the parameter registry"):
        param_labels(tree)
    with pytest.raises(ValueError, match=f"{NEW}.*not in the parameter registry"):
        make_optimizer(_optim_cfg(), total_steps=4).init(tree)
    with pytest.raises(ValueError, match=f"{NEW}.*not in the parameter registry"):
        sizing.state_bytes_per_device([(NEW, shape, "muon")], {"data": 2, "fsdp": 2, "expert": 2})
    leaves = sizing.param_leaves(CFG) + [(NEW, shape, "muon")]
    with pytest.raises(ValueError, match=f"{NEW}.*not in the parameter registry"):
        sizing.memory_per_device(CFG, seq_len=8, micro_batch=1, mesh={"data": 8}, leaves=leaves)


def test_an_unlisted_variable_is_never_left_out_of_a_checkpoint(tmp_path):
    """HF export would silently drop a variable without an HF name: any unlisted one is an error,
    and nothing is written."""
    balancing = {k[1:]: np.zeros(v.shape, np.float32) for k, v in _shapes().items() if k[0] == "balancing"}
    out = str(tmp_path / "hf")
    for shape in ((2, 8, 8), (8,)):
        bad = {"params": _params_with(shape), "balancing": flax.traverse_util.unflatten_dict(balancing)}
        with pytest.raises(
            ValueError, match=f"save_pretrained: variable params/{NEW} is not in the parameter"
        ):
            hf.save_pretrained(CFG, bad, out, dtype="float32")
    assert not os.path.exists(out) and os.listdir(tmp_path) == []


def test_an_unlisted_vector_is_replicated_on_adamw():
    tree = {"mystery": jnp.zeros((8,))}
    assert param_labels(tree) == {"mystery": "adamw"} and weight_decay_mask(tree) == {"mystery": False}
    mesh = make_mesh(data=2, fsdp=2, expert=2)
    assert param_shardings(tree, mesh)["mystery"].spec == jax.sharding.PartitionSpec(None)


def test_registry_axes_must_match_the_array():
    with pytest.raises(ValueError, match="embed_tokens/embedding has 3 dims"):
        params.lookup("embed_tokens/embedding", 3)
    assert params.optimizer_rule("embed_tokens/embedding", 2) is params.EMBEDDING
    assert params.optimizer_rule("layers/self_attn/temp", 1) is params.SMALL_UNLISTED  # vectors: never Muon
    with pytest.raises(ValueError, match="balancing_biases.*not in the parameter registry"):
        params.optimizer_rule("layers/mlp/gate/balancing_biases", 2)  # not a "params" variable


def _optim_cfg():
    from zaya_jax.optim.chain import default_optim_config

    cfg = default_optim_config()
    cfg.warmup_steps = 1
    return cfg


def test_hf_conditions_follow_the_config():
    tied = dataclasses.replace(CFG, attention_bias=False, lm_head_bias=False, tie_word_embeddings=True)
    got = {m.hf for m in names.native_map(tied)}
    assert "lm_head.weight" not in got and "lm_head.bias" not in got
    assert "model.layers.0.self_attn.qkv_proj.q_proj.bias" not in got
    assert "model.layers.1.mlp.gate.router_states_scale" in got
    assert "model.layers.0.mlp.gate.router_states_scale" not in got


def test_the_model_does_not_import_the_optimizer():
    """model/moe -> parallel/expert -> parallel/sharding reads the registry, not optim.chain."""
    import subprocess
    import sys

    code = (
        "import sys, zaya_jax.model; print(sorted(m for m in sys.modules if m.startswith('zaya_jax.optim')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
