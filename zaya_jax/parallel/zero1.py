"""ZeRO-1 data parallelism: gradients accumulated per data rank, reduced once per optimizer step into
the optimizer's shards, and Muon's Newton-Schulz run by the rank that owns each matrix.

The design and the bytes it moves per step are docs/architecture.md "Data parallelism and ZeRO-1".

The per-rank loop, `train.grad_reduce` and the owners of Newton-Schulz: docs/design/zero1.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import CONTEXT
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.parallel.sharding import grad_specs, param_shardings
from zaya_jax.params import ATTENTION_MATRIX, CONV, EXPERT_MATRIX, LM_HEAD, lookup, param_path
from zaya_jax.runtime import xla_flags

DATA = "data"
REPLICA = "replica"  # the data axis, renamed and manual, around the microbatch loop
# train.grad_reduce: the per-rank gradient sum reduced once per optimizer step (ZeRO-1), or every
# microbatch's gradients reduce-scattered and only the rank's shard summed (ZeRO-2).
GRAD_REDUCE = ("step", "microbatch")
# train.grad_reduce_dtype: the dtype the gradients cross the data axis in (summed in fp32 locally).
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
LATENCY_HIDING = "xla_gpu_enable_latency_hiding_scheduler"  # `compiler_options` turns it on for ROCm
# The registry's weights the model casts to its compute dtype (model.dtype) before every use: a
# copy in that dtype computes the same values. The others (embedding lookup, router, norms, scales,
# biases) are read in fp32 and keep fp32 compute weights.
COMPUTE_DTYPE_RULES = (ATTENTION_MATRIX, EXPERT_MATRIX, LM_HEAD, CONV)


def step_meshes(mesh: Mesh) -> tuple[Mesh, Mesh]:
    """(outer, inner): `mesh`'s devices with axes (REPLICA, *MESH_AXES), REPLICA the data axis and
    `data` of size 1. `outer` (every axis automatic) is the mesh of the loop's `shard_map`; `inner`
    (the `loop_axes` manual) is the mesh the model is built on inside it, equal to the abstract
    mesh there."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"zero1: expected a mesh with axes {MESH_AXES}, got {mesh.axis_names}")
    devices = mesh.devices.reshape(mesh.shape[DATA], 1, *mesh.devices.shape[1:])
    names = (REPLICA, *MESH_AXES)
    auto = (AxisType.Auto,) * len(names)
    manual = tuple(AxisType.Manual if a in loop_axes(mesh) else AxisType.Auto for a in names)
    return Mesh(devices, names, axis_types=auto), Mesh(devices, names, axis_types=manual)


def loop_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the per-rank loop's shard_map makes manual: REPLICA, and the context axis where it
    splits sequences (each context rank sums its own chunks' gradients over the microbatches, and
    they are summed over the context ranks once per step, with the data ranks')."""
    return (REPLICA, CONTEXT) if mesh.shape[CONTEXT] > 1 else (REPLICA,)


def manual_context(mesh: Mesh) -> bool:
    """Whether the step's microbatch loop runs per rank with the context axis manual (`loop_axes`)."""
    return loop_per_rank(mesh) and CONTEXT in loop_axes(mesh)


def rank_sum(x: Any) -> Any:
    """Inside the loop's shard_map: `x` summed over the context ranks where that axis is manual
    (`loop_axes`), else `x`."""
    return jax.lax.psum(x, CONTEXT) if CONTEXT in jax.sharding.get_abstract_mesh().manual_axes else x


def loop_per_rank(mesh: Mesh | Mapping[str, int]) -> bool:
    """Whether the microbatch loop runs per data rank on `mesh` (a Mesh, or its {axis: size}:
    `accumulate_per_rank`): a data axis, and at most one other axis (fsdp, expert or context) larger
    than 1. XLA's SPMD partitioner (jax 0.10.2, CPU and GPU alike) aborts on a gather inside the
    data-manual loop when two automatic axes split it (a check in ExpandDeviceGroupsWithIota: the
    embedding lookup at fsdp x expert, CCA's backward at expert x context); such meshes keep GSPMD's
    reduction in every microbatch, and train.grad_reduce changes nothing there."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    others = [a for a in MESH_AXES if a != DATA and shape.get(a, 1) > 1]
    return shape.get(DATA, 1) > 1 and len(others) <= 1


def reduces_per_microbatch(grad_reduce: str, mesh: Mesh | Mapping[str, int]) -> bool:
    """Whether the per-rank loop reduce-scatters every microbatch's gradients (train.grad_reduce
    "microbatch" on a mesh where the loop runs per rank: `loop_per_rank`)."""
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"config.train.grad_reduce: must be one of {GRAD_REDUCE}, got {grad_reduce!r}")
    return grad_reduce == "microbatch" and loop_per_rank(mesh)


def shards_master(param_dtype: Any, compute_dtype: Any, zero1: bool = True) -> bool:
    """Whether the parameters of the train state are fp32 master weights kept in the ZeRO-1 shard
    (like the optimizer state), the step computing with a copy in the model's compute dtype
    (`compute_weights`): with mesh.zero1 on and a compute dtype narrower than the parameters'. With
    an fp32 model the compute weights are the parameters: replicated, no second copy."""
    return zero1 and jnp.dtype(compute_dtype).itemsize < jnp.dtype(param_dtype).itemsize


def compute_dtypes(params: Any, dtype: Any) -> Any:
    """A tree like `params` of the dtype each weight is computed with: `dtype` (model.dtype) for the
    weights of COMPUTE_DTYPE_RULES, the parameter's own for the rest."""

    def one(kp, x):
        param = lookup(param_path(kp), len(x.shape))
        cast = param is not None and param.optimizer in COMPUTE_DTYPE_RULES
        return jnp.dtype(dtype) if cast else jnp.dtype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def compute_weights(master: Any, dtype: Any, mesh: Mesh | None, in_forward: bool = False) -> Any:
    """The weights every device computes with, from the master `master` (the ZeRO-1 shards): each
    cast to its compute dtype (`compute_dtypes`) on its shard, then all-gathered over the data axis
    into the parameter layout (`param_shardings`): once per optimizer step, in the compute dtype.
    With `in_forward` the block params `gathered_in_forward` stay cast on their shards: the first
    microbatch gathers them (zaya_jax/parallel/overlap.py BlockGather)."""
    weights = jax.tree.map(lambda x, dt: x.astype(dt), master, compute_dtypes(master, dtype))
    if mesh is None:
        return weights
    # The barrier keeps each cast on the shard: left free, XLA may gather the fp32 master and cast
    # after the gather, twice the bytes (phase 3 on 1024 MI300X: docs/performance.md).
    weights = jax.lax.optimization_barrier(weights)
    shardings = param_shardings(weights, mesh)
    if in_forward:
        shard = lambda sh, spec: NamedSharding(mesh, spec) if gathered_in_forward(spec, mesh) else sh
        specs = grad_specs(weights, mesh)["layers"]
        shardings = {**shardings, "layers": jax.tree.map(shard, shardings["layers"], specs)}
    return jax.lax.with_sharding_constraint(weights, shardings)


def compiler_options(
    grad_reduce_dtype: Any, platform: str, overlap: tuple[bool, ...] = (), manual_context: bool = False
) -> dict[str, Any]:
    """XLA options the train step needs on the devices of `platform`:
    - on ROCm where any of `overlap` holds (the blocks' gradients reduced in the backward, their
      weights gathered in the forward: zaya_jax/parallel/overlap.py, `gradients.DataParallel.overlaps`),
      XLA's latency-hiding scheduler (LATENCY_HIDING), unless XLA_FLAGS names it. It is off by
      default there (jax 0.10.2), and without it an async collective's done directly follows its
      start: nothing is hidden;
    - on CPU with gradients reduced in bf16, or with the loop's context axis manual
      (`manual_context`: the model's bf16 collectives are then in the loop's shard_map), XLA's
      all-reduce promotion pass left out. It widens bf16 collectives to fp32 and aborts (jax 0.10.2)
      on those of a partly manual shard_map, whose reduction computation ends in a sharding
      annotation (a copy); XLA:CPU's collectives sum bf16 without it."""
    options: dict[str, Any] = {}
    if platform == "rocm" and any(overlap) and xla_flags.current("--" + LATENCY_HIDING) is None:
        options[LATENCY_HIDING] = True
    if platform == "cpu" and (jnp.dtype(grad_reduce_dtype) != jnp.float32 or manual_context):
        options["xla_disable_hlo_passes"] = "all-reduce-promotion"
    return options


def data_dim(spec: P) -> int | None:
    """The dimension a ZeRO-1 spec splits over the data axis (None: not split over it)."""
    for dim, axes in enumerate(spec):
        if axes == DATA or (isinstance(axes, tuple) and DATA in axes):
            return dim
    return None


def manual_part(spec: P) -> P:
    """The part of a config-mesh spec the loop's shard_map names: its data split, as REPLICA (the
    other axes are automatic there; the result is constrained to the whole spec after it)."""
    dim = data_dim(spec)
    return P(*(REPLICA if d == dim else None for d in range(len(spec))))


def in_blocks(dim: int | None) -> bool:
    """Whether a block leaf whose ZeRO-1 shard splits dimension `dim` ([l, ...]; None: whole) can be
    gathered / reduced inside the layer scan (zaya_jax/parallel/overlap.py): split past the layer
    axis, so every block holds a slice of it. The others are gathered before the loop and reduced
    after it."""
    return dim is not None and dim != 0


def gathered_in_forward(spec: P, mesh: Mesh) -> bool:
    """Whether the first microbatch gathers a block leaf of ZeRO-1 spec `spec` ([l, ...]) in its
    forward (zaya_jax/parallel/overlap.py BlockGather): `in_blocks`, and split over no other axis
    larger than 1. A leaf also split over fsdp or expert is gathered before the loop: inside it
    GSPMD gathers such a shard over those axes first and moves it whole over the data axis."""
    others = [a for axes in spec if axes for a in (axes if isinstance(axes, tuple) else (axes,)) if a != DATA]
    return in_blocks(data_dim(spec)) and all(mesh.shape[a] == 1 for a in others)


def reduce_per_rank(grads: Any, dims: Any, dtype: Any = jnp.float32) -> Any:
    """Inside the loop's shard_map: each rank's summed gradients -> the sum over ranks, reduce-scattered
    over REPLICA along `dims` (a tree like `grads` of ints, or None where a leaf stays whole:
    all-reduced). One collective per leaf per optimizer step, in `dtype` (train.grad_reduce_dtype;
    the result back in the gradient's dtype)."""
    return jax.tree.map(lambda g, d: _reduce_one(g, d, dtype), grads, dims, is_leaf=lambda x: x is None)


def _reduce_one(g: jax.Array, dim: int | None, dtype: Any) -> jax.Array:
    """One leaf of `reduce_per_rank`."""
    x = g.astype(dtype)
    if dim is None:
        out = jax.lax.psum(x, REPLICA)
    else:
        out = jax.lax.psum_scatter(x, REPLICA, scatter_dimension=dim, tiled=True)
    return rank_sum(out).astype(g.dtype)  # the context ranks sum the shard: 1/n of the bytes


@dataclasses.dataclass(frozen=True)
class PerRank:
    """How the per-rank loop meets the data axis (`accumulate_per_rank`). dims: the ZeRO-1 data
    dimension of each gradient leaf (None: all-reduced); dtype: train.grad_reduce_dtype; each: every
    microbatch's gradients reduce-scattered (grad_reduce "microbatch": `reduces_per_microbatch`);
    in_backward: each block's in the last microbatch's backward (zaya_jax/parallel/overlap.py
    BlockReduce); gather_dims: where the first microbatch all-gathers block params in its forward
    (BlockGather), the dimension of each (`gathered_in_forward`) in a tree like dims["layers"],
    None for the others; the loop gets those leaves as this rank's shards. None: nothing is."""

    dims: Any
    dtype: Any = jnp.float32
    each: bool = False
    in_backward: bool = False
    gather_dims: Any = None

    def reduce(self, grads: Any) -> Any:
        """`grads` (this rank's) reduced over the data axis into the ZeRO-1 layout."""
        return reduce_per_rank(grads, self.dims, self.dtype)


def accumulate_per_rank(
    loop: Callable[..., tuple[Any, Any]],
    mesh: Mesh,
    replicated: tuple[Any, ...],
    batch: Any,
    grad_specs: Any,
    grad_reduce: str = "step",
    grad_reduce_dtype: Any = jnp.float32,
    in_backward: bool = False,
    in_forward: bool = False,
) -> tuple[Any, Any]:
    """Runs `loop(*replicated, batch, plan)` -> (sums, grads) per data rank (`plan`: a `PerRank`)
    and reduces the gradients into the ZeRO-1 shards: once after the loop (grad_reduce "step"), or
    inside it, the loop reducing each microbatch's gradients before summing them (`plan.each`,
    "microbatch": its sum is then the rank's shard), or, with `in_backward`
    (overlap.overlaps_grad_reduce), in the last microbatch's backward; the loop returns them reduced
    in the last two cases. With `in_forward` (overlap.overlaps_param_gather) the block params
    `gathered_in_forward` come into the loop as this rank's shards of their ZeRO-1 layout, gathered
    there (PerRank's gather_dims).

    replicated: the arguments every data rank holds whole (params, balancing biases); batch: leaves
    [A, B, ...] with rows B split over the data axis (and any other); grad_specs: the ZeRO-1 spec of
    each gradient leaf on `mesh` (`sharding.zero1_spec`). Returns (sums over every rank: psum, the
    gradients summed over the ranks and laid out by grad_specs). grad_reduce_dtype: the dtype they
    cross the data axis in (train.grad_reduce_dtype)."""
    outer, _ = step_meshes(mesh)
    is_spec = lambda x: isinstance(x, P)
    dims = jax.tree.map(data_dim, grad_specs, is_leaf=is_spec)
    each = reduces_per_microbatch(grad_reduce, mesh)
    forward = lambda spec: data_dim(spec) if gathered_in_forward(spec, mesh) else None
    gather_dims = jax.tree.map(forward, grad_specs["layers"], is_leaf=is_spec) if in_forward else None
    plan = PerRank(dims, grad_reduce_dtype, each, in_backward, gather_dims)

    def body(*args):
        sums, grads = loop(*args, plan)
        return jax.lax.psum(sums, loop_axes(mesh)), grads if each or in_backward else plan.reduce(grads)

    params_specs = jax.tree.map(lambda _: P(), grad_specs, is_leaf=is_spec)
    if in_forward:  # the leaves the loop gathers come as this rank's shards
        sharded = lambda spec, d: P() if d is None else manual_part(spec)
        layers = jax.tree.map(sharded, grad_specs["layers"], gather_dims, is_leaf=is_spec)
        params_specs = {**params_specs, "layers": layers}
    sums, grads = jax.shard_map(
        body,
        mesh=outer,
        in_specs=(params_specs, *(P() for _ in replicated[1:]), P(None, REPLICA, *loop_axes(mesh)[1:])),
        out_specs=(P(), jax.tree.map(manual_part, grad_specs, is_leaf=is_spec)),
        axis_names=set(loop_axes(mesh)),
        check_vma=False,
    )(*replicated, batch)
    place = lambda g, spec: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, spec))
    return sums, jax.tree.map(place, grads, grad_specs, is_leaf=is_spec)


def step_bytes(
    params: Any,
    mesh: Mesh,
    zero1: bool = True,
    grad_accum: int = 1,
    grad_reduce: str = "step",
    compute_dtype: Any = None,
    grad_reduce_dtype: Any = jnp.float32,
    wire: bool = False,
) -> int:
    """The data-parallel traffic of one optimizer step per device by the formula of
    docs/design/zero1.md ("Bytes on the wire"): for each gradient leaf of e elements on a device (its
    share after the parameter's own expert / fsdp split), n data ranks, g = e x the size of
    `grad_reduce_dtype` and w = e x the size of the weight gathered (its compute dtype,
    `compute_dtypes`, where `shards_master(.., compute_dtype, zero1)`; else the parameter's: the
    fp32 update), where ZeRO-1 splits it:
      result bytes (`wire` False): A g / n reduce-scattered + w all-gathered
      bytes on the wire (ring):    (n - 1) / n (A g + w)
    and where it does not, A g all-reduced (on the wire 2 (n - 1) / n A g); A = `grad_accum` where
    grad_reduce "microbatch" reduces every microbatch (`reduces_per_microbatch`), else 1. With fp32
    parameters, gradients and weights: 4 P (1 + A / n) result bytes, 8 P (n - 1) / n on the wire;
    with bf16 compute weights 6 P (n - 1) / n, and 4 P (n - 1) / n with bf16 gradients too.
    `params`: arrays or ShapeDtypeStructs (the fp32 parameters)."""
    n = mesh.shape[DATA]
    if n == 1:
        return 0
    times = grad_accum if reduces_per_microbatch(grad_reduce, mesh) else 1
    master = compute_dtype is not None and zero1
    dtypes = compute_dtypes(params, compute_dtype) if master else jax.tree.map(lambda x: x.dtype, params)
    size = lambda dt: jnp.dtype(dt).itemsize
    total = 0.0
    specs = jax.tree.leaves(grad_specs(params, mesh, zero1), is_leaf=lambda x: isinstance(x, P))
    shardings = jax.tree.leaves(param_shardings(params, mesh))
    leaves = zip(jax.tree.leaves(params), specs, shardings, jax.tree.leaves(dtypes))
    for x, spec, sharding, dtype in leaves:
        e = math.prod(sharding.shard_shape(tuple(x.shape)))
        g, w = e * size(grad_reduce_dtype), e * size(dtype if master else x.dtype)
        if data_dim(spec) is None:
            total += times * g * (2 * (n - 1) / n if wire else 1)
        else:
            total += (n - 1) / n * (times * g + w) if wire else times * (g // n) + w
    return int(total)


# ------------------------------------------------------------------------------ owned Newton-Schulz
def _axes(spec: P, ndim: int, mesh: Mesh) -> list[tuple[str, ...]]:
    """Per dimension the mesh axes (of size > 1) that split it."""
    dims = list(spec) + [None] * (ndim - len(spec))
    as_tuple = lambda a: () if a is None else (a if isinstance(a, tuple) else (a,))
    return [tuple(a for a in as_tuple(d) if mesh.shape[a] > 1) for d in dims]


@dataclasses.dataclass(frozen=True)
class Owners:
    """How the matrices of a stack [*stack, m, n] stored with spec `stored` are split among their
    owners (`owner_plan`):

    flat       the leading stack axes flattened into one axis of matrices (none of them split,
               except the first by the data axis alone: `aligned`)
    aligned    the data axis splits that flattened axis already: a rank's shard is its block
    kept       (axis, dim): the axes splitting a stack axis after the flattened ones: each rank
               keeps its part of those
    moved      (axis, dim): the axes splitting a matrix dimension, swapped onto the flattened axis
               by an all-to-all (the matrix whole again), in this order
    spread     the axes the stack is replicated over (size > 1), each rank taking its part
    ranks      how many parts the flattened axis is cut into: moved and spread axes together
    """

    flat: int
    aligned: bool
    kept: tuple[tuple[str, int], ...]
    moved: tuple[tuple[str, int], ...]
    spread: tuple[str, ...]
    ranks: int


def owner_plan(shape: tuple[int, ...], stored: P, mesh: Mesh) -> Owners:
    """The owners of the matrices of a stack [*stack, m, n] stored as `stored` (see `Owners`)."""
    axes = _axes(stored, len(shape), mesh)
    stack = len(shape) - 2
    aligned = stack > 0 and axes[0] == (DATA,)
    flat = 1 if aligned else 0
    while flat < stack and not axes[flat]:
        flat += 1
    kept = tuple((a, d) for d in range(flat, stack) for a in axes[d])
    moved = tuple((a, d) for d in (stack, stack + 1) for a in axes[d])
    used = {a for dim in axes for a in dim}
    spread = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used)
    ranks = math.prod(mesh.shape[a] for a, _ in moved) * math.prod(mesh.shape[a] for a in spread)
    return Owners(flat, aligned, kept, moved, spread, ranks)


def _cut_order(plan: Owners, keep: set[str]) -> list[str]:
    """The owner axes in the order they cut the stack, outer first: the moved axes the parameter
    keeps (fsdp) last. The results come back inner axis first, so a kept axis is back on its
    dimension before another axis splits that dimension further (`_gather_dims`): the kept split
    stays the outer one, as the parameter's layout has it."""
    owners = [a for a, _ in plan.moved if a not in keep] + list(plan.spread)
    return owners + [a for a, _ in plan.moved if a in keep]


def _gather_dims(
    shape: tuple[int, ...], plan: Owners, mesh: Mesh, keep: set[str], owners: list[str]
) -> dict[str, int | None]:
    """Where each owner axis (`owners`, in the stack's cut order) puts its part of the result
    before the all-gather: None = stacked on the flattened axis (exact when the owners divide the
    stack: no padding moves), else a matrix dimension it splits instead (a padded stack: the padding
    is dropped before anything is gathered); a moved axis the parameter keeps (fsdp) goes back to
    its own dimension."""
    count = math.prod(shape[: plan.flat]) // (mesh.shape[DATA] if plan.aligned else 1)  # per rank
    stack = len(shape) - 2
    split = {stack: 1, stack + 1: 1}
    out: dict[str, int | None] = {}
    moved = dict(plan.moved)
    for axis in reversed(owners):
        if axis in keep:
            out[axis] = moved[axis]
            continue
        out[axis] = None
        if count % plan.ranks:
            for dim in (stack + 1, stack):
                if shape[dim] % (split[dim] * mesh.shape[axis] * _kept_split(dim, plan, keep, mesh)) == 0:
                    split[dim] *= mesh.shape[axis]
                    out[axis] = dim
                    break
    return out


def _kept_split(dim: int, plan: Owners, keep: set[str], mesh: Mesh) -> int:
    """How many parts a matrix dimension stays split into in the parameter (fsdp)."""
    return math.prod(mesh.shape[a] for a, d in plan.moved if d == dim and a in keep)


def owned_orthogonalize(
    fn: Callable[[jax.Array], jax.Array], x: jax.Array, stored: P, spec: P, mesh: Mesh
) -> jax.Array:
    """fn (Newton-Schulz: batched over leading axes, one result per [m, n] matrix) of x [*stack, m,
    n] stored as `stored` (its ZeRO-1 spec), each matrix computed once, by the rank that owns it
    (`owner_plan`), and the result all-gathered into the parameter's layout `spec`: whole on every
    rank of the data axis, or, where `spec` splits it over the data axis too (the fp32 master in
    the ZeRO-1 shard: `shards_master`), in that shard. Zero matrices pad the stack to a multiple of
    the owners (Newton-Schulz of 0 is 0: it is normalised by 0 + eps); they are dropped before the
    gather (`_gather_dims`)."""
    shape = tuple(x.shape)
    plan = owner_plan(shape, stored, mesh)
    out_axes = _axes(spec, x.ndim, mesh)
    keep = {a for d in out_axes for a in d}
    out_shape = [size // math.prod(mesh.shape[a] for a in axes) for size, axes in zip(shape, out_axes)]
    owners = _cut_order(plan, keep)  # outer first, as the stack is cut
    gather_dims = _gather_dims(shape, plan, mesh, keep, owners)
    moved = dict(plan.moved)
    shift = 1 - plan.flat  # dimension d >= flat of x is d + shift of the flattened stack

    def per_device(y):
        y = y.reshape(-1, *y.shape[plan.flat :])
        count = y.shape[0]
        padded = -(-count // plan.ranks) * plan.ranks
        y = jnp.pad(y, [(0, padded - count)] + [(0, 0)] * (y.ndim - 1))
        for axis in owners:  # each rank takes its block of the stack, the axes outer first
            if axis in moved:  # whole matrices: the split moves onto the stack
                y = jax.lax.all_to_all(y, axis, 0, moved[axis] + shift, tiled=True)
            else:
                part = y.shape[0] // mesh.shape[axis]
                y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(axis) * part, part)
        y = fn(y)
        flat: list[str] = []  # owner axes whose parts are stacked on the flattened axis, inner first
        pending = []  # (axis, dim): gathered along a matrix dimension once the padding is dropped

        def gather_flat(y, outer=()):
            axes = (*outer, *reversed(flat))
            flat.clear()
            return jax.lax.all_gather(y, axes, axis=0, tiled=True) if axes else y

        for axis in reversed(owners):
            dim = gather_dims[axis]
            if dim is None:
                flat.append(axis)
                continue
            y = jax.lax.all_to_all(gather_flat(y), axis, dim + shift, 0, tiled=True)
            pending += [] if axis in keep else [(axis, dim)]
        gather_data = plan.aligned and DATA not in keep  # `spec` keeps the data split: no gather
        if padded == count and gather_data:  # nothing padded: one gather over every axis
            y = gather_flat(y, outer=(DATA,))
        else:
            y = gather_flat(y)[:count]
            y = jax.lax.all_gather(y, DATA, axis=0, tiled=True) if gather_data else y
        for axis, dim in [(a, d) for a, d in plan.kept if a not in keep] + pending[::-1]:
            y = jax.lax.all_gather(y, axis, axis=dim + shift, tiled=True)
        return y.reshape(out_shape)

    return jax.shard_map(per_device, mesh=mesh, in_specs=stored, out_specs=spec, check_vma=False)(x)
