"""launch/: shell syntax, the local multi-process launcher end to end on CPU, and the SLURM script's
XLA flags against this jaxlib's flag table."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "launch" / "local_multiprocess.sh"
SBATCH = ROOT / "launch" / "slurm_mi300x.sbatch"


def _env(**extra):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", ZAYA_LAUNCH_PLATFORM="cpu", PYTHON=sys.executable, **extra)
    # conftest sets 8 host devices; the launcher must replace that with DEVICES_PER_PROCESS.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    for k in ("ZAYA_COORDINATOR", "ZAYA_NUM_PROCESSES", "ZAYA_PROCESS_ID", "ZAYA_LOCAL_DEVICE_IDS"):
        env.pop(k, None)
    return env


def _launch(n, d, *cmd, timeout=50):
    return subprocess.run(
        ["bash", str(LOCAL), str(n), str(d), "--", *cmd],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("script", [LOCAL, SBATCH], ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_two_processes_two_devices_each():
    code = (
        "import jax; from zaya_jax.parallel.distributed import initialize_from_env; "
        "assert initialize_from_env(); "
        "print('RESULT', jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count())"
    )
    r = _launch(2, 2, sys.executable, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    results = sorted(re.findall(r"^\[p(\d)\] RESULT (\d) (\d) (\d) (\d)$", r.stdout, re.MULTILINE))
    assert results == [("0", "0", "2", "4", "2"), ("1", "1", "2", "4", "2")], r.stdout + r.stderr


def test_first_failure_exit_code_propagates_and_others_are_stopped():
    # Process 1 fails at once; process 0 would sleep for a minute unless the launcher stops it.
    code = (
        "import os, sys, time\n"
        "if os.environ['ZAYA_PROCESS_ID'] == '1':\n  print('failing'); sys.exit(7)\n"
        "time.sleep(60)"
    )
    t0 = time.monotonic()
    r = _launch(2, 1, sys.executable, "-c", code)
    assert r.returncode == 7, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    assert "[p1] failing" in r.stdout
    assert "process 1 exited with 7" in r.stderr


def test_success_when_all_succeed_and_usage_errors():
    r = _launch(3, 1, "bash", "-c", 'echo "id=$ZAYA_PROCESS_ID n=$ZAYA_NUM_PROCESSES c=$ZAYA_COORDINATOR"')
    assert r.returncode == 0, r.stderr
    lines = sorted(l for l in r.stdout.splitlines() if l.startswith("[p"))
    assert [l.split(" c=")[0] for l in lines] == [f"[p{i}] id={i} n=3" for i in range(3)]
    assert all(re.search(r"c=127\.0\.0\.1:\d+$", l) for l in lines)
    bad = subprocess.run(["bash", str(LOCAL), "2", "--", "true"], env=_env(), capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_sbatch_xla_flags_parse_in_this_jaxlib():
    """XLA aborts at start-up on an unknown flag name or unparsable value, on any backend."""
    text = SBATCH.read_text()
    block = re.search(r"^XLA_FLAGS_ROCM=\((.*?)^\)", text, re.MULTILINE | re.DOTALL).group(1)
    flags = re.findall(r"^\s*(--xla_[a-z0-9_]+=\S*)", block, re.MULTILINE)
    assert len(flags) >= 5 and any("latency_hiding" in f for f in flags)
    env = _env()
    env["XLA_FLAGS"] = " ".join(flags)
    r = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_processes_of_a_run_stop_together_on_a_workdir_in_use(tmp_path):
    """Process 0 holds the workdir lock for the run; on a workdir another run holds (this test
    process, alive) every process stops with its one-line error."""
    from support.workdir_locks import own_lock

    w = tmp_path / "w"
    own_lock(w)
    r = _launch(2, 1, "--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(w), timeout=120)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = re.findall(
        rf"^\[p[01]\] error: {re.escape(str(w))} is in use by train \(pid {os.getpid()} ", r.stdout, re.MULTILINE
    )
    assert errors and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert sorted(os.listdir(w)) == ["zaya_jax.lock"]
