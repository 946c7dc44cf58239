"""Tests for zaya_jax.optim.chain: Muon/AdamW routing table, weight-decay mask,
make_optimizer under jit, global-norm clipping, per-expert orthogonalisation."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from zaya_jax.optim.chain import (
    adamw,
    default_optim_config,
    describe_routing,
    lr_schedule,
    make_optimizer,
    param_labels,
    weight_decay_mask,
)

# Small dims: layers, model, vocab, kv heads, head dim, conv channels, router dim,
# experts, expert intermediate, conv taps.
L, D, V, NKV, HD, C, R, E, I, T0, T1 = 2, 8, 16, 2, 4, 16, 4, 3, 6, 2, 2

# path -> (shape, expected label, expected weight decay)
EXPECTED = {
    "embed_tokens/embedding": ((V, D), "adamw", True),
    "input_hidden_states_scale": ((D,), "adamw", False),
    "input_hidden_states_bias": ((D,), "adamw", False),
    "layers/input_layernorm/scale": ((L, D), "adamw", False),
    "layers/self_attn/q_proj/kernel": ((L, D, 2 * NKV * HD), "muon", True),
    "layers/self_attn/q_proj/bias": ((L, 2 * NKV * HD), "adamw", False),
    "layers/self_attn/k_proj/kernel": ((L, D, NKV * HD), "muon", True),
    "layers/self_attn/k_proj/bias": ((L, NKV * HD), "adamw", False),
    "layers/self_attn/v_proj_current/kernel": ((L, D, NKV * HD // 2), "muon", True),
    "layers/self_attn/v_proj_delayed/kernel": ((L, D, NKV * HD // 2), "muon", True),
    "layers/self_attn/o_proj/kernel": ((L, 2 * NKV * HD, D), "muon", True),
    "layers/self_attn/conv_qk_depthwise/kernel": ((L, T0, C), "adamw", True),
    "layers/self_attn/conv_qk_depthwise/bias": ((L, C), "adamw", False),
    "layers/self_attn/conv_qk_grouped/kernel": ((L, T1, HD, C), "adamw", True),
    "layers/self_attn/conv_qk_grouped/bias": ((L, C), "adamw", False),
    "layers/self_attn/temp": ((L, NKV), "adamw", False),
    "layers/post_attention_residual_scale/hidden_states_scale": ((L, D), "adamw", False),
    "layers/post_attention_residual_scale/hidden_states_bias": ((L, D), "adamw", False),
    "layers/post_attention_residual_scale/residual_scale": ((L, D), "adamw", False),
    "layers/post_attention_residual_scale/residual_bias": ((L, D), "adamw", False),
    "layers/post_attention_layernorm/scale": ((L, D), "adamw", False),
    "layers/post_mlp_residual_scale/hidden_states_scale": ((L, D), "adamw", False),
    "layers/post_mlp_residual_scale/residual_bias": ((L, D), "adamw", False),
    "layers/mlp/gate/down_proj/kernel": ((L, D, R), "muon", True),
    "layers/mlp/gate/down_proj/bias": ((L, R), "adamw", False),
    "layers/mlp/gate/router_states_scale": ((L, R), "adamw", False),
    "layers/mlp/gate/router_mlp/norm/scale": ((L, R), "adamw", False),
    "layers/mlp/gate/router_mlp/fc1/kernel": ((L, R, R), "muon", True),
    "layers/mlp/gate/router_mlp/fc1/bias": ((L, R), "adamw", False),
    "layers/mlp/gate/router_mlp/fc2/kernel": ((L, R, R), "muon", True),
    "layers/mlp/gate/router_mlp/fc2/bias": ((L, R), "adamw", False),
    "layers/mlp/gate/router_mlp/out_proj/kernel": ((L, R, E + 1), "adamw", True),
    "layers/mlp/experts/gate_up_proj": ((L, E, D, 2 * I), "muon", True),
    "layers/mlp/experts/down_proj": ((L, E, I, D), "muon", True),
    "norm/scale": ((D,), "adamw", False),
    "lm_head/bias": ((V,), "adamw", False),
}


def _nest(flat):
    tree = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# Test data is made in numpy and only uploaded: eager jax ops (jax.random, jnp on
# ~40 distinct shapes) compile once per shape, which would dominate test time.
def _rand(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _params(seed=0, fn=lambda x: x):
    """Fake params (or grads: ``fn`` applied to the numpy values before upload)."""
    return _nest(
        {
            p: jnp.asarray(fn(np.random.default_rng(seed + i).standard_normal(s)), jnp.float32)
            for i, (p, (s, _, _)) in enumerate(EXPECTED.items())
        }
    )


def _cfg(clip=1.0):
    cfg = default_optim_config()
    cfg.warmup_steps = 2
    cfg.lr = 1e-2
    cfg.clip_grad_norm = clip
    # Distinct decays so tests can tell which optimizer decayed a parameter.
    cfg.adamw.weight_decay = 0.5
    cfg.muon.weight_decay = 0.25
    return cfg


@functools.cache
def _optimizer(clip):
    """(cfg, jitted init, jitted update), compiled once per clip value for speed."""
    cfg = _cfg(clip)
    opt = make_optimizer(cfg, total_steps=10)
    return cfg, jax.jit(opt.init), jax.jit(opt.update)


def test_routing_table():
    routing = describe_routing(_params())
    assert {p: (s, lab) for p, s, lab in routing} == {p: (s, lab) for p, (s, lab, _) in EXPECTED.items()}
    labels = param_labels(_params())
    # Spot checks of the cases that ndim alone would get wrong.
    assert labels["layers"]["self_attn"]["conv_qk_grouped"]["kernel"] == "adamw"  # 4-D
    assert labels["layers"]["self_attn"]["conv_qk_depthwise"]["kernel"] == "adamw"  # 3-D
    assert labels["layers"]["input_layernorm"]["scale"] == "adamw"  # [L, d]
    assert labels["layers"]["mlp"]["experts"]["gate_up_proj"] == "muon"  # 4-D
    assert labels["layers"]["mlp"]["gate"]["router_mlp"]["out_proj"]["kernel"] == "adamw"


def test_weight_decay_mask():
    mask = weight_decay_mask(_params())
    flat = {"/".join(str(k.key) for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert flat == {p: wd for p, (_, _, wd) in EXPECTED.items()}


def test_linen_params_prefix_and_untied_head():
    params = {
        "params": {
            "lm_head": {"kernel": jnp.zeros((D, V))},
            "layers": {"self_attn": {"o_proj": {"kernel": jnp.zeros((L, D, D))}}},
        }
    }
    assert describe_routing(params) == [
        ("layers/self_attn/o_proj/kernel", (L, D, D), "muon"),
        ("lm_head/kernel", (D, V), "adamw"),
    ]


def test_unknown_matrix_raises_but_unknown_vector_is_adamw():
    params = _params()
    params["layers"]["mlp"]["new_proj"] = {"kernel": jnp.zeros((L, D, D))}
    with pytest.raises(ValueError, match="layers/mlp/new_proj/kernel"):
        param_labels(params)
    with pytest.raises(ValueError, match="layers/mlp/new_proj/kernel"):
        make_optimizer(_cfg(), total_steps=10).init(params)
    assert param_labels({"mystery": jnp.zeros((D,))}) == {"mystery": "adamw"}


def test_make_optimizer_step_under_jit():
    params = _params()
    grads = _params(seed=100, fn=lambda g: 0.01 + 1e-3 * g)
    _, init, update = _optimizer(1.0)
    state = init(params)
    for _ in range(2):
        updates, state = update(grads, state, params)
        params = jax.jit(optax.apply_updates)(params, updates)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        assert u.shape == p.shape and u.dtype == p.dtype
        u = np.asarray(u)
        assert np.all(np.isfinite(u)) and np.max(np.abs(u)) > 0


def test_adamw_moments_are_fp32_for_bf16_params():
    """AdamW on bf16 parameters starts and ends each update with the same state dtypes (the train
    step's skip guard is a lax.cond over the old and new state), both moments fp32; on fp32
    parameters it is optax's adamw bit for bit."""
    cfg = _cfg()
    schedule = lr_schedule(cfg, 10)
    params = _params()
    grads = _params(seed=100, fn=lambda g: 0.01 + 1e-3 * g)
    opt = adamw(cfg, schedule)
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    state = opt.init(bf16)
    _, new = jax.jit(opt.update)(grads, state, bf16)
    dtypes = lambda tree: [x.dtype for x in jax.tree.leaves(tree)]
    assert dtypes(new) == dtypes(state)
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu")) if hasattr(s, "nu")]
    assert len(adam) == 1 and {x.dtype for x in jax.tree.leaves((adam[0].mu, adam[0].nu))} == {jnp.dtype("float32")}
    ac = cfg.adamw
    scaled = lambda step: schedule(step) * ac.lr_multiplier
    ref = optax.adamw(scaled, b1=ac.b1, b2=ac.b2, eps=ac.eps, weight_decay=ac.weight_decay, mask=weight_decay_mask)
    ours, theirs = opt.init(params), ref.init(params)
    for _ in range(2):
        u_ours, ours = opt.update(grads, ours, params)
        u_theirs, theirs = ref.update(grads, theirs, params)
        for a, b in zip(jax.tree.leaves((u_ours, ours)), jax.tree.leaves((u_theirs, theirs)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_zero_grads_only_decay_matrices():
    # With zero grads, both Adam and Muon (NS(0) = 0) leave only the decoupled decay
    # term -lr * wd * p, which must be present exactly where the mask says so.
    cfg, init, update = _optimizer(1.0)
    params = _params()
    updates, _ = update(_params(fn=np.zeros_like), init(params), params)
    lr0 = cfg.lr / cfg.warmup_steps
    labels, mask = param_labels(params), weight_decay_mask(params)
    for u, p, lab, m in zip(*(jax.tree.leaves(t) for t in (updates, params, labels, mask))):
        wd = {"adamw": 0.5, "muon": 0.25}[lab] if m else 0.0
        np.testing.assert_allclose(np.asarray(u), -lr0 * wd * np.asarray(p), rtol=1e-5, atol=1e-9)


def _clipped_grad_norm(state, cfg):
    """Recover ||clipped grads|| from first-step momenta (mu = (1 - beta) * g)."""
    total = 0.0
    for path, mu in optax.tree_utils.tree_get_all_with_path(state, "mu"):
        beta = cfg.muon.beta if "muon" in jax.tree_util.keystr(path) else cfg.adamw.b1
        total += sum(float(np.sum((np.asarray(m) / (1 - beta)) ** 2)) for m in jax.tree.leaves(mu))
    return total**0.5


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_global_norm_clipping(clip):
    cfg, init, update = _optimizer(clip)
    params = _params()
    grads = _params(seed=100, fn=lambda g: 1e6 * g)
    raw_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads))))
    updates, state = update(grads, init(params), params)
    seen = _clipped_grad_norm(state, cfg)
    if clip:  # one global norm across BOTH optimizers' params
        assert seen == pytest.approx(clip, rel=1e-4)
    else:
        assert seen == pytest.approx(raw_norm, rel=1e-4)
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))
    # Bounded updates however large the grads: Adam's first step is lr * sign(g),
    # Muon's entries are <= lr * 0.2 * sqrt(max(in, out)) * sigma_max(NS) < lr here;
    # plus decoupled decay lr * wd * |p| (wd <= 0.5).
    lr0 = cfg.lr / cfg.warmup_steps
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
        assert np.max(np.abs(np.asarray(u))) <= lr0 * (1.0 + 0.5 * np.max(np.abs(np.asarray(p)))) + 1e-7


def test_experts_orthogonalised_independently():
    params = _params()
    grads = _params(seed=50, fn=lambda g: g + 0.5)
    _, init, update = _optimizer(1.0)
    state = init(params)
    base, _ = update(grads, state, params)

    changed = jax.tree.map(lambda x: x, grads)
    experts = changed["layers"]["mlp"]["experts"]
    for name in ("gate_up_proj", "down_proj"):
        x = np.array(experts[name])
        x[:, 1] = 100.0 * np.random.default_rng(7).standard_normal(x[:, 1].shape)
        experts[name] = jnp.asarray(x)
    new, _ = update(changed, state, params)

    for name in ("gate_up_proj", "down_proj"):
        b, n = base["layers"]["mlp"]["experts"][name], new["layers"]["mlp"]["experts"][name]
        for e in (0, 2):
            np.testing.assert_allclose(n[:, e], b[:, e], rtol=1e-4, atol=1e-7)
        assert np.max(np.abs(np.asarray(n[:, 1]) - np.asarray(b[:, 1]))) > 1e-4


def test_newton_schulz_follows_the_platform():
    """make_optimizer(platform=...) runs Muon's Newton-Schulz for the devices the update is compiled
    for: slice by slice on CPU (a loop, kernels.NS_PER_SLICE: faster there), one batched chain for a
    GPU (no loop); the same updates either way."""
    params, grads = _params(), _params(seed=50, fn=lambda g: g + 0.5)
    out = {}
    for platform in ("cpu", "cuda"):
        opt = make_optimizer(_cfg(1.0), total_steps=10, platform=platform)
        state = opt.init(params)
        update = jax.jit(opt.update).lower(grads, state, params).compile()
        out[platform] = (update(grads, state, params)[0], "while" in update.as_text())
    assert out["cpu"][1] and not out["cuda"][1]
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    jax.tree.map(close, out["cpu"][0], out["cuda"][0])


def test_config_variants():
    cfg = _cfg(0.0)
    cfg.schedule = "wsd"
    cfg.decay_steps = 4  # overrides decay_fraction
    lr = [float(lr_schedule(ml_collections.ConfigDict({"optim": cfg}), 10)(i)) for i in range(10)]
    np.testing.assert_allclose(lr[:6], [5e-3] + [1e-2] * 5, rtol=1e-6)
    assert lr[6] < 1e-2 and lr[-1] == pytest.approx(0.0, abs=1e-9)

    cfg.schedule = "cosine"
    cfg.muon.consistent_rms = None
    cfg.muon.ns_dtype = "bfloat16"
    cfg.muon.mu_dtype = "bfloat16"
    state = make_optimizer(cfg, total_steps=10).init(
        {"layers": {"self_attn": {"o_proj": {"kernel": jnp.zeros((L, D, D))}}}}
    )
    mus = [mu for _, mu in optax.tree_utils.tree_get_all_with_path(state, "mu")]
    assert any(leaf.dtype == jnp.bfloat16 for mu in mus for leaf in jax.tree.leaves(mu))

    cfg.schedule = "linear"
    with pytest.raises(ValueError, match="unknown schedule"):
        make_optimizer(cfg, total_steps=10)
    cfg.schedule = "wsd"
    cfg.clip_grad_norm = -1.0
    with pytest.raises(ValueError, match="clip_grad_norm"):
        make_optimizer(cfg, total_steps=10)
