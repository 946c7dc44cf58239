"""ZeRO-1's data-axis collectives inside the model's layer scan, where compute can hide them: each
block's weights all-gathered in the first microbatch's forward (`BlockGather`) and each block's
gradients reduce-scattered in the last microbatch's backward (`BlockReduce`); both in the one
microbatch of a step without accumulation (`BlockGatherReduce`).

Both are block hooks (`ZayaForCausalLM.block_hook`). The design: docs/design/zero1.md, "Overlap with
compute".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from zaya_jax.parallel.context import CONTEXT
from zaya_jax.parallel.mesh import mesh_platform
from zaya_jax.parallel.zero1 import (
    DATA,
    REPLICA,
    _reduce_one,
    in_blocks,
    loop_per_rank,
    reduce_per_rank,
)

# train.overlap_grad_reduce: each block's gradients reduce-scattered in the last microbatch's
# backward as the layer scan produces them ("on", hidden behind the blocks still to run), or every
# gradient after the loop ("off"). train.overlap_param_gather: each block's compute weights
# all-gathered in the first microbatch's forward ("on", hidden behind the blocks before it), or all
# of them before the loop ("off"). "auto": on for GPU meshes (`overlaps_grad_reduce`;
# `overlaps_param_gather`: those whose weights only data splits); off on CPU (its collectives are
# synchronous: nothing to hide, and the hooked microbatch compiles as a second copy of the model).
OVERLAP_SETTINGS = ("auto", "on", "off")
OVERLAP_GRAD_REDUCE = OVERLAP_SETTINGS
OVERLAP_PARAM_GATHER = OVERLAP_SETTINGS
# The variable collections `BlockReduce` reads beside each block's params: zeros in the shape of the
# block's gradient shards (their gradient is the reduced gradient) and the rank's sum of the earlier
# microbatches' gradients. A leaf reduced after the loop has (0,)-shaped entries in both.
GRAD_SINK = "grad_sink"
GRAD_ACC = "grad_acc"
# `BlockGather`'s: zeros in the shape of the gathered weight (their gradient is the first
# microbatch's) in, and the gathered weights out. A leaf gathered before the loop: (0,)-shaped.
GATHER_SINK = "gather_sink"
GATHERED = "gathered"
# The name scopes of those collectives: they sit in the model but run once per step
# (zaya_jax/analysis/report.py counts them with the step's, not the model's, collectives).
BLOCK_REDUCE_SCOPE = "zero1_block_reduce"
BLOCK_GATHER_SCOPE = "zero1_block_gather"


def _auto(mesh: Mesh) -> bool:
    """Where "auto" turns an overlap on: GPU meshes (docs/design/zero1.md)."""
    return mesh_platform(mesh) != "cpu"


def _whole_weights(mesh: Mesh) -> bool:
    """Whether no mesh axis but data splits the weights: fsdp and expert are 1 (the context axis
    splits sequences only)."""
    return all(size == 1 for axis, size in mesh.shape.items() if axis not in (DATA, CONTEXT))


def _setting(name: str, setting: str) -> None:
    if setting not in OVERLAP_SETTINGS:
        raise ValueError(f"config.train.{name}: must be one of {OVERLAP_SETTINGS}, got {setting!r}")


def overlaps_grad_reduce(setting: str, grad_reduce: str, mesh: Mesh | None) -> bool:
    """Whether the step reduce-scatters each block's gradients in the last microbatch's backward
    (train.overlap_grad_reduce `setting`; `BlockReduce`): where the loop runs per rank and reduces
    once per step (grad_reduce "step"), "on", or "auto" on a mesh of GPUs."""
    _setting("overlap_grad_reduce", setting)
    if mesh is None or grad_reduce != "step" or not loop_per_rank(mesh):
        return False
    return setting == "on" or (setting == "auto" and _auto(mesh))


def overlaps_param_gather(setting: str, mesh: Mesh | None, master: bool) -> bool:
    """Whether the step all-gathers each block's compute weights in the first microbatch's forward
    (train.overlap_param_gather `setting`; `BlockGather`, or `BlockGatherReduce` when that
    microbatch is the only one): where the loop runs per rank and the fp32 master sits in the
    ZeRO-1 shard (`master`: zero1.shards_master, so the step gathers compute weights at all), "on",
    or "auto" on a mesh of GPUs whose weights only the data axis splits (no fsdp, no expert). With
    fsdp, a block's leaves split over it are gathered before the loop (zero1.gathered_in_forward),
    and on MI300X the step hid less of its ZeRO-1 bytes with the rest gathered in the forward than
    without (docs/design/zero1.md)."""
    _setting("overlap_param_gather", setting)
    if mesh is None or not master or not loop_per_rank(mesh):
        return False
    return setting == "on" or (setting == "auto" and _auto(mesh) and _whole_weights(mesh))


# ------------------------------------------------------------------------------- gradients' reduce
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _reduced_in_backward(w: jax.Array, sink: jax.Array, acc: jax.Array, dim: int, dtype: Any) -> jax.Array:
    """w, unchanged. Backward: the cotangent of w plus `acc` (the rank's earlier microbatches; a
    size-0 `acc`: none), reduce-scattered over REPLICA along `dim` in `dtype`, is the cotangent of
    `sink` (its shard shape); w's own is zero."""
    return w


def _reduced_fwd(w, sink, acc, dim, dtype):
    return w, acc


def _reduced_bwd(dim, dtype, acc, g):
    with jax.named_scope(BLOCK_REDUCE_SCOPE):
        total = g.astype(acc.dtype) if acc.size == 0 else acc + g.astype(acc.dtype)
        out = _reduce_one(total, dim, dtype)  # the order of reduce_per_rank's sum
    return jnp.zeros_like(g), out, jnp.zeros_like(acc)


_reduced_in_backward.defvjp(_reduced_fwd, _reduced_bwd)


@dataclasses.dataclass(frozen=True)
class BlockReduce:
    """The model's block hook for the last microbatch: each block's params pass through
    `_reduced_in_backward` with its GRAD_SINK and GRAD_ACC entries, so the backward of the layer
    scan reduce-scatters a block's gradients as soon as it has made them and XLA can overlap the
    collective with the blocks still to run. `dtype`: train.grad_reduce_dtype."""

    dtype: Any = jnp.float32
    collections: tuple[str, ...] = (GRAD_SINK, GRAD_ACC)
    outputs: tuple[str, ...] = ()

    def __call__(self, variables: dict[str, Any]) -> dict[str, Any]:
        def one(w, sink, acc):
            if sink.size == 0:  # reduced after the loop
                return w
            dim = next(d for d in range(w.ndim) if sink.shape[d] != w.shape[d])
            return _reduced_in_backward(w, sink, acc, dim, self.dtype)

        params = jax.tree.map(one, variables["params"], variables[GRAD_SINK], variables[GRAD_ACC])
        return {**variables, "params": params}


def block_sinks(layers: Any, acc: Any, dims: Any) -> tuple[Any, Any]:
    """(GRAD_SINK, GRAD_ACC) trees for the stacked block params `layers` [l, ...] (per rank), `acc`
    their summed gradients (None: no earlier microbatch) and `dims` the dimension ZeRO-1 splits
    each over the data axis (None: whole). A leaf `in_blocks` is reduced in the backward
    (`BlockReduce`): its sink is zeros of its shard's shape. The others get (l, 0) entries and are
    reduced after the loop; so do all GRAD_ACC entries without an earlier microbatch (nothing to
    add, and no zeros stacked for the scan to read)."""
    n = jax.lax.axis_size(REPLICA)

    def sink(w, d):
        if not in_blocks(d):
            return jnp.zeros((w.shape[0], 0), jnp.float32)
        return jnp.zeros((*w.shape[:d], w.shape[d] // n, *w.shape[d + 1 :]), jnp.float32)

    empty = lambda a: jnp.zeros((a.shape[0], 0), jnp.promote_types(a.dtype, jnp.float32))
    leaf = lambda x: x is None
    if acc is None:
        return jax.tree.map(sink, layers, dims, is_leaf=leaf), jax.tree.map(empty, layers)
    kept = lambda a, d: a if in_blocks(d) else empty(a)
    return jax.tree.map(sink, layers, dims, is_leaf=leaf), jax.tree.map(kept, acc, dims, is_leaf=leaf)


def reduced_after_blocks(grads: Any, sink_grads: Any, dims: Any, dtype: Any = jnp.float32) -> Any:
    """The step's reduced gradients from the last microbatch's: `sink_grads` (the GRAD_SINK
    gradients: the block params `BlockReduce` reduced in the backward) where `block_sinks` gave a
    shard, and `grads` (the rank's sums) reduced now (`reduce_per_rank`) everywhere else."""
    leaf = lambda x: x is None
    one = lambda g, s, d: s if in_blocks(d) else _reduce_one(g, d, dtype)
    layers = jax.tree.map(one, grads["layers"], sink_grads, dims["layers"], is_leaf=leaf)
    rest = {k: v for k, v in grads.items() if k != "layers"}
    reduced = reduce_per_rank(rest, {k: dims[k] for k in rest}, dtype)
    return {**reduced, "layers": layers}


# --------------------------------------------------------------------------------- weights' gather
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gathered_in_forward(shard: jax.Array, sink: jax.Array, dim: int) -> jax.Array:
    """The weight: `shard` all-gathered over REPLICA along `dim`. Backward: the cotangent of the
    weight is `sink`'s (the weight's shape), the shard's is zero: the first microbatch's gradient,
    summed on the rank like every other microbatch's."""
    return _all_gather(shard, dim)


def _all_gather(shard: jax.Array, dim: int) -> jax.Array:
    with jax.named_scope(BLOCK_GATHER_SCOPE):
        return jax.lax.all_gather(shard, REPLICA, axis=dim, tiled=True)


def _gathered_fwd(shard, sink, dim):
    return _all_gather(shard, dim), jnp.zeros((0,), shard.dtype)


def _gathered_bwd(dim, empty, g):
    n = jax.lax.axis_size(REPLICA)
    shard = jnp.zeros((*g.shape[:dim], g.shape[dim] // n, *g.shape[dim + 1 :]), empty.dtype)
    return shard, g


_gathered_in_forward.defvjp(_gathered_fwd, _gathered_bwd)


@dataclasses.dataclass(frozen=True)
class BlockGather:
    """The model's block hook for the first microbatch: the block params `zero1.gathered_in_forward`
    come in as this rank's shards and pass through `_gathered_in_forward` with their GATHER_SINK entries, so the
    layer scan gathers a block's weights just before the block runs and XLA can overlap the
    collective with the blocks before it. The gathered weights go out in GATHERED (stacked by the
    scan) for the microbatches after the first; a leaf gathered before the loop has a (0,) entry."""

    collections: tuple[str, ...] = (GATHER_SINK,)
    outputs: tuple[str, ...] = (GATHERED,)

    def __call__(self, variables: dict[str, Any]) -> dict[str, Any]:
        def one(w, sink):
            if sink.size == 0:  # gathered before the loop
                return w
            dim = next(d for d in range(w.ndim) if sink.shape[d] != w.shape[d])
            return _gathered_in_forward(w, sink, dim)

        params = jax.tree.map(one, variables["params"], variables[GATHER_SINK])
        out = jax.tree.map(lambda w, s: w if s.size else s, params, variables[GATHER_SINK])
        return {**variables, "params": params, GATHERED: out}


@dataclasses.dataclass(frozen=True)
class BlockGatherReduce:
    """The block hook of a step with one microbatch: `BlockGather`, then `BlockReduce` on the
    gathered weights. A block's weights are gathered just before its forward and its gradients
    reduce-scattered as soon as its backward has made them; nothing is written out (no microbatch
    follows). `dtype`: train.grad_reduce_dtype."""

    dtype: Any = jnp.float32
    # GRAD_SINK first: the hooked loss is differentiated with respect to the first collection.
    collections: tuple[str, ...] = (GRAD_SINK, GATHER_SINK, GRAD_ACC)
    outputs: tuple[str, ...] = ()

    def __call__(self, variables: dict[str, Any]) -> dict[str, Any]:
        gathered = BlockGather()(variables)["params"]
        return BlockReduce(self.dtype)({**variables, "params": gathered})


def gather_sinks(layers: Any, dims: Any) -> Any:
    """The GATHER_SINK tree for the stacked block params `layers` [l, ...] (those gathered in the
    forward as this rank's shards; `dims`: the dimension of each, None for the others: PerRank's
    gather_dims): zeros of the gathered weight's shape and dtype where the leaf is gathered in the
    forward, (l, 0) entries elsewhere."""
    n = jax.lax.axis_size(REPLICA)

    def sink(w, d):
        if d is None:
            return jnp.zeros((w.shape[0], 0), w.dtype)
        return jnp.zeros((*w.shape[:d], w.shape[d] * n, *w.shape[d + 1 :]), w.dtype)

    return jax.tree.map(sink, layers, dims, is_leaf=lambda x: x is None)


def with_gathered(tree: Any, gathered: Any, dims: Any) -> Any:
    """`tree` (the block params or their gradients) with the leaves gathered in the forward (`dims`
    not None: PerRank's gather_dims) taken from `gathered` (the GATHERED weights, or the GATHER_SINK
    gradients)."""
    return jax.tree.map(lambda x, g, d: x if d is None else g, tree, gathered, dims, is_leaf=lambda x: x is None)
