"""The step's loss and gradients: the microbatch loop, summed per data rank and reduced into the
ZeRO-1 shards (zaya_jax/parallel/zero1.py), with the first microbatch gathering each block's weights
and the last reducing each block's gradients inside the layer scan where the config says so
(zaya_jax/parallel/overlap.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

from zaya_jax.model import BALANCING, ZayaConfig, ZayaForCausalLM
from zaya_jax.model.loss import LOSS_CHUNK_TOKENS, chunk_positions, chunked_cross_entropy
from zaya_jax.parallel import overlap
from zaya_jax.parallel import zero1 as zero1_lib
from zaya_jax.parallel.context import CONTIGUOUS, fold_sequences
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.parallel.sharding import grad_specs

Batch = dict[str, jax.Array]  # input_ids / targets int32 [B, S], loss_mask fp32 [B, S]; positions
# int32 [B, S] where the context layout permutes the sequence (train_state.layout_batch)


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """How the step's gradients and weights cross the data axis: mesh.zero1 (`zero1`: the optimizer
    state laid out by ZeRO-1, the gradients reduce-scattered into it), train.grad_reduce (once per
    step or every microbatch), train.grad_reduce_dtype, train.overlap_grad_reduce and
    train.overlap_param_gather (zaya_jax/parallel/overlap.py). The defaults: ZeRO-1 reduced once
    per step in fp32, nothing moved into the layer scan."""

    zero1: bool = True
    grad_reduce: str = "step"
    grad_reduce_dtype: Any = jnp.float32
    overlap_grad_reduce: str = "off"
    overlap_param_gather: str = "off"

    @classmethod
    def from_config(cls, c: Any) -> DataParallel:
        """The settings of training config `c`."""
        train = c.train
        dtype = jnp.dtype(train.grad_reduce_dtype)
        return cls(c.mesh.zero1, train.grad_reduce, dtype, train.overlap_grad_reduce, train.overlap_param_gather)

    def master(self, cfg: ZayaConfig) -> bool:
        """Whether the train state's params are the fp32 master in the ZeRO-1 shard
        (`zero1.shards_master`)."""
        return zero1_lib.shards_master(cfg.params_dtype, cfg.compute_dtype, self.zero1)

    def overlaps(self, cfg: ZayaConfig, mesh: Mesh | None) -> tuple[bool, bool]:
        """(each block's gradients reduce-scattered in the last microbatch's backward, each block's
        compute weights gathered in the first microbatch's forward) in the step on `mesh`."""
        reduce = self.zero1 and overlap.overlaps_grad_reduce(self.overlap_grad_reduce, self.grad_reduce, mesh)
        gather = overlap.overlaps_param_gather(self.overlap_param_gather, mesh, self.master(cfg))
        return reduce, gather


DEFAULT_DATA_PARALLEL = DataParallel()


class StepAux(NamedTuple):
    """What a forward pass sums besides the loss (over tokens; over microbatches in the step):
    weight (loss weights) fp32 []; counts (tokens per class per block) fp32 [L, E+1]; dropped
    (tokens past an expert-parallel capacity) int32 [L]; entropy (router entropies, nats) fp32 [L];
    spills (1 where a device's expert group took the exchange's spill round) int32 [L, devices].
    Fields are read by name, so adding one changes no caller."""

    weight: jax.Array
    counts: jax.Array
    dropped: jax.Array
    entropy: jax.Array
    spills: jax.Array


def loss_and_counts(
    model: ZayaForCausalLM,
    params: Any,
    balancing: Any,
    batch: Batch,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    extra: dict[str, Any] | None = None,
    outputs: tuple[str, ...] = (),
) -> tuple[jax.Array, Any]:
    """(sum of token losses, StepAux of the batch). `loss_chunk_tokens`: tokens per device in a
    chunk of the cross-entropy; `extra`: more variable collections (those of the model's block
    hook); `outputs`: the collections the hook writes, returned beside the StepAux:
    (sum, (StepAux, {collection: ...})) where there are any."""
    variables = {"params": params, BALANCING: balancing, **(extra or {})}
    args = (variables, batch["input_ids"])
    kwargs = dict(positions=batch.get("positions"), return_logits=False)
    out, written = model.apply(*args, **kwargs, mutable=list(outputs)) if outputs else (model.apply(*args, **kwargs), {})
    # The params the head reads (the loss differentiates them), and the two the model's setup
    # creates eagerly (flax needs them to bind the model; [d] each, their head gradients zero).
    names = ("embed_tokens", "lm_head", "input_hidden_states_scale", "input_hidden_states_bias")
    head_params = {k: params[k] for k in names if k in params}
    head = lambda p, h: model.apply({"params": p}, h, method=ZayaForCausalLM.logits_from_hidden)
    # With a context axis each rank chunks its own positions: the scan never crosses ranks.
    fold = lambda x: fold_sequences(x, model.mesh)
    hidden = fold(out.hidden)
    chunk = chunk_positions(hidden.shape[0] // _row_devices(model.mesh), loss_chunk_tokens)
    total, weight = chunked_cross_entropy(
        hidden, fold(batch["targets"]), fold(batch["loss_mask"]), head, head_params, chunk
    )
    aux = StepAux(weight, out.expert_counts, out.dropped_tokens, out.router_entropy, out.exchange_spills)
    return total, ((aux, written) if outputs else aux)


def _row_devices(mesh: Mesh | None) -> int:
    """The devices the automatic mesh axes split the model's (folded) rows over: 1 without a mesh;
    inside the per-rank loop the data ranks, and the context ranks where that axis is manual, each
    hold their own rows."""
    if mesh is None:
        return 1
    auto = lambda a: mesh.axis_types[mesh.axis_names.index(a)] != AxisType.Manual
    return math.prod(mesh.shape[a] for a in MESH_AXES if a in mesh.shape and auto(a))


def accumulated_grads(
    grad_fn: Callable,
    params: Any,
    balancing: Any,
    micro: Batch,
    reduce: Callable | None = None,
    init: tuple[Any, Any, Any] | None = None,
):
    """Sums over the microbatches (leading axis of `micro`) of grad_fn's loss sum, its StepAux and
    gradients, in one lax.scan; the gradients in fp32 whatever the dtype of `params` (compute
    weights in model.dtype come out with gradients in it, each upcast before it is added). The
    aux's zeros take grad_fn's own shapes (the spill flags have one entry per device the model
    sees, fewer inside the per-rank loop of zaya_jax/parallel/zero1.py).
    `reduce`: applied to each microbatch's gradients before they are added (train.grad_reduce
    "microbatch": the reduce-scatter into this rank's ZeRO-1 shard, so the sum is only that shard).
    `init`: the sums to start from (the earlier microbatches'; default zeros)."""
    each = (lambda grads: reduce(_upcast(grads))) if reduce else _upcast
    # One trace of the model's forward and backward: the zeros' shapes (`_zero_sums`) and the
    # scan's body share it (jit's trace cache); inlined, the step's program is the one without it.
    grad_fn = jax.jit(grad_fn, inline=True)

    def accumulate(carry, mb):
        (loss_sum, aux), grads = grad_fn(params, balancing, mb)
        acc_loss, acc_aux, acc_grads = carry
        return (
            acc_loss + loss_sum,
            jax.tree.map(jnp.add, acc_aux, aux),
            jax.tree.map(jnp.add, acc_grads, each(grads)),
        ), None

    first = jax.tree.map(lambda x: x[0], micro)
    out, _ = jax.lax.scan(accumulate, init or _zero_sums(grad_fn, params, balancing, first, each), micro)
    return out


def _upcast(grads: Any) -> Any:
    """Gradients in the dtype they are summed in (`_accumulated`)."""
    return jax.tree.map(lambda g: g.astype(_accumulated(g.dtype)), grads)


def _accumulated(dtype: Any) -> Any:
    """The dtype gradients of `dtype` are summed in: at least fp32."""
    return jnp.promote_types(dtype, jnp.float32)


def _zero_sums(grad_fn: Any, params: Any, balancing: Any, mb: Batch, each: Callable = _upcast):
    """(0, zero StepAux, zero gradients): the sums before the first microbatch, in the shapes
    grad_fn gives for microbatch `mb` (the gradients as `each` makes them: the rank's shard where
    reduce-scattered). grad_fn is jitted: its trace here is the one the loop's body reuses."""
    zeros_of = lambda shapes: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    (_, aux_shapes), _ = grad_fn.eval_shape(params, balancing, mb)
    return jnp.zeros(()), zeros_of(aux_shapes), zeros_of(jax.eval_shape(each, params))


def grads_reduced_in_backward(
    grad_fn: Callable,
    last_fn: Callable,
    params: Any,
    balancing: Any,
    micro: Batch,
    plan: zero1_lib.PerRank,
    init: tuple[Any, Any, Any] | None = None,
):
    """`accumulated_grads` with the gradients reduced, each block's in the last microbatch's
    backward (overlap.BlockReduce): microbatches 1..A-1 summed by `accumulated_grads` (from
    `init`), then the last by `last_fn`(params, sinks, balancing, mb, accs) (its model has the block
    hook), whose sink gradients are the blocks' reduced ones; the other leaves are reduced after it.
    The sums are taken in the order of `accumulated_grads`; the last microbatch is compiled on its
    own, so they agree to rounding."""
    count = jax.tree.leaves(micro)[0].shape[0]
    last = jax.tree.map(lambda x: x[count - 1], micro)
    if count > 1:
        loss_sum, aux, acc = accumulated_grads(grad_fn, params, balancing, jax.tree.map(lambda x: x[:-1], micro), init=init)
    else:
        loss_sum, aux, acc = init or (None, None, None)  # None: the last microbatch is the only one
    earlier = acc["layers"] if acc is not None else None  # None: the blocks add nothing
    sinks, accs = overlap.block_sinks(params["layers"], earlier, plan.dims["layers"])
    (last_sum, last_aux), (grads, sink_grads) = last_fn(params, sinks, balancing, last, accs)
    grads = _upcast(grads) if acc is None else jax.tree.map(jnp.add, acc, _upcast(grads))
    reduced = overlap.reduced_after_blocks(grads, sink_grads, plan.dims, plan.dtype)
    if acc is None:
        return last_sum, last_aux, reduced
    return loss_sum + last_sum, jax.tree.map(jnp.add, aux, last_aux), reduced


def grads_gathered_in_forward(first_fn: Callable, rest: Callable, params: Any, balancing: Any, micro: Batch, plan):
    """`rest`(params, balancing, micro, init) (the loop over the other microbatches) after the first
    microbatch, run by `first_fn`(params, sinks, balancing, mb) (its model has overlap.BlockGather):
    the block params of `plan.gather_dims` come as this rank's shards, gathered block by block in the first
    microbatch's forward. The weights it gathered (GATHERED) are the ones the other microbatches
    compute with, and its gradients of them are its sink gradients (GATHER_SINK). With one
    microbatch, its sums are the step's."""
    dims = plan.gather_dims
    first = jax.tree.map(lambda x: x[0], micro)
    sinks = overlap.gather_sinks(params["layers"], dims)
    (loss_sum, (aux, written)), (grads, sink_grads) = first_fn(params, sinks, balancing, first)
    weights = {**params, "layers": overlap.with_gathered(params["layers"], written[overlap.GATHERED]["layers"], dims)}
    grads = _upcast({**grads, "layers": overlap.with_gathered(grads["layers"], sink_grads, dims)})
    init = (loss_sum, aux, plan.reduce(grads) if plan.each else grads)
    if jax.tree.leaves(micro)[0].shape[0] == 1:
        return init
    return rest(weights, balancing, jax.tree.map(lambda x: x[1:], micro), init)


def grads_of_one_microbatch(both_fn: Callable, params: Any, balancing: Any, micro: Batch, plan):
    """The step's sums when it has one microbatch and its blocks are both gathered in the forward
    and reduced in the backward: `both_fn`(params, grad sinks, balancing, mb, gather sinks, accs)
    (its model has overlap.BlockGatherReduce). The block params of `plan.gather_dims` come as this
    rank's shards; the sinks take the gathered weights' shapes; no earlier sums are added."""
    dims = plan.gather_dims
    mb = jax.tree.map(lambda x: x[0], micro)
    gather = overlap.gather_sinks(params["layers"], dims)
    whole = overlap.with_gathered(params["layers"], gather, dims)  # the layers at the gathered shapes
    sinks, accs = overlap.block_sinks(whole, None, plan.dims["layers"])
    (loss_sum, aux), (grads, sink_grads) = both_fn(params, sinks, balancing, mb, gather, accs)
    reduced = overlap.reduced_after_blocks(_upcast(grads), sink_grads, plan.dims, plan.dtype)
    return loss_sum, aux, reduced


def hooked_grad_fn(cfg: ZayaConfig, mesh: Mesh, context_layout: str, hook: Any) -> Callable:
    """value_and_grad, with respect to (params, sinks), of the loss of a model with block `hook`:
    fn(params, sinks, balancing, mb, *more) where `sinks` and `more` fill the hook's collections in
    order (the layer stacks of each)."""
    model = ZayaForCausalLM(cfg, mesh, context_layout, hook)

    def loss(params, sinks, balancing, mb, *more):
        extra = {name: {"layers": x} for name, x in zip(hook.collections, (sinks, *more))}
        return loss_and_counts(model, params, balancing, mb, extra=extra, outputs=hook.outputs)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def step_gradients(
    cfg: ZayaConfig, mesh: Mesh | None, context_layout: str = CONTIGUOUS, dp: DataParallel = DEFAULT_DATA_PARALLEL
) -> Callable:
    """grads(params, balancing, micro) -> (loss sum, (weight, counts, dropped, spills), gradients):
    sums over the whole global batch of `accumulated_grads`.

    On a mesh with a data axis each data rank accumulates its own microbatches and the gradients
    are reduce-scattered into the ZeRO-1 layout of the optimizer state (zaya_jax/parallel/zero1.py;
    with `dp.zero1` off all-reduced): with grad_reduce "step" the sum, unreduced, once after the loop
    (no data-parallel collective per microbatch), or, where `dp.overlaps` says so, each block's in
    the last microbatch's backward (`grads_reduced_in_backward`); with "microbatch" each
    microbatch's gradients inside the loop, the sum kept as the rank's shard. Where `dp.overlaps`
    says so, the block params come as ZeRO-1 shards and the first microbatch gathers them
    (`grads_gathered_in_forward`; with one microbatch and the blocks reduced in its backward,
    `grads_of_one_microbatch`). The model runs inside on the data-manual mesh of
    `zero1.step_meshes`; microbatches come in the storage order of `context_layout`; the gradients
    cross the data axis in `dp.grad_reduce_dtype`. Where `zero1.loop_per_rank` says no (no data
    axis, or a mesh XLA cannot partition so), GSPMD reduces the gradients as it computes them,
    whatever `dp` says."""
    per_rank = mesh is not None and zero1_lib.loop_per_rank(mesh)
    inner = zero1_lib.step_meshes(mesh)[1] if per_rank else mesh
    model = ZayaForCausalLM(cfg, inner, context_layout)
    grad_fn = jax.value_and_grad(lambda p, b, mb: loss_and_counts(model, p, b, mb), has_aux=True)
    if not per_rank:
        return lambda params, balancing, micro: accumulated_grads(grad_fn, params, balancing, micro)
    last_fn = hooked_grad_fn(cfg, inner, context_layout, overlap.BlockReduce(dp.grad_reduce_dtype))
    first_fn = hooked_grad_fn(cfg, inner, context_layout, overlap.BlockGather())
    both_fn = hooked_grad_fn(cfg, inner, context_layout, overlap.BlockGatherReduce(dp.grad_reduce_dtype))

    def loop(params, balancing, micro, plan):
        gather, count = plan.gather_dims is not None, jax.tree.leaves(micro)[0].shape[0]
        if plan.in_backward:
            rest = lambda p, b, m, init: grads_reduced_in_backward(grad_fn, last_fn, p, b, m, plan, init)
        else:
            rest = lambda p, b, m, init: accumulated_grads(grad_fn, p, b, m, plan.reduce if plan.each else None, init)
        if gather and plan.in_backward and count == 1:
            loss_sum, aux, grads = grads_of_one_microbatch(both_fn, params, balancing, micro, plan)
        elif gather:
            loss_sum, aux, grads = grads_gathered_in_forward(first_fn, rest, params, balancing, micro, plan)
        else:
            loss_sum, aux, grads = rest(params, balancing, micro, None)
        return (loss_sum, aux), grads

    def grads(params, balancing, micro):
        specs = grad_specs(params, mesh, dp.zero1)
        in_backward, in_forward = dp.overlaps(cfg, mesh)
        args = (loop, mesh, (params, balancing), micro, specs, dp.grad_reduce, dp.grad_reduce_dtype)
        (loss_sum, aux), g = zero1_lib.accumulate_per_rank(*args, in_backward, in_forward)
        return loss_sum, aux, g

    return grads
