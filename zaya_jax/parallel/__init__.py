"""Parallelism: device meshes (the one mesh-spec parser), logical-axis sharding over the parameter
registry, expert parallelism, multi-process."""

from zaya_jax.parallel.mesh import (
    MESH_AXES,
    make_mesh,
    parse_mesh_spec,
    resolve_mesh_shape,
    resolve_mesh_sizes,
)
from zaya_jax.parallel.sharding import (
    batch_sharding,
    opt_state_shardings,
    param_shardings,
    per_device_bytes,
    shard_batch,
)

__all__ = [
    "MESH_AXES",
    "batch_sharding",
    "make_mesh",
    "opt_state_shardings",
    "param_shardings",
    "parse_mesh_spec",
    "per_device_bytes",
    "resolve_mesh_shape",
    "resolve_mesh_sizes",
    "shard_batch",
]
