"""How every array is laid out on the mesh: each parameter's logical axes come from the parameter
registry (zaya_jax/params.py); RULES maps logical to mesh axes.

  parameter                          logical axes (per block; scanned params add a leading "layers")
  embed_tokens/embedding             [vocab, embed]
  self_attn/{q,k,v_*}_proj/kernel    [embed, heads]         self_attn/o_proj/kernel  [heads, embed]
  mlp/gate/down_proj/kernel          [embed, router]
  mlp/experts/gate_up_proj           [expert, embed, mlp]   mlp/experts/down_proj    [expert, mlp, embed]
  everything else in the registry (norms, biases, scales, conv taps, router MLP)   replicated: small

  rules: expert -> "expert" mesh axis; embed -> "fsdp" (FSDP shards every big matrix on its model
  width); all other logical axes -> replicated. Batch rows are split over (data, fsdp, expert), and
  positions over "context" (zaya_jax/parallel/context.py).
  A parameter of two or more dimensions that the registry does not list is an error (ValueError).

ZeRO-1: each optimizer-state leaf takes its parameter's layout and is additionally split over the
"data" axis along its largest free dimension, so the optimizer state is never fully replicated; a
Muon matrix stack [l, ..., m, n] along its first axis l when the data axis divides it, so that each
rank holds whole matrices and orthogonalises its own (zaya_jax/parallel/zero1.py). The gradients
are reduce-scattered into the same layout (`zero1_param_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import CONTEXT, ROW_AXES
from zaya_jax.params import MUON, lookup, optimizer_rule, param_path

RULES: dict[str, str | None] = {"expert": "expert", "embed": "fsdp"}
BATCH_AXES = ROW_AXES  # the mesh axes that split batch rows


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axis names of the parameter at `path` (None = replicated dimension), from the
    parameter registry; ValueError if the registry does not list a parameter of ndim >= 2."""
    param = lookup(path, ndim)
    return (None,) * ndim if param is None or param.axes is None else param.axes


def mesh_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The mesh axis (or None) of every dimension of the parameter at `path`."""
    return tuple(RULES.get(a) if a else None for a in logical_axes(path, ndim))


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec of a parameter; ValueError if a sharded dimension does not divide evenly."""
    axes = mesh_axes(path, len(shape))
    for dim, (size, axis) in enumerate(zip(shape, axes)):
        if axis and size % mesh.shape[axis]:
            raise ValueError(
                f"{path}: dimension {dim} of size {size} is not divisible by mesh axis "
                f"{axis}={mesh.shape[axis]}"
            )
    return P(*axes)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for a params pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, spec_for(param_path(kp), tuple(x.shape), mesh)), params
    )


def _param_path_of(opt_path: str, param_paths: dict[str, tuple[int, ...]]) -> str | None:
    """The parameter an optimizer-state leaf mirrors: the longest param path its path ends with."""
    for path in sorted(param_paths, key=len, reverse=True):
        if opt_path == path or opt_path.endswith("/" + path):
            return path
    return None


def zero1_spec(
    spec: P,
    shape: tuple[int, ...],
    mesh: Mesh | Mapping[str, int],
    axis: str = "data",
    prefer: int | None = None,
) -> P:
    """Adds `axis` to dimension `prefer` if it is free and divisible by it, else to the largest
    such dimension (if any). Free: unsharded, or split only over mesh axes of size 1 (the embedding's
    width under fsdp = 1: `axis` joins them there). `mesh`: a Mesh or its axis sizes ({"data": 8,
    ...}, as sizing plans them)."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    n = sizes[axis]
    dims = list(spec) + [None] * (len(shape) - len(spec))
    named = lambda d: () if d is None else (d if isinstance(d, tuple) else (d,))
    if n == 1 or any(axis in named(d) for d in dims):
        return P(*dims)
    free = [d for d in range(len(shape)) if all(sizes[a] == 1 for a in named(dims[d])) and shape[d] % n == 0]
    if free:
        d = prefer if prefer in free else max(free, key=lambda d: shape[d])
        dims[d] = (*named(dims[d]), axis) if dims[d] is not None else axis
    return P(*dims)


def muon_stack(path: str, ndim: int) -> bool:
    """Whether the parameter at `path` is a Muon matrix stack [l, ..., m, n] (ndim >= 3)."""
    return ndim >= 3 and optimizer_rule(path, ndim).label == MUON


def zero1_param_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The ZeRO-1 layout of the optimizer state (and reduced gradient) of the parameter at `path`:
    its own spec plus "data" (`zero1_spec`), on the stack axis l for a Muon stack."""
    prefer = 0 if muon_stack(path, len(shape)) else None
    return zero1_spec(spec_for(path, shape, mesh), shape, mesh, prefer=prefer)


def grad_specs(params: Any, mesh: Mesh, zero1: bool = True) -> Any:
    """Where each reduced gradient lives: a tree like `params` of PartitionSpecs, the ZeRO-1 layout of
    its optimizer state (zero1) or its parameter's."""
    spec = zero1_param_spec if zero1 else lambda path, shape, mesh: spec_for(path, shape, mesh)
    return jax.tree_util.tree_map_with_path(lambda kp, x: spec(param_path(kp), tuple(x.shape), mesh), params)


def opt_state_shardings(opt_state: Any, params: Any, mesh: Mesh, zero1: bool = True) -> Any:
    """Shardings for an optax state: each leaf like its parameter, plus ZeRO-1 over `data`."""
    param_paths = {
        param_path(kp): tuple(x.shape) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }

    def one(kp, x):
        shape = tuple(getattr(x, "shape", ()))
        path = _param_path_of(param_path(kp), param_paths)
        if path and param_paths[path] == shape:
            spec = zero1_param_spec(path, shape, mesh) if zero1 else spec_for(path, shape, mesh)
        else:
            spec = zero1_spec(P(), shape, mesh) if zero1 else P()
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, S, ...] batches: rows split over BATCH_AXES, positions over "context"."""
    return NamedSharding(mesh, P(BATCH_AXES, CONTEXT))


def shard_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process' rows of the global batch -> global arrays sharded by `batch_sharding`."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()
    }


def per_device_bytes(tree: Any, device: jax.Device | None = None) -> int:
    """Bytes of `tree` resident on `device` (default: this process' first device)."""
    device = device or jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def global_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
