"""Multi-process start-up: `jax.distributed.initialize` from the environment.

Recognised, in order:
  ZAYA_COORDINATOR=host:port, ZAYA_NUM_PROCESSES=N, ZAYA_PROCESS_ID=i   explicit (e.g. launch/local_multiprocess.sh)
  SLURM (SLURM_JOB_ID with SLURM_NTASKS > 1)                            jax derives everything from srun
Anything else: a single process, nothing to do.
"""

from __future__ import annotations

import os

import jax


def initialize_from_env(env: dict[str, str] | None = None) -> bool:
    """Initialises jax.distributed when the environment describes a multi-process job.

    Returns True when it did. Must run before anything touches a device.
    """
    env = dict(os.environ if env is None else env)
    if env.get("ZAYA_COORDINATOR"):
        missing = [k for k in ("ZAYA_NUM_PROCESSES", "ZAYA_PROCESS_ID") if not env.get(k)]
        if missing:
            raise ValueError(f"ZAYA_COORDINATOR is set but {missing} are not")
        kwargs = {}
        if env.get("ZAYA_LOCAL_DEVICE_IDS"):
            kwargs["local_device_ids"] = [int(i) for i in env["ZAYA_LOCAL_DEVICE_IDS"].split(",")]
        jax.distributed.initialize(
            coordinator_address=env["ZAYA_COORDINATOR"],
            num_processes=int(env["ZAYA_NUM_PROCESSES"]),
            process_id=int(env["ZAYA_PROCESS_ID"]),
            **kwargs,
        )
        return True
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()  # cluster auto-detection reads the SLURM variables
        return True
    return False


BARRIER_TIMEOUT_MS = 3_600_000


def barrier(name: str, timeout_ms: int = BARRIER_TIMEOUT_MS) -> None:
    """Waits until every process has reached the barrier `name` (each name used once), through the
    coordination service on the hosts (a no-op with one process). For host-side work of uneven
    length before a device collective: XLA:CPU's cross-process collectives give up when the other
    processes arrive more than 30 s later ("Gloo context initialization failed: DEADLINE_EXCEEDED")."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize connected

    distributed.global_state.client.wait_at_barrier(name, timeout_ms)
