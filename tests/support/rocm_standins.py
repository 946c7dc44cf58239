"""Compile-only stand-ins for the ROCm 7 libraries the ROCm PJRT plugin links (tests only).

`xla_rocm_plugin.so` (jax-rocm7-plugin) links libamdhip64, hipBLASLt, rocBLAS, MIOpen, RCCL, hipFFT,
rocm_smi and rocprofiler-sdk; CI has no ROCm. Compiling for an MI300X calls none of their functions
beyond load-time registration, so each library here is built from the plugin's own undefined
symbols (`nm -D --undefined-only`): every one a function that returns 1 (an error code for every
HIP / BLAS / MIOpen call), under the symbol versions the plugin asks for (`readelf -V`). They are
loaded into the test process with RTLD_GLOBAL before the plugin: the dynamic loader then resolves
the plugin's DT_NEEDED names (by soname) to them. Never shipped with the package: a real install
(a ROCm login node) uses the real libraries (docs/conventions.md).

Needs gcc, nm and readelf (gcc and binutils are on the CI image, as on every developer machine of
this project); `standins(tmpdir)` returns None, with the reason, when one is missing.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import os
import re
import shutil
import subprocess
import sys

ROCM_LIBS = (
    "libamdhip64.so.7",
    "librocprofiler-sdk.so.1",
    "librccl.so.1",
    "libhipblaslt.so.1",
    "libhipfft.so.0",
    "libMIOpen.so.1",
    "librocblas.so.5",
    "librocm_smi64.so.1",
)
SYSTEM_VERSIONS = re.compile(r"^(GLIBC|GLIBCXX|CXXABI|GCC)_")


def plugin_library() -> str | None:
    """The plugin's library, found without importing the plugin (its import loads the extension
    once, which must come after the stand-ins)."""
    import importlib.util

    spec = importlib.util.find_spec("jax_plugins.xla_rocm7")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "xla_rocm_plugin.so")
    return path if os.path.exists(path) else None


def linked_files() -> list[str]:
    """The plugin's library and its Python extension (custom calls; links libamdhip64 too)."""
    import importlib.util

    spec = importlib.util.find_spec("jax_rocm7_plugin.rocm_plugin_extension")
    return [plugin_library(), *([spec.origin] if spec and spec.origin else [])]


def _version_owners(plugin: str) -> dict[str, str]:
    """{symbol version: the library that must define it}, from the plugin's version needs."""
    out, owner = {}, None
    listing = subprocess.run(["readelf", "-V", plugin], capture_output=True, text=True, check=True).stdout
    for line in listing.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            owner = m.group(1)
        m = re.search(r"Name: (\S+)", line)
        if m and owner in ROCM_LIBS:
            out[m.group(1)] = owner
    return out


def _symbols(plugin: str) -> list[tuple[str, str | None]]:
    """(name, version or None) of every strong undefined symbol outside the C/C++ runtime (whose
    symbols are all versioned GLIBC_* / GLIBCXX_* / CXXABI_* / GCC_*; ROCm's C++ API is not)."""
    nm = subprocess.run(
        ["nm", "-D", "--undefined-only", plugin], capture_output=True, text=True, check=True
    ).stdout
    out = []
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0] != "U":  # "w": weak, may stay undefined
            continue
        name, _, version = parts[1].partition("@")
        if (version and SYSTEM_VERSIONS.match(version)) or not re.fullmatch(r"[A-Za-z_]\w*", name):
            continue
        out.append((name, version or None))
    return out


def build(tmpdir: str) -> list[str]:
    """Builds the stand-ins in tmpdir; their paths, in ROCM_LIBS order."""
    files = linked_files()
    owners = {v: lib for f in files for v, lib in _version_owners(f).items()}
    per_lib: dict[str, list[tuple[str, str | None]]] = collections.defaultdict(list)
    for name, version in sorted({s for f in files for s in _symbols(f)}, key=str):
        per_lib[owners.get(version, ROCM_LIBS[0]) if version else ROCM_LIBS[0]].append((name, version))
    paths = []
    for lib in ROCM_LIBS:
        syms = per_lib.get(lib, [])
        c_file, map_file = os.path.join(tmpdir, lib + ".c"), os.path.join(tmpdir, lib + ".map")
        with open(c_file, "w") as f:
            f.write("".join(f"long {name}(void) {{ return 1; }}\n" for name, _ in syms))
        versions = collections.defaultdict(list)
        for name, version in syms:
            versions[version].append(name)
        for version, lib_owner in owners.items():
            if lib_owner == lib:
                versions.setdefault(version, [])
        with open(map_file, "w") as f:
            listed = lambda names: "global: " + " ".join(n + ";" for n in names) + " " if names else ""
            for version, names in versions.items():
                if version is not None:
                    f.write(f"{version} {{ {listed(names)}}};\n")
            f.write(f"ZAYA_STANDIN {{ {listed(versions.get(None, []))}local: *; }};\n")
        out = os.path.join(tmpdir, lib)
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O0",
                "-w",
                f"-Wl,-soname,{lib}",
                f"-Wl,--version-script={map_file}",
                "-o",
                out,
                c_file,
            ],
            check=True,
        )
        paths.append(out)
    return paths


def standins(tmpdir: str) -> str | None:
    """Builds and loads the stand-ins (RTLD_GLOBAL) unless the real libraries are there; None when
    ready, else why they cannot be built."""
    plugin = plugin_library()
    if plugin is None:
        return "jax-rocm7-plugin is not installed (pip install -e '.[gpu_compile]')"
    from zaya_jax.runtime.gpu_target import missing_libraries

    if not missing_libraries(plugin):
        return None  # a real ROCm install (or stand-ins loaded already)
    tools = [t for t in ("gcc", "nm", "readelf") if shutil.which(t) is None]
    if tools:
        return f"building the ROCm stand-ins needs {', '.join(tools)} (apt-get install gcc binutils)"
    for path in build(tmpdir):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    # jax's plugin discovery imported the plugin before (refusing: no AMD GPU), when its Python
    # extension (custom call handlers; links libamdhip64) could not load yet: load it now.
    plugin = sys.modules.get("jax_plugins.xla_rocm7")
    if plugin is not None and plugin.rocm_plugin_extension is None:
        plugin.rocm_plugin_extension = importlib.import_module("jax_rocm7_plugin.rocm_plugin_extension")
    return None
