"""GPU targets compiled for without a GPU: N devices of an H100 or MI300X topology in a CPU process.

    target = load_target("mi300x")            # or "h100", or a GpuTargetConfig text file
    prepare_process()                          # before jax starts: JAX_PLATFORMS=cpu
    devices = target_devices(target, 64)       # 8 hosts x 8 GPUs, deviceless
    jax.jit(f, in_shardings=...).lower(*abstract_args).compile()   # XLA's GPU compiler

How it works and the facts it rests on: docs/design/gpu-compile.md.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import os
import re
import shutil
import struct
import tempfile
from importlib import resources
from typing import Any

from zaya_jax.runtime import cli, xla_flags

GIB = 2**30
DEVICES_PER_HOST = 8  # a node of 8 GPUs: the topology's hosts x devices


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU kind to compile for: its XLA target config and the memory a step must fit in."""

    name: str  # for reports: "MI300X", "H100 SXM", or the config file's device description
    platform: str  # "cuda" | "rocm": the PJRT plugin that compiles for it
    config_text: str  # a GpuTargetConfigProto in text format
    memory_bytes: int  # device memory per GPU (the product's figure)
    arch: str  # "sm_90", "gfx942", ...: what its device code is compiled for


# name -> (platform, spec file in zaya_jax/gpu_targets, product memory in GiB, report name)
TARGETS: dict[str, tuple[str, str, int, str]] = {
    "mi300x": ("rocm", "mi300x.txtpb", 192, "MI300X"),
    "h100": ("cuda", "h100_sxm.txtpb", 80, "H100 SXM"),
    "h200": ("cuda", "h100_sxm.txtpb", 140, "H200"),  # sm_90 like H100: its spec with H200's memory
}


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError("no such file")
    return path


# What `train --dry_run_target` takes (zaya_jax/runtime/cli.py): cpu, a name of TARGETS or a target file
# (whose contents load_target checks).
TARGET_FLAG = cli.OneOf(
    "cpu",
    *TARGETS,
    other=cli.Parsed(_existing_file, "a GpuTargetConfig text file", invalid=("/nonexistent/target.txtpb",)),
)


def _field(text: str, key: str) -> str | None:
    """The first `key: value` of a text-format proto (quotes stripped), None when absent."""
    for line in text.splitlines():
        name, sep, value = line.strip().partition(":")
        if sep and name == key:
            return value.strip().strip('"')
    return None


def _arch(text: str, platform: str) -> str:
    """ "gfx942" / "sm_90": the ISA the target's device code is compiled for."""
    if platform == "rocm":
        return (_field(text, "gcn_arch_name") or "gfx?").split(":")[0]
    block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    major = re.search(r"\bmajor:\s*(\d+)", block.group(1)) if block else None
    minor = re.search(r"\bminor:\s*(\d+)", block.group(1)) if block else None
    return f"sm_{major.group(1)}{minor.group(1) if minor else 0}" if major else "sm_?"


def load_target(spec: str) -> GpuTarget:
    """`spec`: a name of TARGETS, or the path of a GpuTargetConfigProto text file (e.g. written on a
    GPU machine for another jaxlib, docs/conventions.md); such a file's device_memory_size is the
    memory checked. OSError / ValueError (one line) for a missing file or an unknown kind."""
    if spec in TARGETS:
        platform, filename, gib, name = TARGETS[spec]
        text = resources.files("zaya_jax").joinpath("gpu_targets", filename).read_text()
        if not filename.startswith(spec):  # another product's spec: its memory is what XLA plans for
            text = re.sub(r"device_memory_size: \d+", f"device_memory_size: {gib * GIB}", text)
        return GpuTarget(name, platform, text, gib * GIB, _arch(text, platform))
    if not os.path.isfile(spec):
        known = ", ".join(["cpu", *TARGETS])
        raise ValueError(f"--dry_run_target={spec!r}: neither one of {known} nor a target config file")
    with open(spec) as f:
        text = f.read()
    platform = {"CUDA": "cuda", "ROCM": "rocm"}.get(_field(text, "platform_name") or "")
    memory = _field(text, "device_memory_size")
    if platform is None or not (memory or "").isdigit():
        raise ValueError(
            f"--dry_run_target={spec!r}: not a GpuTargetConfig text file (needs platform_name CUDA or "
            "ROCM and gpu_device_info.device_memory_size)"
        )
    name = _field(text, "device_description_str") or os.path.basename(spec)
    return GpuTarget(name, platform, text, int(memory), _arch(text, platform))


def prepare_process() -> None:
    """Pin jax to its CPU platform before its backends start (the CUDA plugin would otherwise
    check for a driver and drop out). Afterwards a process already on CPU is fine; one that started
    on another platform cannot compile deviceless: ValueError."""
    import jax
    from jax._src import xla_bridge

    from zaya_jax.runtime import gpu_plugins

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        gpu_plugins.register_plugins()  # now, with CUDA's version check skipped, notices dropped
    elif jax.devices()[0].platform != "cpu":
        raise ValueError(
            "a GPU dry run compiles from a CPU process, but jax already started on "
            f"{jax.devices()[0].platform}: run it in a fresh process"
        )


def topology_name(n: int) -> str:
    """XLA's topology string partitions x hosts x devices per host for n GPUs: one host up to 8,
    else hosts of 8 (n must divide)."""
    if n < 1 or (n > DEVICES_PER_HOST and n % DEVICES_PER_HOST):
        raise ValueError(
            f"--dry_run_devices={n}: a GPU target takes up to {DEVICES_PER_HOST} devices or a multiple "
            f"of {DEVICES_PER_HOST} (hosts of {DEVICES_PER_HOST} GPUs)"
        )
    hosts = max(1, n // DEVICES_PER_HOST)
    return f"1x{hosts}x{n // hosts}"


def target_devices(target: GpuTarget, n: int) -> list[Any]:
    """`n` deviceless devices of `target` (call `prepare_process` first, before jax starts)."""
    from jax.experimental import topologies

    name = topology_name(n)
    if target.platform == "rocm":
        _register_rocm()
    try:
        topo = topologies.get_topology_desc(
            platform=target.platform, target_config=target.config_text, topology=name
        )
    except NotImplementedError:
        raise ValueError(_no_plugin(target.platform)) from None
    return list(topo.devices)


KERNEL_CACHE = "xla_gpu_kernel_cache_file"  # XLA's option: a file of compiled GPU kernels


def kernel_cache_options(platform: str, device_kind: str) -> dict[str, str]:
    """The compiler option that gives a GPU compile XLA's kernel cache: {KERNEL_CACHE: file}. A
    kernel already in the file is not compiled again (its device code is copied), so the compiles
    of one dry run (the fit search's remat policies, microbatches and layouts) and later dry runs
    share them. XLA keys a kernel by its fused computation, not by the GPU it was compiled for:
    each device kind and jaxlib has its own file, in jax's compilation cache directory when one is
    set and is a local directory this process can write to, else in a directory of this process,
    removed at exit (the cache is a speed-up: it never stops a compile). {} for a CPU compile, or
    where XLA_FLAGS names the option (the user's file stands)."""
    if platform not in ("cuda", "rocm") or xla_flags.current("--" + KERNEL_CACHE) is not None:
        return {}
    import jaxlib

    kind = re.sub(r"[^\w.-]+", "_", device_kind).strip("_")
    name = f"{platform}-{kind}-jaxlib{jaxlib.__version__}.pb"
    return {KERNEL_CACHE: os.path.join(_kernel_folder(_compilation_cache_dir()), name)}


def _kernel_folder(cache_dir: str | None) -> str:
    """`xla_gpu_kernels` in jax's compilation cache directory where that is a local directory that
    can be made and written, else the process' own folder (a remote cache, gs://..., is jax's
    to read; XLA opens the kernel file as a local path)."""
    if cache_dir and "://" not in cache_dir:
        folder = os.path.join(cache_dir, "xla_gpu_kernels")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return _process_folder()
        if os.access(folder, os.W_OK):
            return folder
    return _process_folder()


def _compilation_cache_dir() -> str | None:
    import jax

    return jax.config.jax_compilation_cache_dir


@functools.cache
def _process_folder() -> str:
    folder = tempfile.mkdtemp(prefix="zaya_jax_gpu_kernels_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _no_plugin(platform: str) -> str:
    package = {"cuda": "jax-cuda12-plugin / jax-cuda12-pjrt", "rocm": "jax-rocm7-plugin / jax-rocm7-pjrt"}
    return (
        f"no {platform.upper()} compiler in this process: install {package[platform]} "
        "(pip install -e '.[gpu_compile]', the version of jaxlib) and run with JAX_PLATFORMS unset or cpu"
    )


# The OS/ABI byte of a device-code ELF: cubin (ELFOSABI_CUDA) or HSACO (ELFOSABI_AMDGPU_HSA). The
# serialized executable stores its objects compressed past their first bytes, so the ELF identity
# (magic, 64-bit, little-endian, version 1, OS/ABI) is what can be read from it.
DEVICE_CODE = {0x33: "cubin", 0x40: "hsaco"}
_ELF64_LE = b"\x7fELF\x02\x01\x01"


def device_code(compiled: Any, target: GpuTarget) -> dict[str, int]:
    """Device-code objects in a compiled step's executable by kind ("cubin" / "hsaco"), and
    "arch" = how often the target's ISA name (sm_90, gfx942) is named in it: proof that XLA ran
    the GPU backend (ptxas / the AMDGPU backend) rather than only the HLO passes."""
    blob = compiled.runtime_executable().serialize()
    counts = {"cubin": 0, "hsaco": 0}
    start = blob.find(_ELF64_LE)
    while start >= 0:
        kind = DEVICE_CODE.get(blob[start + 7]) if start + 7 < len(blob) else None
        if kind:
            counts[kind] += 1
        start = blob.find(_ELF64_LE, start + 1)
    counts["arch"] = blob.count(target.arch.encode())
    return counts


# ------------------------------------------------------------------------------------------ ROCm
def _register_rocm() -> None:
    """Registers the ROCm PJRT plugin's topology factory on a machine without an AMD GPU.

    The plugin's `initialize()` asks `hardware_utils.num_available_amd_gpus` and refuses at 0; a
    compile needs no GPU, so the count is taken as 1 while it registers (restored at once). Its
    library must load: the ROCm 7 runtime libraries it links are checked first, by name."""
    from jax._src import hardware_utils
    from jax._src import xla_bridge as xb

    if "rocm" in xb._topology_factories:
        return
    try:
        import jax_plugins.xla_rocm7 as plugin
    except ImportError:
        raise ValueError(_no_plugin("rocm")) from None
    library = plugin._get_library_path()
    if library is None:
        raise ValueError(_no_plugin("rocm"))
    missing = missing_libraries(str(library))
    if missing:
        raise ValueError(
            f"the ROCm compiler ({os.path.basename(library)}) needs the ROCm 7 libraries "
            f"{', '.join(missing)}, not found: install ROCm 7 (a login node of a ROCm cluster has them; "
            "add its lib directory to LD_LIBRARY_PATH) or use --dry_run_target=h100"
        )
    count = hardware_utils.num_available_amd_gpus
    hardware_utils.num_available_amd_gpus = lambda stop_at=None: 1
    try:
        if xb._plugins_registered:  # jax started already (its discovery logged the refusal)
            plugin.initialize()
        else:
            xb._discover_and_register_pjrt_plugins()
    finally:
        hardware_utils.num_available_amd_gpus = count
    if "rocm" not in xb._topology_factories:
        raise ValueError("the ROCm PJRT plugin did not register (see the log above)")


def needed_libraries(path: str) -> list[str]:
    """The DT_NEEDED sonames of an ELF64 little-endian shared library (its dynamic section)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return []
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        f.seek(shoff)
        sections = [struct.unpack_from("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]
        names = []
        for sh in sections:
            if sh[1] != 6:  # SHT_DYNAMIC: (d_tag, d_val) pairs; its sh_link is the string table
                continue
            f.seek(sh[4])
            dynamic = f.read(sh[5])
            strtab = sections[sh[6]]
            f.seek(strtab[4])
            strings = f.read(strtab[5])
            for tag, val in struct.iter_unpack("<qQ", dynamic):
                if tag == 1:  # DT_NEEDED
                    names.append(strings[val : strings.index(b"\0", val)].decode())
        return names


def missing_libraries(path: str) -> list[str]:
    """The libraries `path` links that the dynamic loader cannot find (loaded ones count as found)."""
    missing = []
    for name in needed_libraries(path):
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing
