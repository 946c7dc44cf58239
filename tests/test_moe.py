"""Sparse expert dispatch (zaya_jax/model/moe.py) against the dense reference: values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.kernels import swiglu_grouped_pallas
from zaya_jax.model.moe import (
    ACTIVATIONS,
    cotangent_as,
    dense_moe,
    group_by_expert,
    local_dispatch,
    resolve_moe_impl,
    sparse_moe,
    tiled_moe,
)

SPARSE = {"ragged_dot": sparse_moe, "tiled": tiled_moe}


def _problem(seed, t=37, d=16, i=12, e=5, skip_frac=0.2):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(t, d)), jnp.float32)
    expert = r.integers(0, e, size=t)
    expert[r.random(t) < skip_frac] = e  # skip class
    gate_up = jnp.asarray(r.normal(size=(e, d, 2 * i)) * 0.3, jnp.float32)
    down = jnp.asarray(r.normal(size=(e, i, d)) * 0.3, jnp.float32)
    return x, jnp.asarray(expert, jnp.int32), gate_up, down


def test_group_by_expert_sorts_and_counts():
    expert = jnp.array([2, 0, 3, 2, 1, 0], jnp.int32)  # 3 = skip for E = 3
    order, sizes = group_by_expert(expert, 3)
    np.testing.assert_array_equal(sizes, [2, 1, 2])
    np.testing.assert_array_equal(np.asarray(expert)[np.asarray(order)], [0, 0, 1, 2, 2, 3])


@pytest.mark.parametrize("impl", list(SPARSE))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_equals_dense_values_and_grads(seed, impl):
    sparse_moe = SPARSE[impl]
    x, expert, gate_up, down = _problem(seed)
    act = ACTIVATIONS["silu"]
    ys, yd = sparse_moe(x, expert, gate_up, down, act), dense_moe(x, expert, gate_up, down, act)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(yd), atol=1e-5, rtol=1e-5)
    skipped = np.asarray(expert) == gate_up.shape[0]
    assert skipped.any() and (np.asarray(ys)[skipped] == 0).all()

    cot = jax.random.normal(jax.random.key(seed), ys.shape)
    loss = lambda f: lambda x, g, d: jnp.sum(f(x, expert, g, d, act) * cot)
    gs = jax.grad(loss(sparse_moe), argnums=(0, 1, 2))(x, gate_up, down)
    gd = jax.grad(loss(dense_moe), argnums=(0, 1, 2))(x, gate_up, down)
    for a, b in zip(gs, gd):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", list(SPARSE))
def test_empty_experts_and_all_skip(impl):
    sparse_moe = SPARSE[impl]
    x, _, gate_up, down = _problem(3, t=8)
    act = ACTIVATIONS["silu"]
    all_one = jnp.full((8,), 1, jnp.int32)  # experts 0, 2, 3, 4 empty
    np.testing.assert_allclose(
        sparse_moe(x, all_one, gate_up, down, act), dense_moe(x, all_one, gate_up, down, act), atol=1e-5
    )
    all_skip = jnp.full((8,), 5, jnp.int32)
    assert (np.asarray(sparse_moe(x, all_skip, gate_up, down, act)) == 0).all()


def test_sparse_dispatch_is_sparse():
    """Tokens meet only their own expert: one grouped (ragged) matmul per projection, and the
    activation runs once per token, not once per (token, expert) as in the dense reference.

    (XLA:CPU expands ragged_dot into masked dense matmuls; on GPU/TPU it lowers to a native grouped
    GEMM. The primitive and the per-token activation count are what the dispatch itself guarantees.)
    """
    x, expert, gate_up, down = _problem(0, t=256, e=8)
    act = ACTIVATIONS["silu"]
    lowered = lambda f: jax.jit(f, static_argnums=4).lower(x, expert, gate_up, down, act)
    jaxpr = str(jax.make_jaxpr(sparse_moe, static_argnums=4)(x, expert, gate_up, down, act))
    assert jaxpr.count("ragged_dot_general") == 2
    cost = lambda f: lowered(f).compile().cost_analysis()
    cost = {
        f.__name__: (c[0] if isinstance(c, list) else c) for f in (sparse_moe, dense_moe) for c in [cost(f)]
    }
    t, i = x.shape[0], down.shape[1]
    assert cost["sparse_moe"]["transcendentals"] <= t * i
    assert cost["dense_moe"]["transcendentals"] >= 8 * t * i


def test_tiled_one_token_values_and_grads():
    """One token (T=1): the tile is mostly padding; value and gradients still match dense."""
    x, _, gate_up, down = _problem(4, t=1)
    act, expert = ACTIVATIONS["silu"], jnp.array([3], jnp.int32)
    loss = lambda f: lambda x, g, d: jnp.sum(f(x, expert, g, d, act) ** 2)
    got = jax.value_and_grad(loss(tiled_moe), argnums=(0, 1, 2))(x, gate_up, down)
    want = jax.value_and_grad(loss(dense_moe), argnums=(0, 1, 2))(x, gate_up, down)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_auto_follows_the_platform_compiled_for():
    """tiled on CPU, the Pallas grouped matmul on GPUs (XLA:GPU's ragged_dot is dense: tests/
    test_gpu_compile.py), ragged_dot on TPU; the platform is an argument, never the process'."""
    assert resolve_moe_impl("auto", "cpu") == "tiled"
    assert resolve_moe_impl("auto", "cuda") == resolve_moe_impl("auto", "rocm") == "pallas"
    assert resolve_moe_impl("auto", "tpu") == "ragged_dot"
    assert resolve_moe_impl("pallas", "cpu") == "pallas" and resolve_moe_impl("dense", "cuda") == "dense"
    assert resolve_moe_impl("ragged_dot", "rocm") == "ragged_dot"
    assert local_dispatch("auto", "cpu") is tiled_moe
    gpu = local_dispatch("auto", "rocm")  # Triton, not interpreted, with ROCm's warps
    assert gpu.func is sparse_moe
    assert gpu.keywords["swiglu"].keywords == {"interpret": False, "platform": "rocm"}
    assert local_dispatch("pallas", "cpu").keywords["swiglu"].keywords["interpret"] is True


def test_tiled_dispatch_is_sparse():
    """The activation runs once per token, not once per (token, expert); the grouped matmuls'
    own sparsity is tests/test_kernels_tiled_gmm.py's."""
    x, expert, gate_up, down = _problem(0, t=256, e=8)
    act = ACTIVATIONS["silu"]
    cost = jax.jit(tiled_moe, static_argnums=4).lower(x, expert, gate_up, down, act).compile().cost_analysis()
    t, i = x.shape[0], down.shape[1]
    assert (cost[0] if isinstance(cost, list) else cost)["transcendentals"] <= t * i


@pytest.mark.parametrize("impl", ["tiled", "pallas"])
def test_bf16_cotangent_rounding_changes_no_gradient_of_the_kernels(impl):
    """`cotangent_as` (the output cotangent taken in the compute dtype, which lets the expert
    exchange send it in bf16) changes no bit of the gradients of the tiled and Pallas (interpret)
    dispatches in bf16: both cast it to bf16 first thing. ragged_dot and dense would not (their
    backward dot runs in fp32), hence one rule for every dispatch (ZayaExperts)."""
    x, expert, gate_up, down = (a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _problem(3))
    w = jax.random.normal(jax.random.key(0), (x.shape[0], x.shape[1]))
    if impl == "tiled":
        moe = tiled_moe
    else:
        moe = functools.partial(sparse_moe, swiglu=functools.partial(swiglu_grouped_pallas, interpret=True))
    act = ACTIVATIONS["silu"]
    plain = lambda x, g, d: jnp.mean(moe(x, expert, g, d, act) * w)
    rounded = lambda x, g, d: jnp.mean(cotangent_as(moe(x, expert, g, d, act), x.dtype) * w)
    got = jax.jit(jax.grad(rounded, (0, 1, 2)))(x, gate_up, down)
    want = jax.jit(jax.grad(plain, (0, 1, 2)))(x, gate_up, down)
    for a, b, name in zip(got, want, ("x", "gate_up", "down")):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    # The rounding is real: the dense reference's gradient (an fp32 backward dot) changes.
    dense = lambda wrap: lambda g: jnp.mean(wrap(dense_moe(x, expert, g, down, act)) * w)
    assert not np.array_equal(
        jax.grad(dense(lambda y: cotangent_as(y, jnp.bfloat16)))(gate_up),
        jax.grad(dense(lambda y: y))(gate_up),
    )
