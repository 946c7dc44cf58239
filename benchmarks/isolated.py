"""A benchmark side in a process of its own, driven over a pipe; the parent times `run` (a command's
round trip is well under a millisecond).

    side = IsolatedSide(factory, env, reuse_host_memory, **kwargs)   # factory(**kwargs) in the child
    side.run(n); side.loss(); side.close()                           # close: the child's peak RSS

Why a process each: in one process with jax (its compiled programs, buffers and thread pool) torch's
CPU step ran 10-15% slower than alone, which flattered every ratio; and a process' peak RSS is only a side's own when the side is alone in it. `env` is set in the
child before anything reads it (OMP_WAIT_POLICY for torch).

How the child starts follows what the side imports:
- ours (`JaxSide`): a `multiprocessing` spawn; the child sets glibc's malloc as the trainer does
  (zaya_jax.runtime.host_memory) before it builds the side.
- a factory marked `JAX_FREE` (`benchmarks.torch_side.TorchSide`): `python -m benchmarks.isolated FD`
  started with subprocess, the pipe's end passed as a file descriptor. A spawned child re-imports the
  parent's `-m` main module (benchmarks/train_step.py), and with it jax: ~134 MB of the torch side's
  peak RSS that a torch user never pays. Its malloc settings come through its environment (the
  parent's GLIBC_TUNABLES: zaya_jax.runtime.host_memory.huge_pages_for_children); nothing here imports jax.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import apply_env, peak_rss_bytes, set_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a side's process tells the parent about it once built.
SIDE_INFO = (
    "name",
    "init_s",
    "compile_s",
    "precision",
    "device",
    "devices",
    "threads",
    "attn_implementation",
)


def serve(conn: Connection, build: Any, host_memory_mode: str) -> None:
    """The child's side of the pipe: builds the side, reports it, then runs the parent's commands;
    at "stop" it answers with its own peak RSS."""
    try:
        side = build()
    except Exception as e:  # raised again in the parent
        conn.send(e)
        return
    info = {key: str(getattr(side, key)) if key == "device" else getattr(side, key) for key in SIDE_INFO}
    conn.send({**info, "host_memory": host_memory_mode, "imports_jax": "jax" in sys.modules})
    while True:
        command, n = conn.recv()
        if command == "run":
            side.run(n)
            conn.send(None)
        elif command == "loss":
            conn.send(side.loss())
        else:
            conn.send(peak_rss_bytes())
            return


def _spawned(conn: Connection, factory: Any, kwargs: dict[str, Any], env: dict, reuse: bool) -> None:
    """A spawned child (our sides): environment, then malloc as the trainer sets it, then serve."""
    set_env(env)
    from zaya_jax.runtime import host_memory

    host_memory.configure(reuse, reexec=False)  # huge pages came with the environment (main)
    serve(conn, lambda: factory(**kwargs), host_memory.mode())


def _child_env(env: dict[str, str | None]) -> dict[str, str]:
    """os.environ with `env` applied (None: unset) and the repository importable."""
    out = dict(os.environ)
    apply_env(out, env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return out


def _huge_pages_inherited(env: dict[str, str]) -> str:
    """The malloc mode a JAX_FREE child runs with: huge pages if its environment carries glibc's
    tunable for them (zaya_jax.runtime.host_memory.HUGE_PAGES_TUNABLE, set by the parent), else glibc's
    defaults (the "reuse" settings need zaya_jax, i.e. jax, in the child)."""
    from zaya_jax.runtime import host_memory  # the parent's import: it has jax already

    return "huge_pages" if host_memory.has_huge_pages_tunable(env.get("GLIBC_TUNABLES", "")) else "default"


class IsolatedSide:
    """A side in a process of its own (module docstring); `SIDE_INFO`, `host_memory` and
    `imports_jax` (whether the child's process holds jax) are read from the child once built."""

    def __init__(self, factory: Any, env: dict[str, str | None], reuse_host_memory: bool, **kwargs: Any):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        if getattr(factory, "JAX_FREE", False):
            child_env = _child_env(env)
            cmd = [sys.executable, "-m", "benchmarks.isolated", str(child.fileno())]
            self._proc: Any = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=child_env, cwd=ROOT)
            child.close()  # the child holds its end: EOF here if it dies
            self._conn.send((factory, kwargs, _huge_pages_inherited(child_env)))
        else:
            args = (child, factory, kwargs, env, reuse_host_memory)
            self._proc = ctx.Process(target=_spawned, args=args, daemon=True)
            self._proc.start()
        info = self._conn.recv()
        if isinstance(info, BaseException):
            raise info
        for key in (*SIDE_INFO, "host_memory", "imports_jax"):
            setattr(self, key, info[key])
        self.peak_rss_bytes: int | None = None
        t0 = time.perf_counter()
        self.run(1)  # untimed; for torch this includes its lazy set-up
        self.first_step_s = time.perf_counter() - t0

    def run(self, n: int) -> None:
        self._conn.send(("run", n))
        self._conn.recv()

    def loss(self) -> float | None:
        self._conn.send(("loss", 0))
        return self._conn.recv()

    def close(self) -> None:
        """Stops the child; its own peak RSS lands in `peak_rss_bytes`."""
        self._conn.send(("stop", 0))
        self.peak_rss_bytes = self._conn.recv()
        if isinstance(self._proc, subprocess.Popen):
            self._proc.wait(timeout=60)
        else:
            self._proc.join(timeout=60)


def main(argv: list[str]) -> None:
    """`python -m benchmarks.isolated FD`: a JAX_FREE side's child, on the pipe end it inherited."""
    conn = Connection(int(argv[1]))
    factory, kwargs, host_memory_mode = conn.recv()
    serve(conn, lambda: factory(**kwargs), host_memory_mode)


if __name__ == "__main__":
    main(sys.argv)
