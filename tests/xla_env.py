"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices, and XLA:CPU's default fusion emitters named explicitly (COMPILE_FLAGS), so `python -m
zaya_jax.train` keeps them (its train.lean_cpu_compile trades 20-45% longer compiles for a lower
peak, zaya_jax/host_memory.py; the suite compiles hundreds of programs). tests/test_train.py runs the
CLI once with the trainer's default.

COMPILE_FLAGS also skips LLVM's expensive passes (`--xla_llvm_disable_expensive_passes`: no loop
unrolling or vectorization of XLA's own loops; the dots are library calls either way): the suite is
compile-bound, and tests/test_train_state.py took 218 s instead of 248 s with it. The same optimized
HLO and instruction selection, so the same rounding: test_lm_eval_backend.py's 1e-6 between meshes
and test_parallel.py's mesh comparisons pass with it.

Not here: `--xla_backend_optimization_level=0` (LLVM unoptimised; 20% off four test files) keeps
the optimized HLO but not the rounding of the machine code: one device and a 2 x 2 mesh then scored
an lm-eval perplexity 1.5e-6 apart (tests/test_lm_eval_backend.py asks 1e-6, and meets it as users
compile).
"""

COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=true --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
