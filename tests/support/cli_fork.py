"""`python -m zaya_jax.MODULE ARGS` without a Python start-up each: a server process imports the
CLIs once, then forks a child per run; the child runs the module as `__main__` (runpy, as
`python -m` does) with the run's arguments, environment, working directory and umask, its stdout
and stderr in files. A run costs a fork instead of the ~1.5 s of starting Python and importing
jax, flax and orbax.

What differs from a fresh process: the modules the server imported are not imported again, and what
they read from the environment at import (jax's JAX_* defaults, glibc's tunables) is the server's.
No XLA backend exists in the server, so each child creates its own from its own XLA_FLAGS. A test of
start-up itself (what a CLI imports, the trainer re-executing itself) starts a real process.

    proc = shared(env).run("export", "--checkpoint", path, env=env, cwd=cwd)  # a CompletedProcess
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The CLIs the server imports before forking (their `python -m` modules).
PRELOAD = (
    "zaya_jax.train",
    "zaya_jax.export",
    "zaya_jax.import_hf",
    "zaya_jax.reshard",
    "zaya_jax.generate",
    "zaya_jax.plot",
    "zaya_jax.data.prepare",
    "zaya_jax.evaluate.__main__",
    "zaya_jax.sizing.__main__",
)


def _child(request: dict) -> None:
    """In the forked child: the run's process state, then the module as `__main__`. What ends the
    module ends the child as it ends `python -m`: its exit status, an exception's traceback and
    exit 1, then the interpreter's own shutdown (atexit handlers, buffers flushed)."""
    import runpy

    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` has it
    if request["umask"] >= 0:
        os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = open(os.devnull)  # not the server's request pipe
    os.dup2(sys.stdin.fileno(), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    sys.argv = [request["module"], *request["args"]]
    sys.orig_argv = [sys.executable, "-m", *sys.argv]  # what a re-executing CLI starts again
    # `python -m` runs a module that is not imported yet (runpy warns otherwise)
    for name in (request["module"], request["module"] + ".__main__"):
        sys.modules.pop(name, None)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _wait(pid: int, timeout: float) -> int:
    """The child's exit code (as subprocess reports it); the child is killed after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def serve() -> None:
    """The server: imports PRELOAD, then for each request line on stdin forks a child, waits for it
    and answers its exit code on stdout."""
    import importlib

    replies = os.fdopen(os.dup(1), "w")  # stdout carries the replies only: prints go to stderr
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(request)
            sys.exit(0)
        print(json.dumps({"returncode": _wait(pid, request["timeout"])}), file=replies, flush=True)


class ForkServer:
    """A server process; `run` is subprocess.run for `python -m zaya_jax.X`, one run at a time (a
    second thread's run waits for the first: they share the server and its output files)."""

    def __init__(self, env: dict[str, str] | None = None):
        self._lock = threading.Lock()
        self._dir = tempfile.TemporaryDirectory(prefix="cli_fork_")
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the imports' notices; each run's stderr is its own file
            text=True,
            env=env,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )

    def run(
        self, module: str, *args, env: dict[str, str], cwd, umask: int = -1, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        with self._lock:
            return self._run(module, args, env, cwd, umask, timeout)

    def _run(self, module, args, env, cwd, umask, timeout) -> subprocess.CompletedProcess:
        out, err = (os.path.join(self._dir.name, name) for name in ("stdout", "stderr"))
        for path in (out, err):
            open(path, "w").close()
        request = {
            "module": f"zaya_jax.{module}",
            "args": [str(a) for a in args],
            "env": env,
            "cwd": str(cwd),
            "umask": umask,
            "timeout": timeout,
            "stdout": out,
            "stderr": err,
        }
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the CLI fork server ended (exit {self._proc.wait()})")
        with open(out) as o, open(err) as e:
            stdout, stderr = o.read(), e.read()
        argv = [sys.executable, "-m", request["module"], *request["args"]]
        return subprocess.CompletedProcess(argv, json.loads(reply)["returncode"], stdout, stderr)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._dir.cleanup()


_SHARED: list[ForkServer] = []


def shared(env: dict[str, str]) -> ForkServer:
    """This process' server, started with `env` on first use and closed when the process exits."""
    if not _SHARED:
        _SHARED.append(ForkServer(env))
        atexit.register(_SHARED[0].close)
    return _SHARED[0]


if __name__ == "__main__":
    serve()
