"""Checks that Pallas kernels lower through the Triton path for a GPU platform, without a GPU
(shared by the kernel tests)."""

import jax

from zaya_jax.kernels.flops import FLOPS_TAG


def lowered_triton_kernels(monkeypatch, fn, *avals, platform, flops=False):
    """Lower jit(fn) for a GPU platform without a GPU; names of the pallas_calls that went through
    the Pallas Triton lowering, each Triton module checked by the MLIR verifier (with `flops`:
    (name, the dot FLOPs its tag declares) pairs)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    seen, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def spy(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        assert result.module.operation.verify()
        name, _, declared = jaxpr.debug_info.func_name.rpartition(FLOPS_TAG)  # FLOPs after the tag
        seen.append((name, int(declared)) if flops else name)
        return result

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", spy)
    jax.jit(fn).trace(*avals).lower(lowering_platforms=(platform,))
    return seen
