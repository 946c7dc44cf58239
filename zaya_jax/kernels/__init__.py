"""Pallas kernels (Triton lowering) for the ZAYA1 hot spots, each with its pure-XLA reference, and
the plain-XLA tiled grouped matmul (sparse on every backend; moe_impl="auto" on CPU).

  flash_attention / reference_attention     the CCA attention core (zaya_jax.model.attention)
  blockwise_attention                        plain-XLA flash attention (any backend; long sequences)
  grouped_matmul / reference_grouped_matmul  ragged expert GEMM (jax.lax.ragged_dot), + tgmm
  swiglu_grouped_pallas                      zaya_jax.model.moe.swiglu_grouped on the kernels
  tiled_grouped_matmul                       plain-XLA megablox grouped matmul (row tiles per group)
  newton_schulz / reference_newton_schulz    Muon's orthogonalisation (zaya_jax.optim.muon)
  pick_blocks                                block sizes per kernel / shape / dtype

Every kernel takes `interpret=` and `platform=`; pass `**kernel_options(platform)` with the platform
of the devices the program is compiled for ("cpu" / "cuda" / "rocm", zaya_jax.parallel.mesh.
mesh_platform): the kernel body runs as plain JAX on CPU (tests, CI) and as compiled Triton, with
that GPU's warp counts, on GPUs. Nothing here reads the process' default backend: a dry run
compiles for GPU devices from a CPU process.
"""

from __future__ import annotations

from typing import Any

from zaya_jax.kernels.block_sizes import BLOCKWISE_AUTO_MIN_SEQ, pick_blocks
from zaya_jax.kernels.blockwise_attention import blockwise_attention
from zaya_jax.kernels.flash_attention import flash_attention, reference_attention, reference_mask
from zaya_jax.kernels.grouped_matmul import (
    grouped_matmul,
    reference_grouped_matmul,
    swiglu_grouped_pallas,
    tgmm,
)
from zaya_jax.kernels.newton_schulz import newton_schulz, reference_newton_schulz
from zaya_jax.kernels.tiled_grouped_matmul import tiled_grouped_matmul

# Which backends each kernel compiles for. All kernels are `pl.pallas_call` with
# `jax.experimental.pallas.triton.CompilerParams`, i.e. the Pallas Triton lowering: the one Pallas
# GPU path that exists on ROCm (AMD MI300X) as well as CUDA (NVIDIA). No Mosaic GPU, no TPU
# features (no scalar prefetch, no scratch refs, no megacore). On CPU they only run in interpret
# mode (the kernel body executed as ordinary XLA ops; slow, for correctness only). The test suite
# checks on CPU that every kernel lowers to Triton IR for both "cuda" and "rocm"; compiling that IR
# to a GPU binary and the numerics on hardware are checked by `benchmarks/kernels.py` on a GPU.
SUPPORTED: dict[str, dict[str, str]] = {
    "flash_attention": {"gpu": "triton (cuda, rocm)", "cpu": "interpret only", "tpu": "no"},
    "grouped_matmul": {"gpu": "triton (cuda, rocm)", "cpu": "interpret only", "tpu": "no"},
    "tgmm": {"gpu": "triton (cuda, rocm)", "cpu": "interpret only", "tpu": "no"},
    "swiglu_grouped_pallas": {"gpu": "triton (cuda, rocm)", "cpu": "interpret only", "tpu": "no"},
    "newton_schulz": {"gpu": "triton (cuda, rocm)", "cpu": "interpret only", "tpu": "no"},
}


GPU_PLATFORMS = ("cuda", "rocm")  # the platforms with a Pallas Triton lowering
# Where optim.muon.ns_impl="auto" is the Pallas kernel: on CUDA XLA's cuBLAS GEMMs run Muon's
# Newton-Schulz faster than the kernel on every measured shape (docs/performance.md, `kernels`);
# ROCm is not measured.
NS_AUTO_PALLAS = ("rocm",)
# Where the XLA Newton-Schulz iterates a stack's slices one after the other (`orthogonalize`'s
# per_slice): XLA:CPU runs 2-D matmul chains faster than one batched chain on Muon's expert stacks
# (docs/performance.md, "Choices inside the code"), and holds one slice's temporaries instead of
# the stack's. GPUs keep the batched chain.
NS_PER_SLICE = ("cpu",)


def interpret_on(platform: str) -> bool:
    """True on CPU (no Triton there: the kernels run interpreted), False on a GPU platform."""
    return platform == "cpu"


def kernel_options(platform: str) -> dict[str, Any]:
    """The keywords every kernel takes for a program compiled for `platform`: interpret on CPU,
    Triton with the platform's block sizes / warps on GPUs."""
    return {"interpret": interpret_on(platform), "platform": platform}


def use_pallas(impl: str, platform: str, auto_on: tuple[str, ...] = GPU_PLATFORMS) -> bool:
    """Resolves a config's kernel choice: "pallas" -> True; "auto" -> True on the platforms
    `auto_on` (every GPU platform unless the kernel's measurements say otherwise, NS_AUTO_PALLAS)."""
    return impl == "pallas" or (impl == "auto" and platform in auto_on)


def attention_choice(impl: str, platform: str, seq_len: int) -> str:
    """Resolves model.attention_impl for keys of `seq_len` positions to "pallas", "blockwise" or
    "xla": "auto" is Pallas on a GPU platform (a context rank's chunk too: its query offset is a
    kernel operand), else blockwise from BLOCKWISE_AUTO_MIN_SEQ keys on (measured on XLA:CPU,
    kernels/block_sizes.py) and the dense XLA softmax below it."""
    if use_pallas(impl, platform):
        return "pallas"
    if impl == "blockwise" or (impl == "auto" and seq_len >= BLOCKWISE_AUTO_MIN_SEQ):
        return "blockwise"
    return "xla"


def ns_choice(impl: str, platform: str) -> str:
    """Resolves optim.muon.ns_impl on `platform` to "pallas", "xla per slice" or "xla": "auto" is the
    Pallas kernel on NS_AUTO_PALLAS; XLA's iteration runs slice by slice on NS_PER_SLICE."""
    if use_pallas(impl, platform, auto_on=NS_AUTO_PALLAS):
        return "pallas"
    return "xla per slice" if platform in NS_PER_SLICE else "xla"


def check_backend(platform: str, *impls: str) -> None:
    """Start-up check: a Pallas choice for devices without the Triton lowering (TPU) is an error
    here, with the fix named, instead of a lowering failure deep inside jit."""
    if any(use_pallas(i, platform) for i in impls) and platform not in (*GPU_PLATFORMS, "cpu"):
        raise ValueError(
            f"Pallas kernels (model.attention_impl / model.moe_impl / optim.muon.ns_impl = "
            f"'pallas') use the Triton lowering, which platform {platform!r} lacks; use 'xla' "
            "or 'auto'"
        )


__all__ = [
    "GPU_PLATFORMS",
    "NS_AUTO_PALLAS",
    "NS_PER_SLICE",
    "SUPPORTED",
    "attention_choice",
    "blockwise_attention",
    "check_backend",
    "flash_attention",
    "grouped_matmul",
    "interpret_on",
    "kernel_options",
    "newton_schulz",
    "ns_choice",
    "pick_blocks",
    "reference_attention",
    "reference_grouped_matmul",
    "reference_mask",
    "reference_newton_schulz",
    "swiglu_grouped_pallas",
    "tgmm",
    "tiled_grouped_matmul",
    "use_pallas",
]
