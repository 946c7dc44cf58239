"""One run per workdir: WORKDIR/zaya_jax.lock, held by the command that writes into WORKDIR (the
trainer, `reshard --dst`, `import_hf --out`) for as long as it runs.

The lock file is created atomically (O_CREAT | O_EXCL: of two commands racing, one creates it)
and holds who took it: host, pid, the process's start time (/proc/PID/stat) and the host's boot
id, the command and since when. The holder keeps an flock(2) on it and refreshes its mtime (the
heartbeat) every HEARTBEAT_S seconds from a thread; releasing removes the file.

A lock left by a process that died without releasing it is stale, and the next command removes
it and takes its own:
  - same host (hostname): stale when the pid is not running, is another process now (its start
    time differs), or the host has restarted since (another boot id);
  - another host (a shared filesystem): stale when its heartbeat is older than ZAYA_LOCK_STALE_S
    seconds (default 300; set it in the environment of the command that finds the lock).
Before removing a stale lock the command takes its flock: a holder that still holds it (a live
process whose pid or heartbeat says otherwise, e.g. a stopped job) keeps its lock.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any

from zaya_jax.runtime.cli import UserError

LOCK_FILE = "zaya_jax.lock"
STALE_ENV = "ZAYA_LOCK_STALE_S"
DEFAULT_STALE_S = 300.0
HEARTBEAT_S = 10.0


class WorkdirLocked(UserError):
    """The workdir is held by another live command."""


def stale_after_s() -> float:
    """ZAYA_LOCK_STALE_S (seconds without a heartbeat after which another host's lock is stale)."""
    text = os.environ.get(STALE_ENV, "")
    if not text:
        return DEFAULT_STALE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{STALE_ENV}={text!r}: must be a number of seconds > 0")
    return value


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, /proc/PID/stat field 22), or None."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    return text.rsplit(")", 1)[-1].split()[19]  # the fields after the command name, from field 3


def boot_id() -> str | None:
    text = _read("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def this_process(command: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": process_start(pid),
        "boot_id": boot_id(),
        "command": command,
        "since": time.time(),
    }


def stale_reason(holder: dict[str, Any] | None, heartbeat: float, now: float, stale_s: float) -> str | None:
    """Why the lock of `holder` (its file's content; None when unreadable) whose heartbeat (mtime)
    is `heartbeat` is stale, or None while its holder may be alive (module docstring)."""
    age = now - heartbeat
    if holder is None or holder.get("host") != socket.gethostname():
        return f"no heartbeat for {age:.0f} s (> {STALE_ENV}={stale_s:g})" if age > stale_s else None
    pid = int(holder.get("pid", -1))
    here = boot_id()
    if holder.get("boot_id") and here and holder["boot_id"] != here:
        return "its host has restarted since"
    if not _alive(pid):
        return f"pid {pid} is not running"
    start = process_start(pid)
    if holder.get("pid_start") and start and holder["pid_start"] != start:
        return f"pid {pid} is another process now"
    return None


def describe(holder: dict[str, Any] | None, heartbeat: float, now: float) -> str:
    """'train (pid 123 on host h, since 2026-11-29 02:50:01 UTC, heartbeat 3 s ago)'."""
    if holder is None:
        return f"a command whose lock is being written (heartbeat {now - heartbeat:.0f} s ago)"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("since", heartbeat))))
    return (
        f"{holder.get('command', '?')} (pid {holder.get('pid')} on host {holder.get('host')}, "
        f"since {since}, heartbeat {now - heartbeat:.0f} s ago)"
    )


def _inspect(path: str) -> tuple[dict[str, Any] | None, float, int] | None:
    """(holder or None if unreadable, heartbeat, inode) of the lock at `path`, or None if there is
    none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    text = _read(path)
    try:
        holder = json.loads(text) if text else None
    except ValueError:
        holder = None
    return (holder if isinstance(holder, dict) else None), st.st_mtime, st.st_ino


def _try_flock(fd: int) -> bool:
    """An exclusive flock on `fd` without waiting; True also where the filesystem has none."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    return True


def _remove_stale(path: str, ino: int) -> bool:
    """Removes the stale lock at `path` (inode `ino`, the file judged) under its flock; False if
    its holder still holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True  # removed meanwhile: try again
    try:
        if os.fstat(fd).st_ino != ino:
            return True  # replaced meanwhile by another command's lock: judge that one
        if not _try_flock(fd):
            return False
        try:
            if os.stat(path).st_ino == ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        return True
    finally:
        os.close(fd)


def check_free(directory: str, action: str = "write into it") -> None:
    """WorkdirLocked if `directory` holds a live lock (for commands that write into a directory
    without holding its lock themselves). A path that is not a directory holds no lock."""
    if not os.path.isdir(directory):
        return
    path = os.path.join(directory, LOCK_FILE)
    seen = _inspect(path)
    if seen is None:
        return
    holder, heartbeat, _ = seen
    now = time.time()
    if stale_reason(holder, heartbeat, now, stale_after_s()) is None:
        raise WorkdirLocked(
            f"{directory} is in use by {describe(holder, heartbeat, now)}; refusing to {action}"
        )


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _hold_new(path: str, fd: int) -> bool:
    """The flock of the lock file just created. A command removing a stale lock may hold it for a
    moment (it then leaves the file, not the one it judged), or the file may be gone: False (fd
    closed, the file removed if still ours) means try again."""
    for _ in range(100):
        if not _same_file(path, fd):
            os.close(fd)
            return False
        if _try_flock(fd):
            if _same_file(path, fd):
                return True
            os.close(fd)
            return False
        time.sleep(0.01)
    if _same_file(path, fd):
        os.unlink(path)
    os.close(fd)
    return False


class WorkdirLock:
    """The held lock of one workdir: `release()` (idempotent, also at interpreter exit) removes
    it, and the workdir too if `acquire` created it and it is still empty."""

    def __init__(self, path: str, fd: int, created_dir: bool):
        self.path, self._fd, self._created_dir = path, fd, created_dir
        self._ino = os.fstat(fd).st_ino
        self._stop = threading.Event()
        self._released = False
        self._thread = threading.Thread(target=self._beat, name="zaya-workdir-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if os.stat(self.path).st_ino != self._ino:
                    sys.stderr.write(f"warning: {self.path} was taken over by another command\n")
                    return
                os.utime(self._fd)
            except OSError:
                return

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._stop.set()
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)  # drops the flock
        if self._created_dir:  # a command that failed before writing leaves no empty directory behind
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))


def acquire(workdir: str, command: str) -> WorkdirLock:
    """Creates `workdir` if needed and takes its lock; WorkdirLocked (one line naming the holder)
    if a live command holds it. A stale lock is removed first (module docstring)."""
    stale_s = stale_after_s()
    created_dir = not os.path.isdir(workdir)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            seen = _inspect(path)
            if seen is None:
                continue  # released meanwhile
            holder, heartbeat, ino = seen
            now = time.time()
            reason = stale_reason(holder, heartbeat, now, stale_s)
            if reason is None or not _remove_stale(path, ino):
                raise WorkdirLocked(
                    f"{workdir} is in use by {describe(holder, heartbeat, now)}: one run per workdir; "
                    f"wait for it to end, or stop it (a killed run's lock is cleared by the next command: "
                    f"{LOCK_FILE} in docs/architecture.md)"
                ) from None
            print(f"removed a stale lock of {describe(holder, heartbeat, now)}: {reason}", flush=True)
            continue
        if not _hold_new(path, fd):
            continue
        os.write(fd, json.dumps(this_process(command)).encode())
        os.fsync(fd)
        lock = WorkdirLock(path, fd, created_dir)
        atexit.register(lock.release)
        return lock
    raise WorkdirLocked(f"{workdir}: could not take {LOCK_FILE} (other commands keep replacing it)")
