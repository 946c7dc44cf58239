"""The device mesh: axes (data, fsdp, expert, context), sized from the config's mesh section.

  data    pure data parallelism; with ZeRO-1 the optimizer state is also split over it
  fsdp    data parallelism whose params, grads and optimizer state are split over it
  expert  data parallelism for attention; the experts of every MoE block are split over it and
          tokens reach their expert by all-to-all (zaya_jax/parallel/expert.py)
  context splits every sequence: positions are split over it (zaya_jax/parallel/context.py); it is
          the innermost axis, so the K/V all-gather runs on the fastest links

Batch rows are split over data, fsdp and expert, positions over context, so every device sees
different tokens. One axis may be
-1: it takes the devices the others leave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zaya_jax.runtime import cli

# Adding an axis: one entry here (its default size in DEFAULT_SIZES if not 1) and its key in the
# config's mesh section (zaya_jax/config.py); every parser and builder below walks this tuple.
MESH_AXES = ("data", "fsdp", "expert", "context")
DEFAULT_SIZES = {"data": -1}  # unnamed axes: 1, except data, which takes the devices left


def check_mesh_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    """{axis: size} for every axis of MESH_AXES (1 where `sizes` has none); ValueError for an
    unknown axis, a size that is neither a positive int nor -1, or more than one -1."""
    unknown = [a for a in sizes if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh: unknown axis {unknown[0]!r}; the axes are {', '.join(MESH_AXES)}")
    out = {a: sizes.get(a, 1) for a in MESH_AXES}
    for name, size in out.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh.{name}={size!r}: must be a positive int or -1")
    free = [a for a, s in out.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    return out


def resolve_mesh_sizes(
    sizes: Mapping[str, int], num_devices: int | None = None, exact: bool = False
) -> dict[str, int]:
    """`check_mesh_sizes`, then a -1 axis filled from `num_devices`. ValueError also for a -1
    without `num_devices` or devices that the fixed axes do not divide; with `exact`, unless the
    sizes multiply to `num_devices`.
    """
    out = check_mesh_sizes(sizes)
    free = [a for a, s in out.items() if s == -1]
    known = math.prod(s for s in out.values() if s != -1)
    if free:
        if not num_devices:
            raise ValueError("mesh: an axis is -1 but the number of devices is unknown")
        if num_devices % known:
            raise ValueError(
                f"mesh: {num_devices} devices are not divisible by the fixed axes "
                f"({', '.join(f'{n}={s}' for n, s in out.items() if s != -1)})"
            )
        out[free[0]] = num_devices // known
    if exact and math.prod(out.values()) != num_devices:
        raise ValueError(
            f"mesh: {'*'.join(MESH_AXES)} = {'*'.join(map(str, out.values()))} = {math.prod(out.values())} "
            f"does not equal the {num_devices} available devices"
        )
    return out


def parse_mesh_spec(
    spec: str | Mapping[str, int] | None, default: Mapping[str, int] | None = None
) -> dict[str, int]:
    """`"data=2,expert=4"` (or a mapping) -> {axis: size} for every axis; the axes it does not name
    come from `default`, else DEFAULT_SIZES, else 1. Sizes are checked by `resolve_mesh_sizes`."""
    sizes = {a: DEFAULT_SIZES.get(a, 1) for a in MESH_AXES} if default is None else {a: 1 for a in MESH_AXES}
    sizes.update({k: int(v) for k, v in (default or {}).items() if k in MESH_AXES})
    if isinstance(spec, Mapping):
        sizes.update(spec)
    elif spec is not None and spec.strip():
        for part in spec.split(","):
            key, sep, value = (x.strip() for x in part.partition("="))
            if not sep or key not in MESH_AXES or not value.lstrip("-").isdigit():
                raise ValueError(
                    f"--mesh {spec!r}: expected axis=size with axes {', '.join(MESH_AXES)}, got {part!r}"
                )
            sizes[key] = int(value)
    return sizes


def checked_mesh_spec(spec: str) -> str:
    """`spec` itself if parse_mesh_spec reads it and its sizes pass check_mesh_sizes (ValueError
    otherwise): what a --mesh flag is checked with before anything is loaded."""
    check_mesh_sizes(parse_mesh_spec(spec))
    return spec


# What a CLI's --mesh flag takes (zaya_jax/runtime/cli.py): an axis=size spec, or with MESH_FLAG none / auto.
MESH_SPEC_FLAG = cli.Parsed(
    checked_mesh_spec,
    f"axis=size,... (axes {', '.join(MESH_AXES)}; sizes >= 1, one may be -1)",
    invalid=("data=0", "data=-2", "nope=2"),
)
MESH_FLAG = cli.OneOf("none", "auto", other=MESH_SPEC_FLAG)


def resolve_mesh_shape(*sizes: int, num_devices: int) -> tuple[int, ...]:
    """Sizes in MESH_AXES order with a -1 filled; ValueError unless they multiply to `num_devices`."""
    return tuple(resolve_mesh_sizes(dict(zip(MESH_AXES, sizes)), num_devices, exact=True).values())


def make_mesh(
    *sizes: int,
    num_experts: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    **named: int,
) -> Mesh:
    """A mesh over `devices` (default: all, across processes). Sizes by position in MESH_AXES order
    or by name (make_mesh(2, 1, 4) == make_mesh(data=2, expert=4)); unnamed axes as DEFAULT_SIZES."""
    devices = list(devices) if devices is not None else jax.devices()
    spec = {**dict(zip(MESH_AXES, sizes)), **named}
    shape = tuple(resolve_mesh_sizes(parse_mesh_spec(spec), len(devices), exact=True).values())
    expert = shape[MESH_AXES.index("expert")]
    if num_experts is not None and num_experts % expert:
        raise ValueError(f"mesh.expert={expert} does not divide model.num_experts={num_experts}")
    # Auto axes: XLA propagates shardings from the ones we set on params, state and batches.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if devices == jax.devices():
        # jax.make_mesh orders devices so that inner axes stay within a host/node (fast links).
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def device_platform(device: jax.Device) -> str:
    """The compiler a device's programs go through: "cpu", "cuda", "rocm" or "tpu". A GPU device
    (real, or one of a deviceless GPU topology, zaya_jax/runtime/gpu_target.py) reports "gpu" as its
    platform; its client names the vendor (jax reads the same attribute to pick the lowering)."""
    client = getattr(device, "client", None)
    raw = getattr(client, "_raw_platform", None) or device.platform
    if raw == "gpu":  # an older client: the vendor is in its version string
        raw = "rocm" if "rocm" in str(getattr(client, "platform_version", "")).lower() else "cuda"
    return raw


def mesh_platform(mesh: Mesh | None) -> str:
    """The platform (`device_platform`) of the devices a mesh's programs are compiled for; without
    a mesh, the default device's (where an un-meshed jit runs). Every backend choice (kernels'
    Triton vs interpret, the `auto` impls) reads this, never the process' default backend: a dry
    run compiles for GPU devices from a CPU process."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    return device_platform(device)


def mesh_from_config(c, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of a training config (`mesh.<axis>` for every axis) over `devices` (default: all),
    validated against them."""
    sizes = {a: c.mesh[a] for a in MESH_AXES}
    return make_mesh(num_experts=c.model.num_experts, devices=devices, **sizes)
