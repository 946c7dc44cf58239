"""Workdir locks as a test lays them down: held by this live process, or left by a dead one."""

import json
import os
import socket
import subprocess
import sys
import time

from zaya_jax.runtime import workdir_lock as wl


def write_lock(workdir, **holder):
    """The lock file of `workdir` naming `holder` (host, pid, ...) as a trainer writes it."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, wl.LOCK_FILE)
    with open(path, "w") as f:
        json.dump({"command": "train", "since": time.time(), **holder}, f)
    return path


def dead_pid():
    """The pid of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def own_lock(workdir):
    """A lock held by this (live) test process, as a running trainer holds it."""
    return write_lock(
        workdir,
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_start=wl.process_start(os.getpid()),
        boot_id=wl.boot_id(),
    )
