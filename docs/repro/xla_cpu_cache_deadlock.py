"""Reproduces docs/xla-cpu-cache-deadlock.md in one process, without the persistent cache.

Compiles the ZeRO-1 train step of tests/test_zero1.py on an expert=4 x data=2 mesh of 8 CPU
devices, serializes the executable before it runs (as jax's persistent cache does), runs the
compiled step, then loads the serialized bytes and runs that. The compiled step runs; the loaded
one stops in an all-gather inside a while loop on some devices and in one outside it on the others,
and XLA ends the process after the collective timeout (SIGABRT).

    python docs/repro/xla_cpu_cache_deadlock.py            # hangs
    python docs/repro/xla_cpu_cache_deadlock.py data=8     # every collective in the entry: runs
"""

import os
import pathlib
import re
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=20"
)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

import test_zero1 as t
from jax.experimental import serialize_executable

from zaya_jax.analysis import hlo
from zaya_jax.training.train_state import abstract_batch

MESH = (("expert", 4), ("data", 2))  # or the first argument: data=8, data=4,fsdp=2, ...


def collective_homes(hlo_text: str) -> tuple[dict[int, str], str]:
    """({channel_id (the op_id of XLA's rendezvous key): the computation its collective is in},
    the entry computation's name)."""
    comps, entry = hlo.computations(hlo_text)
    homes = {}
    for name, lines in comps.items():
        for line in lines:
            if found := re.search(r"channel_id=(\d+)", line):
                homes[int(found.group(1))] = name
    return homes, entry


def main() -> None:
    mesh = MESH
    if len(sys.argv) > 1:
        mesh = tuple((axis, int(size)) for axis, size in (a.split("=") for a in sys.argv[1].split(",")))
    c, cfg, program = t._program(mesh, 1, "step", t.MESH_CFG, t.MESH_STEPS)
    batch = abstract_batch(c.train.batch_size, c.train.seq_len, program.mesh)
    compiled = program.train_step.lower(program.abstract_state(), batch).compile()
    # Before the first run: a run resolves the sort comparators, after which XLA:CPU refuses to
    # serialize ("`LessThan` is not serializable").
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    homes, entry = collective_homes(compiled.as_text())
    print("collectives in the entry computation:", sorted(i for i, h in homes.items() if h == entry))
    print("in called computations (while bodies, ...):", sorted(i for i, h in homes.items() if h != entry))
    step = t.Step(compiled, program, c, cfg, t.MESH_CFG)
    print("compiled in the process, loss:", t._steps(step, 1)[0], flush=True)
    loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    print("deserialized, loss:", t._steps(step._replace(compiled=loaded), 1)[0], flush=True)


if __name__ == "__main__":
    main()
