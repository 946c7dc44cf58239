"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices and XLA:CPU's fusion emitters named explicitly, so that `python -m zaya_jax.train` keeps
what a test asks (its train.lean_cpu_compile turns them off where XLA_FLAGS is silent,
zaya_jax/runtime/host_memory.py). tests/test_train.py runs the CLI once with the trainer's default.

Tests compile fast (FAST_COMPILE_FLAGS, the default of `xla_flags`): they run tiny models once or
for a few steps, where LLVM's optimisation costs more than it saves, with the fusion emitters off,
which halves a train step's compile at LLVM's lowest level, and as one LLVM module
(docs/performance.md, "Test suite"). The test process (tests/conftest.py) and its subprocesses
compile alike, so numbers a test compares across processes round alike
(tests/test_lm_eval_backend.py asks 1e-6 between one device and a 2 x 2 mesh in two processes).
`xla_flags(n, fast=False)` keeps XLA's default code generation with the emitters on
(COMPILE_FLAGS), for a run that checks a user's flag stands.
"""

COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=true"

# FAST_COMPILE_FLAGS as compile options, for a test's heavy programs (`.compile(FAST_COMPILE)`):
# they compile fast whatever XLA_FLAGS the suite was started with. The partitioner and the HLO passes
# run: a train step's optimised HLO has the default compile's collectives, and memory_analysis's
# temporaries within 0.1% of it. Both sides of a comparison are compiled with them.
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    # One LLVM module, not XLA's 32 compiled on parallel threads: the suite's two workers keep both
    # cores busy, so splitting (cloning the module 32 ways) only adds work (docs/performance.md).
    "xla_cpu_parallel_codegen_split_count": 1,
}

# XLA's default code generation as compile options (`.compile(XLA_DEFAULT_COMPILE)`), for a check
# made on what users compile: the HLO of XLA's default pipeline (the fusion emitters change which
# instructions CSE merges), or a rounding gap a tolerance was set on.
XLA_DEFAULT_COMPILE = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
    "xla_cpu_use_fusion_emitters": True,
    "xla_cpu_parallel_codegen_split_count": 32,
}

# XLA_FLAGS' form of FAST_COMPILE: the test process' and its subprocesses' (`xla_flags(n)`).
FAST_COMPILE_FLAGS = " ".join(f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE.items())


def xla_flags(devices: int, fast: bool = True) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS if fast else COMPILE_FLAGS}"
