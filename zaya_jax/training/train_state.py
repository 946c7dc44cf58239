"""The train state and the jit-compiled train / eval steps.

One optimizer step = `grad_accum` microbatches scanned in sequence; the loss is the token-weighted
mean over the whole global batch, so any grad_accum gives the same update (up to float order).
After the optimizer update, the router balancing biases take their own AdamW step from the step's
global expert counts (aux-loss-free balancing, zaya_jax/optim/balancing.py); they are never touched by
backprop.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.model import BALANCING, ZayaConfig, ZayaForCausalLM, init_variables
from zaya_jax.optim import balancing as bal
from zaya_jax.optim.chain import lr_schedule, make_optimizer
from zaya_jax.parallel import zero1 as zero1_lib
from zaya_jax.parallel.context import (
    CONTEXT,
    CONTIGUOUS,
    check_local_length,
    config_context,
    context_size,
    layout_is_identity,
    layout_permutation,
    to_layout,
)
from zaya_jax.parallel.mesh import make_mesh, mesh_platform
from zaya_jax.parallel.sharding import (
    BATCH_AXES,
    batch_sharding,
    grad_specs,
    opt_state_shardings,
    param_shardings,
)
from zaya_jax.training.gradients import (
    DEFAULT_DATA_PARALLEL,
    Batch,
    DataParallel,
    StepAux,
    loss_and_counts,
    step_gradients,
)
from zaya_jax.training.routing_telemetry import step_metrics as routing_step_metrics

__all__ = ["Batch", "StepAux", "loss_and_counts"]  # the step's loss, read by tests and evaluation
OPTIMIZER_SCOPE = "optimizer_update"  # jax.named_scope of the optimizer's ops (in their HLO op_name)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    balancing: Any  # the model's "balancing" collection: biases [L, E+1]
    balancing_opt_state: Any
    skipped_steps: jax.Array  # int32: updates skipped for non-finite loss or gradients

    @property
    def variables(self) -> dict[str, Any]:
        return {"params": self.params, BALANCING: self.balancing}


def create_train_state(
    cfg: ZayaConfig, tx: optax.GradientTransformation, bal_cfg: bal.BalancingConfig, rng: jax.Array
) -> TrainState:
    variables = init_variables(cfg, rng)
    biases = bal.get_balancing_biases(variables)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=variables["params"],
        opt_state=tx.init(variables["params"]),
        balancing=variables[BALANCING],
        balancing_opt_state=bal.init_balancing_state(biases, bal_cfg),
        skipped_steps=jnp.zeros((), jnp.int32),
    )


def variable_shardings(variables: Any, mesh: Mesh) -> dict[str, Any]:
    """Where the model's variables live: params by the sharding table (FSDP / expert axes), the
    small balancing biases replicated."""
    return {
        "params": param_shardings(variables["params"], mesh),
        BALANCING: jax.tree.map(lambda _: NamedSharding(mesh, P()), variables[BALANCING]),
    }


def state_shardings(state: TrainState, mesh: Mesh, zero1: bool = True, master: bool = False) -> TrainState:
    """Where each part of the state lives: the variables as `variable_shardings`, optimizer state
    like its params plus ZeRO-1 over `data`, the small rest replicated. `master`: the params are
    the fp32 master weights, in the ZeRO-1 shard of their optimizer state (`zero1.shards_master`)."""
    replicated = NamedSharding(mesh, P())
    variables = variable_shardings(state.variables, mesh)
    if master:
        to_sharding = lambda spec: NamedSharding(mesh, spec)
        specs = grad_specs(state.params, mesh, zero1)
        variables["params"] = jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, P))
    return TrainState(
        step=replicated,
        params=variables["params"],
        opt_state=opt_state_shardings(state.opt_state, state.params, mesh, zero1=zero1),
        balancing=variables[BALANCING],
        balancing_opt_state=jax.tree.map(lambda _: replicated, state.balancing_opt_state),
        skipped_steps=replicated,
    )


def layout_batch(batch: Batch, layout: str, mesh: Mesh | None) -> Batch:
    """The batch [B, S] (position order) in the storage order of the context layout (`to_layout`,
    mesh.context_layout) plus its positions (the permuted arange): unchanged where that order is
    the identity (contiguous, or no context axis). Inside jit, once per step: it moves only the
    int / fp32 token inputs, negligible beside the activations, and everything per token (norms,
    MoE, loss sums) is order-agnostic."""
    r = context_size(mesh)
    if layout_is_identity(layout, r):
        return batch
    b, s = batch["input_ids"].shape
    out = {k: to_layout(x, layout, r) for k, x in batch.items()}
    out["positions"] = jnp.broadcast_to(jnp.asarray(layout_permutation(s, layout, r)), (b, s))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh)), out)


def split_microbatches(x: jax.Array, grad_accum: int, mesh: Mesh | None) -> jax.Array:
    """[B, ...] -> [A, B / A, ...]: microbatch a takes rows a, a + A, a + 2A, ... so that with the
    batch split over devices in contiguous row blocks every microbatch stays spread over all
    devices (no resharding); positions stay split over the context axis."""
    x = x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)
    if mesh is not None:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES, CONTEXT)))
    return x


def balancing_step(
    state: TrainState, counts: jax.Array, bal_cfg: bal.BalancingConfig | None
) -> tuple[Any, Any]:
    """(new balancing collection, its optimizer state) after the step's global expert counts
    [l, e+1]; unchanged biases when balancing is off."""
    if bal_cfg is None:
        return state.balancing, state.balancing_opt_state
    biases = bal.get_balancing_biases({BALANCING: state.balancing})
    new_biases, bal_state, _ = bal.balancing_update(biases, counts, state.balancing_opt_state, bal_cfg)
    return bal.set_balancing_biases({BALANCING: state.balancing}, new_biases)[BALANCING], bal_state


def updated_state(
    state: TrainState,
    grads: Any,
    grad_norm: jax.Array,
    counts: jax.Array,
    finite: jax.Array,
    tx: optax.GradientTransformation,
    bal_cfg: bal.BalancingConfig | None,
) -> TrainState:
    """The state after one optimizer step (params, optimizer state, balancing biases and their
    state), or, where `finite` is False, the old one bit for bit; step and skipped_steps counted.
    `tx` gets `grad_norm` (the global norm of `grads`) as an extra argument: the clip of
    zaya_jax.optim.chain reuses it instead of reading every gradient again.

    A lax.cond rather than a select of new against old: on the common (finite) path no pass
    reads both whole states and writes a third, and with the state donated the update writes in
    place; only a skipped step runs the keep-old branch."""

    def update(state: TrainState) -> TrainState:
        with jax.named_scope(OPTIMIZER_SCOPE):  # names the update's ops (the dry run counts them)
            updates, opt_state = optax.with_extra_args_support(tx).update(
                grads, state.opt_state, state.params, grad_norm=grad_norm
            )
        balancing, bal_state = balancing_step(state, counts, bal_cfg)
        return state.replace(
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            balancing=balancing,
            balancing_opt_state=bal_state,
        )

    # The update is the false (default, branch 0) computation: zaya_jax.analysis.hlo takes branch 0 as the
    # main path, so the dry run counts the update's collectives on every step.
    new = jax.lax.cond(~finite, lambda state: state, update, state)
    return new.replace(step=state.step + 1, skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))


# The expert exchange's spill rounds (README "Metrics"): MoE block calls (layers x microbatches x
# expert groups) that took it, per step; the trainer logs their mean over the steps since the last
# record and the fraction of those steps with any.
SPILL_BLOCKS = "expert_exchange/spill_blocks"
SPILL_STEP_FRACTION = "expert_exchange/spill_step_fraction"


def has_spill_round(cfg: ZayaConfig, mesh: Mesh | None) -> bool:
    """Whether the step's expert exchange has a spill round (dropless with mesh.expert > 1)."""
    return mesh is not None and mesh.shape["expert"] > 1 and cfg.moe_capacity_factor is None


def make_train_step(
    cfg: ZayaConfig,
    tx: optax.GradientTransformation,
    bal_cfg: bal.BalancingConfig | None,
    schedule: Callable[[jax.Array], jax.Array],
    grad_accum: int = 1,
    mesh: Mesh | None = None,
    context_layout: str = CONTIGUOUS,
    dp: DataParallel = DEFAULT_DATA_PARALLEL,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns train_step(state, batch) -> (state, metrics); batch leaves are [B, S] (global),
    split into `grad_accum` microbatches (split_microbatches). `context_layout`
    (mesh.context_layout): which sequence chunks each context rank holds (`layout_batch`). `dp`:
    how the gradients and weights cross the data axis (ZeRO-1 per mesh.zero1, train.grad_reduce,
    its dtype and the two overlaps: gradients.DataParallel, step_gradients).

    The step computes with `zero1.compute_weights` of state.params: where the params are the fp32
    master in the ZeRO-1 shard (`zero1.shards_master`: a model.dtype narrower than fp32), each
    weight cast to its compute dtype and all-gathered once, before the microbatch loop or, block by
    block, in the first microbatch; with an fp32 model the params themselves."""
    gradients = step_gradients(cfg, mesh, context_layout, dp)
    master = dp.master(cfg)
    in_forward = dp.overlaps(cfg, mesh)[1]

    def train_step(state: TrainState, batch: Batch):
        batch = layout_batch(batch, context_layout, mesh)
        micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum, mesh), batch)
        weights = zero1_lib.compute_weights(state.params, cfg.compute_dtype, mesh, in_forward)
        params = weights if master else state.params
        loss_sum, aux, grads = gradients(params, state.balancing, micro)
        weight, counts = aux.weight, aux.counts
        denom = jnp.maximum(weight, 1.0)
        loss = loss_sum / denom
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        # A non-finite loss or gradient skips the whole update (params, optimizer and balancing
        # state) rather than poisoning the run; the trainer counts and reports these.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_state = updated_state(state, grads, grad_norm, counts, finite, tx, bal_cfg)
        # The load that produced `counts` (under the old biases), the same whether or not skipped; the
        # biases after the update (zaya_jax/training/routing_telemetry.py).
        biases = bal.get_balancing_biases(new_state.variables)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": weight,
            "update_skipped": ~finite,
            "skipped_steps": new_state.skipped_steps,  # so a step can be logged after the next is dispatched
            "dropped_tokens": jnp.sum(aux.dropped),
            **routing_step_metrics(counts, aux.entropy, biases, cfg.num_experts),
        }
        if has_spill_round(cfg, mesh):
            # Spill rounds run: [l, devices] summed over the group's n devices, each of which says so.
            metrics[SPILL_BLOCKS] = jnp.sum(aux.spills) // mesh.shape["expert"]
        return new_state, metrics

    return train_step


def balancing_config(c: ml_collections.ConfigDict) -> bal.BalancingConfig | None:
    """The training config's `balancing` section (None when disabled)."""
    return bal.from_config(c.balancing)


def run_once(fn: Callable[[], Any], out_shardings: Any) -> Any:
    """fn() jit-compiled with `out_shardings`, run, and its executable dropped: jax.jit(fn)() would
    keep it in jax's caches for as long as `fn` lives. A program run once (the initializer) would hold
    its memory from start to end that way (docs/design/host-memory.md)."""
    # jax's tracing, lowering and compilation caches hold their entries weakly, keyed by the
    # function: a wrapper that dies here takes them along (reference cycles hold it until a
    # collection, hence the gc.collect()).
    out = jax.block_until_ready(jax.jit(lambda: fn(), out_shardings=out_shardings)())
    gc.collect()
    return out


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """What the trainer compiles for one training config on one mesh.

    create()            the initial TrainState (traceable; `initial_state()` runs it)
    shardings           where each part of the state lives (state_shardings)
    train_step          jax.jit(train_step, state donated): (state, batch) -> (state, metrics)
    abstract_state()    the state's ShapeDtypeStructs with their shardings (abstract_train_state)
    """

    mesh: Mesh
    create: Callable[[], TrainState]
    shardings: TrainState
    train_step: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
    abstract: TrainState

    def abstract_state(self) -> TrainState:
        return self.abstract

    def initial_state(self) -> TrainState:
        """create() compiled, run once on the mesh, its executable dropped (`run_once`)."""
        return run_once(self.create, self.shardings)


@dataclasses.dataclass(frozen=True)
class _StateLayout:
    tx: optax.GradientTransformation
    bal_cfg: bal.BalancingConfig | None
    create: Callable[[], TrainState]
    shardings: TrainState
    abstract: TrainState


def _state_layout(c: ml_collections.ConfigDict, cfg: ZayaConfig, mesh: Mesh) -> _StateLayout:
    """The optimizer and balancing of config `c`, its initial-state function and that state's
    shapes and shardings on `mesh` (traced with jax.eval_shape: nothing allocated)."""
    master = zero1_lib.shards_master(cfg.params_dtype, cfg.compute_dtype, c.mesh.zero1)
    tx = make_optimizer(c, c.train.steps, mesh_platform(mesh), mesh, c.mesh.zero1, master)
    bal_cfg = balancing_config(c)
    create = lambda: create_train_state(cfg, tx, bal_cfg or bal.BalancingConfig(), jax.random.key(c.seed))
    shapes = jax.eval_shape(create)
    shardings = state_shardings(shapes, mesh, zero1=c.mesh.zero1, master=master)
    struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    return _StateLayout(tx, bal_cfg, create, shardings, jax.tree.map(struct, shapes, shardings))


def abstract_train_state(
    c: ml_collections.ConfigDict, cfg: ZayaConfig, mesh: Mesh | None = None
) -> TrainState:
    """The train state of config `c` (model `cfg`) as ShapeDtypeStructs carrying its shardings on
    `mesh` (default: this process's first device), nothing allocated: the restore target of the
    trainer, reshard and every checkpoint reader (its `.variables`), the compile target of the dry
    run. The one builder; `train_program(...).abstract_state()` is the same tree."""
    if mesh is None:
        mesh = make_mesh(devices=jax.local_devices()[:1])  # every axis 1
    return _state_layout(c, cfg, mesh).abstract


def abstract_batch(batch_size: int, seq_len: int, mesh: Mesh) -> Batch:
    """ShapeDtypeStructs of a global batch [B, S] as the data pipeline yields it, laid out as
    `shard_batch` lays it out."""
    sharding = batch_sharding(mesh)
    spec = lambda dtype: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=sharding)
    return {"input_ids": spec(jnp.int32), "targets": spec(jnp.int32), "loss_mask": spec(jnp.float32)}


def check_batch_divides(c: ml_collections.ConfigDict, devices: int) -> None:
    """train.batch_size, and each of its grad_accum microbatches, divide over `devices` (ValueError
    naming the key otherwise): the trainer and the dry run check it before building the step.
    With mesh.context = R, rows divide over devices / R and train.seq_len over R (2R chunks with
    mesh.context_layout "zigzag")."""
    context = config_context(c.mesh, devices)
    rows = devices // context
    batch_size, micro = c.train.batch_size, c.train.batch_size // c.train.grad_accum
    if batch_size % rows or micro % rows:
        raise ValueError(
            f"config.train.batch_size={batch_size} (per microbatch {micro}) must be divisible by the "
            f"{rows} devices" + (f" that split batch rows (mesh.context={context})" if context > 1 else "")
        )
    try:
        halo = c.model.cca_time0 + c.model.cca_time1 - 2
        check_local_length(c.train.seq_len, context, halo, c.mesh.context_layout)
    except ValueError as e:
        raise ValueError(f"config.train.seq_len={c.train.seq_len}: {e}") from None


def train_program(c: ml_collections.ConfigDict, cfg: ZayaConfig, mesh: Mesh) -> TrainProgram:
    """The train step of config `c` (model `cfg`, validated) on `mesh`: the optimizer, LR schedule
    and balancing of the config, the state laid out by the sharding table (ZeRO-1 per mesh.zero1;
    the fp32 master params in the ZeRO-1 shard where model.dtype is narrower: `zero1.shards_master`),
    the gradients reduced per train.grad_reduce in train.grad_reduce_dtype."""
    layout = _state_layout(c, cfg, mesh)
    schedule = lr_schedule(c, total_steps=c.train.steps)
    train, dp = c.train, DataParallel.from_config(c)
    args = (layout.tx, layout.bal_cfg, schedule, train.grad_accum, mesh, c.mesh.context_layout, dp)
    step = make_train_step(cfg, *args)
    shardings = layout.shardings
    overlaps = dp.overlaps(cfg, mesh)
    context = zero1_lib.manual_context(mesh)
    options = zero1_lib.compiler_options(train.grad_reduce_dtype, mesh_platform(mesh), overlaps, context)
    jitted = jax.jit(
        step,
        in_shardings=(shardings, None),
        out_shardings=(shardings, None),
        donate_argnums=0,
        compiler_options=options or None,
    )
    return TrainProgram(mesh, layout.create, shardings, jitted, layout.abstract)


def make_eval_step(
    cfg: ZayaConfig, mesh: Mesh | None = None, context_layout: str = CONTIGUOUS
) -> Callable[[Any, Batch], dict[str, jax.Array]]:
    """eval_step(variables, batch) -> {"loss_sum", "weight"} (sum over tokens; divide at the end)."""
    model = ZayaForCausalLM(cfg, mesh, context_layout)

    def eval_step(variables, batch):
        batch = layout_batch(batch, context_layout, mesh)
        loss_sum, aux = loss_and_counts(model, variables["params"], variables[BALANCING], batch)
        return {"loss_sum": loss_sum, "weight": aux.weight}

    return eval_step
