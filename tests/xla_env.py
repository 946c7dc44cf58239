"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices and XLA:CPU's fusion emitters named explicitly, so that `python -m zaya_jax.train` keeps
what a test asks (its train.lean_cpu_compile turns them off where XLA_FLAGS is silent,
zaya_jax/runtime/host_memory.py). tests/test_train.py runs the CLI once with the trainer's default.

The subprocesses compile fast (FAST_COMPILE_FLAGS): they train tiny models for a few steps, where
LLVM's optimisation costs more than it saves, and with the fusion emitters off, which halves a
train step's compile at LLVM's lowest level (docs/performance.md, "Test suite"). The test process
itself keeps the optimised machine code and XLA's default emitters, and so does every subprocess
whose numbers are compared with the test process' own to rounding (`xla_flags(n, fast=False)`, or
no XLA_FLAGS of ours): unoptimised code rounds differently, and one device and a 2 x 2 mesh then
scored an lm-eval perplexity 1.5e-6 apart (tests/test_lm_eval_backend.py asks 1e-6, and meets it as
users compile). The test process' heavy programs take the same options one by one (FAST_COMPILE).
"""

COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=true"

# Compile options for a test's programs that run once or for a few steps (`.compile(FAST_COMPILE)`):
# LLVM's optimisation of the CPU code costs more compile time than it saves there, and XLA's
# fusion emitters double the compile. The partitioner and every HLO pass run as usual: the
# optimised HLO has the default compile's collectives, and memory_analysis's temporaries within
# 0.1% of it. Both sides of a comparison are compiled with them.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}

# XLA_FLAGS' form of FAST_COMPILE, for the CLI subprocesses tests start (`xla_flags(n)`): they run
# tiny models for a few steps. Subprocesses that must round as users compile take `fast=False`.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false"
)


def xla_flags(devices: int, fast: bool = True) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS if fast else COMPILE_FLAGS}"
