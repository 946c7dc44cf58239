"""The device mesh: axes (data, fsdp, expert, context), sized from the config's mesh section.

  data    pure data parallelism; with ZeRO-1 the optimizer state is also split over it
  fsdp    data parallelism whose params, grads and optimizer state are split over it
  expert  data parallelism for attention; the experts of every MoE block are split over it and
          tokens reach their expert by all-to-all (zaya_jax/parallel/expert.py)
  context splits every sequence: positions are split over it (zaya_jax/parallel/context.py)

Batch rows are split over data, fsdp and expert, positions over context, so every device sees
different tokens; context is the innermost axis (K/V all-gather on the fastest links). One axis may be
-1: it takes the devices the others leave.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "expert", "context")


def resolve_mesh_shape(
    data: int, fsdp: int, expert: int, num_devices: int, context: int = 1
) -> tuple[int, ...]:
    """Fills a -1 axis and checks the product equals the device count (ValueError otherwise)."""
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "context": context}
    for name, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{name}={size!r}: must be a positive int or -1")
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % known:
            raise ValueError(
                f"mesh: {num_devices} devices are not divisible by the fixed axes "
                f"({', '.join(f'{n}={s}' for n, s in sizes.items() if s != -1)})"
            )
        sizes[free[0]] = num_devices // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh: data*fsdp*expert*context = {'*'.join(map(str, shape))} = {math.prod(shape)} "
            f"does not equal the {num_devices} available devices"
        )
    return shape


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    expert: int = 1,
    context: int = 1,
    *,
    num_experts: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (data, fsdp, expert, context) mesh over `devices` (default: all, across processes)."""
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_mesh_shape(data, fsdp, expert, len(devices), context)
    if num_experts is not None and num_experts % shape[2]:
        raise ValueError(f"mesh.expert={shape[2]} does not divide model.num_experts={num_experts}")
    # Auto axes: XLA propagates shardings from the ones we set on params, state and batches.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if devices == jax.devices():
        # jax.make_mesh orders devices so that inner axes stay within a host/node (fast links).
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def mesh_from_config(c, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of a training config (`mesh.data/fsdp/expert/context`) over `devices` (default:
    all), validated against them."""
    m = c.mesh
    context = m.get("context", 1)
    return make_mesh(m.data, m.fsdp, m.expert, context, num_experts=c.model.num_experts, devices=devices)
