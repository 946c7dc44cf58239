"""The XLA_FLAGS of the test process and of the subprocesses tests start: `devices` simulated CPU
devices, and XLA:CPU's default fusion emitters named explicitly, so `python -m zaya_jax.train` keeps
them (its train.lean_cpu_compile trades 20-45% longer compiles for a lower peak, zaya_jax/host_memory.py;
the suite compiles hundreds of programs). tests/test_train.py runs the CLI once with the trainer's
default."""

DEFAULT_EMITTERS = "--xla_cpu_use_fusion_emitters=true"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {DEFAULT_EMITTERS}"
