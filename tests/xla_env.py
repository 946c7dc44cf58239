"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices, and XLA:CPU's default fusion emitters named explicitly (COMPILE_FLAGS), so `python -m
zaya_jax.train` keeps them (its train.lean_cpu_compile trades 20-45% longer compiles for a lower
peak, zaya_jax/runtime/host_memory.py; the suite compiles hundreds of programs). tests/test_train.py runs the
CLI once with the trainer's default.

Not here: `--xla_backend_optimization_level=0` (LLVM unoptimised; 20% off four test files) keeps
the optimized HLO but not the rounding of the machine code: one device and a 2 x 2 mesh then scored
an lm-eval perplexity 1.5e-6 apart (tests/test_lm_eval_backend.py asks 1e-6, and meets it as users
compile).

Nor `--xla_llvm_disable_expensive_passes=true` (no loop unrolling or vectorization in LLVM): the
same rounding (lm-eval's 1e-6 between meshes held) and tests/test_train_state.py alone took 218
instead of 248 s, but the whole suite on a clean clone did not move (729 passed in 3,638 s with it,
3,637 s without; its slowest tests 2% slower in sum): the CLI tests' compiles are not LLVM-bound.
"""

COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=true"

# Compile options for a test's programs that run once or for a few steps (`.compile(FAST_COMPILE)`):
# LLVM's optimisation of the CPU code costs more compile time than it saves there. The partitioner
# and every HLO pass run as usual, so the optimised HLO (its collectives, memory_analysis's
# temporaries) is the default compile's. Both sides of a comparison are compiled with them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
