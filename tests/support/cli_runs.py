"""The CLIs run as a user runs them (`python -m zaya_jax.X`, forked from a process that imported
them) and the checks every bad input gets: one `error: ...` line, the workdir left byte for byte."""

import hashlib
import os

from support import cli_fork
from support.train_runs import ROOT
from support.xla_env import xla_flags

TINY = os.path.join(ROOT, "configs/tiny.py")
ENV = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
ENV.pop("ZAYA_DEBUG", None)


def run_cli(module, *args, env=None, cwd=ROOT, umask=-1):
    """`python -m zaya_jax.MODULE ARGS` with ENV and `env` on top, forked from a process that has
    imported the CLIs (cli_fork): a CompletedProcess with its exit code, stdout and stderr."""
    return cli_fork.shared(ENV).run(module, *args, env={**ENV, **(env or {})}, cwd=cwd, umask=umask)


def assert_one_line_error(proc, *names):
    """Exit 2, stderr is exactly one line `error: ...` containing each of `names`, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    print(f"\nCLI-ERROR {' '.join(proc.args[2:])}\n  -> {lines[0]}")  # the table of bad inputs (pytest -s)
    return lines[0]


def tree_digest(path):
    """{relative path: (mode, sha256 of the file or 'dir')} of everything under `path`."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            p = os.path.join(root, d)
            out[os.path.relpath(p, path)] = (os.lstat(p).st_mode, "dir")
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = (os.lstat(p).st_mode, hashlib.sha256(fh.read()).hexdigest())
    return out


def prepare_text(tmp_path, *args):
    """`zaya_jax.data.prepare` of a short English text into tmp_path/data, with `args`."""
    text = tmp_path / "book.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 40)
    out = tmp_path / "data"
    proc = run_cli("data.prepare", "--input", text, "--out", out, *args)
    assert proc.returncode == 0, proc.stderr
    return out


def one_error(proc) -> str:
    """The one `error: ...` line of a run that exited 2 without a traceback (other lines may precede it)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]
