"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices, and the flags of every compile of the suite (COMPILE_FLAGS):
- XLA:CPU's default fusion emitters named explicitly, so `python -m zaya_jax.train` keeps them (its
  train.lean_cpu_compile trades 20-45% longer compiles for a lower peak, zaya_jax/host_memory.py);
  tests/test_train.py runs the CLI once with the trainer's default;
- no LLVM optimisation of the generated code (XLA's HLO passes all run, so the programs, their
  collectives and their numerics are the ones users run; only the machine code is less tuned):
  the suite compiles hundreds of programs and runs each for a few tiny steps, where compiling is
  most of the time (45 tests of four files: 408 -> 326 s).
"""

COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=true --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
