"""Parallelism: device meshes, the logical-axis sharding table, expert parallelism, multi-process."""

from zaya_jax.parallel.mesh import MESH_AXES, make_mesh, resolve_mesh_shape
from zaya_jax.parallel.sharding import (
    batch_sharding,
    opt_state_shardings,
    param_shardings,
    per_device_bytes,
    shard_batch,
)

__all__ = [
    "MESH_AXES",
    "make_mesh",
    "resolve_mesh_shape",
    "batch_sharding",
    "opt_state_shardings",
    "param_shardings",
    "per_device_bytes",
    "shard_batch",
]
