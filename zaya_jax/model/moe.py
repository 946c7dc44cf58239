"""SwiGLU experts stored stacked [E, ...] and the top-1 token dispatch.

Params: gate_up_proj [E, d, 2I] (gate columns first, HF's [E, 2I, d] transposed), down_proj [E, I, d].
  Expert_e(x) = (silu(x G_e) * (x U_e)) D_e

`ragged_dot` sorts the M tokens (rows m) by chosen expert and runs one grouped matmul over the contiguous
groups: each token is multiplied by its own expert only. Tokens routed to the skip class sort last,
fall outside every group and cost nothing (ragged_dot leaves rows past sum(group_sizes) zero).
XLA:CPU, though, expands ragged_dot into masked dense matmuls (every expert on every token), so
`tiled` cuts each expert's sorted tokens into row tiles and runs each tile through its own
expert's SwiGLU only, both projections in one loop (zaya_jax/kernels/tiled_grouped_matmul.py):
sparse on every backend. `auto` (default) is `tiled` on CPU, `pallas` (the Triton grouped matmul)
on GPUs, where XLA:GPU expands ragged_dot densely too (docs/conventions.md, "Experts on a GPU"), and
ragged_dot on TPU, where it is a native grouped GEMM; the platform is that of the devices the step
is compiled for (the mesh's). `dense` runs every expert on every token and selects;
it exists as the test reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zaya_jax.kernels import kernel_options, swiglu_grouped_pallas
from zaya_jax.kernels.tiled_grouped_matmul import tiled_swiglu
from zaya_jax.model.config import ZayaConfig
from zaya_jax.parallel.expert import expert_parallel_moe
from zaya_jax.parallel.mesh import mesh_platform

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def group_by_expert(expert_m: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """expert_m [M] in [0, E] -> (order [M], group_sizes [E] int32).

    `order` lists token indices sorted by expert (stable, skip class E last); group_sizes counts the
    tokens of each routed expert, so sum(group_sizes) <= M.
    """
    order = jnp.argsort(expert_m, stable=True)
    group_sizes = jnp.bincount(expert_m, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return order, group_sizes


def swiglu_grouped(
    x_sorted_md: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    group_sizes_e: jax.Array,
    act: Callable,
) -> jax.Array:
    """Grouped SwiGLU on expert-sorted tokens [M, d] -> [M, d] (rows past sum(group_sizes) are 0)."""
    h = jax.lax.ragged_dot(x_sorted_md, gate_up_edf, group_sizes_e, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    a = (act(gate) * up).astype(x_sorted_md.dtype)
    return jax.lax.ragged_dot(a, down_efd, group_sizes_e, preferred_element_type=jnp.float32)


def sparse_moe(
    x_md: jax.Array,
    expert_m: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    act: Callable,
    swiglu: Callable = swiglu_grouped,
) -> jax.Array:
    """Top-1 sparse dispatch: y[t] = Expert_{expert[t]}(x[t]), 0 for the skip class. fp32 [M, d].

    `swiglu` is the grouped SwiGLU on expert-sorted tokens: ragged_dot (default) or the Pallas kernel.
    """
    order, group_sizes = group_by_expert(expert_m, gate_up_edf.shape[0])
    # A sort, not `zeros.at[order].set(arange)`: under train.lean_cpu_compile XLA:CPU runs every
    # scatter as a loop over its rows (2,048 iterations a layer on tiny).
    inverse = jnp.argsort(order)
    y_sorted = swiglu(permute_rows(x_md, order, inverse), gate_up_edf, down_efd, group_sizes, act)
    return permute_rows(y_sorted, inverse, order)


@jax.custom_vjp
def permute_rows(x_md: jax.Array, perm_m: jax.Array, inverse_m: jax.Array) -> jax.Array:
    """x[perm] for a permutation `perm` of the M rows whose inverse is `inverse`. The gradient is
    the cotangent gathered by `inverse`: the same values as autodiff's scatter-add (each row receives
    exactly one), without the scatter (a loop over rows on XLA:CPU's lean compile)."""
    return x_md[perm_m]


def _permute_rows_fwd(x_md, perm_m, inverse_m):
    return x_md[perm_m], inverse_m


def _permute_rows_bwd(inverse_m, ct_md):
    return ct_md[inverse_m], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def tiled_moe(
    x_md: jax.Array,
    expert_m: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    act: Callable,
    tile: int | None = None,
) -> jax.Array:
    """`sparse_moe` on the fused tiled SwiGLU (both projections in one loop over row tiles, each
    tile with its own expert's weights only; sparse on every backend): y[t] =
    Expert_{expert[t]}(x[t]), 0 for the skip class. fp32 [M, d]."""
    swiglu = functools.partial(tiled_swiglu, tile=tile)
    return sparse_moe(x_md, expert_m, gate_up_edf, down_efd, act, swiglu=swiglu)


def dense_moe(
    x_md: jax.Array, expert_m: jax.Array, gate_up_edf: jax.Array, down_efd: jax.Array, act: Callable
) -> jax.Array:
    """Reference: every expert on every token, then select. fp32 [M, d]. O(E) times the work."""
    h = jnp.einsum("md,edf->emf", x_md, gate_up_edf, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    a = (act(gate) * up).astype(x_md.dtype)
    y_emd = jnp.einsum("emf,efd->emd", a, down_efd, preferred_element_type=jnp.float32)
    onehot_me = jax.nn.one_hot(expert_m, gate_up_edf.shape[0], dtype=jnp.float32)  # skip row is all 0
    return jnp.einsum("me,emd->md", onehot_me, y_emd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_as(y: jax.Array, dtype) -> jax.Array:
    """Identity on the experts' fp32 output whose backward rounds the cotangent to `dtype` (the
    compute dtype): how every dispatch consumes it. The tiled and Pallas kernels cast it to their
    operand dtype first thing (a bf16 x fp32 backward dot runs in bf16), so there it changes no
    value; `ragged_dot` and `dense` would run that dot in fp32. One rule for every dispatch keeps
    the expert exchange (which sends this cotangent in `dtype`, zaya_jax/parallel/expert.py) equal
    to one device whatever `moe_impl`."""
    return y


def _cotangent_as_fwd(y, dtype):
    return y, None


def _cotangent_as_bwd(dtype, _, ct):
    return (ct.astype(dtype).astype(ct.dtype),)


cotangent_as.defvjp(_cotangent_as_fwd, _cotangent_as_bwd)


def resolve_moe_impl(moe_impl: str, platform: str) -> str:
    """`auto` for devices of `platform` (zaya_jax.parallel.mesh.device_platform): "tiled" on CPU,
    "pallas" on GPUs (XLA:CPU and XLA:GPU both expand ragged_dot into every expert on every
    token), "ragged_dot" on TPU (a native grouped GEMM there); any other value is returned as is."""
    if moe_impl != "auto":
        return moe_impl
    return {"cpu": "tiled", "cuda": "pallas", "rocm": "pallas"}.get(platform, "ragged_dot")


def local_dispatch(moe_impl: str, platform: str) -> Callable:
    """The single-device MoE function for a config's `moe_impl` on devices of `platform`."""
    impl = resolve_moe_impl(moe_impl, platform)
    if impl == "dense":
        return dense_moe
    if impl == "tiled":
        return tiled_moe
    if impl == "pallas":
        swiglu = functools.partial(swiglu_grouped_pallas, **kernel_options(platform))
        return functools.partial(sparse_moe, swiglu=swiglu)
    return sparse_moe


class ZayaExperts(nn.Module):
    """x [M, d] (compute dtype), expert [M], weight [M] -> (weight * Expert(x) fp32 [M, d], dropped,
    spilled).

    Without a mesh the dispatch runs on the global token array; with one, inside shard_map on each
    device's tokens, exchanging them over the "expert" axis when it is > 1 (zaya_jax/parallel/expert.py).
    `dropped` counts tokens that lost their expert to a capacity limit (always 0 when dropless);
    `spilled` int32 [devices] (1 without a mesh) is 1 on the devices whose expert group ran the
    exchange's spill round.
    """

    cfg: ZayaConfig
    mesh: Mesh | None = None

    @nn.compact
    def __call__(
        self, x_md: jax.Array, expert_m: jax.Array, weight_m: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = nn.initializers.normal(cfg.initializer_range)
        gate_up = self.param("gate_up_proj", init, (e, d, 2 * i), cfg.params_dtype)
        down = self.param("down_proj", init, (e, i, d), cfg.params_dtype)
        dispatch = local_dispatch(cfg.moe_impl, mesh_platform(self.mesh))
        moe = lambda x, *rest: cotangent_as(dispatch(x, *rest), x.dtype)
        dt, act = cfg.compute_dtype, ACTIVATIONS[cfg.hidden_act]
        args = (x_md.astype(dt), expert_m, gate_up.astype(dt), down.astype(dt), act)
        if self.mesh is None:
            y, dropped, spilled = moe(*args), jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.int32)
        else:
            y, dropped, spilled = expert_parallel_moe(
                *args,
                local_moe=moe,
                mesh=self.mesh,
                capacity_factor=cfg.moe_capacity_factor,
                exchange_factor=cfg.moe_exchange_capacity_factor,
            )
        return y * weight_m[:, None].astype(jnp.float32), dropped, spilled
