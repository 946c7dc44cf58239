"""zaya_jax/runtime/workdir_lock.py: one command writing into a workdir at a time; a lock left by a dead
process (same host: pid gone or reused; another host: no heartbeat) does not block the next. The
trainer's own use (a second trainer refused while one runs) is in tests/test_train_start.py."""

import fcntl
import json
import os
import socket
import time

import pytest
from support.workdir_locks import dead_pid, own_lock, write_lock

from zaya_jax.runtime import workdir_lock as wl
from zaya_jax.runtime.cli import UserError


def test_a_live_lock_refuses_and_release_removes_it(tmp_path):
    w = str(tmp_path / "w")
    lock = wl.acquire(w, "train")
    with open(os.path.join(w, wl.LOCK_FILE)) as f:
        held = json.load(f)
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and held["command"] == "train"
    with pytest.raises(wl.WorkdirLocked) as e:
        wl.acquire(w, "reshard")
    msg = str(e.value)
    assert "\n" not in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "since " in msg and "train" in msg
    with pytest.raises(wl.WorkdirLocked, match="refusing to export into it"):
        wl.check_free(w, "export into it")
    lock.release()
    lock.release()  # idempotent
    assert not os.path.exists(w)  # created by acquire and left empty: removed too
    os.makedirs(w)
    wl.acquire(w, "train").release()
    assert os.path.isdir(w) and os.listdir(w) == []  # an existing workdir stays
    wl.check_free(w)


def test_same_host_lock_of_a_dead_or_reused_pid_is_stale(tmp_path, capsys):
    w = str(tmp_path / "w")
    host = socket.gethostname()
    write_lock(w, host=host, pid=dead_pid(), pid_start=None, boot_id=wl.boot_id())
    wl.check_free(w)  # stale: nothing to refuse
    lock = wl.acquire(w, "train")
    assert "removed a stale lock" in capsys.readouterr().out
    lock.release()
    # a live pid whose start time differs: the pid was reused by another process
    write_lock(w, host=host, pid=os.getppid(), pid_start="1", boot_id=wl.boot_id())
    if wl.process_start(os.getppid()) is not None:
        wl.acquire(w, "train").release()
    # the same live process: refused, whatever its heartbeat's age
    path = write_lock(
        w, host=host, pid=os.getppid(), pid_start=wl.process_start(os.getppid()), boot_id=wl.boot_id()
    )
    os.utime(path, (time.time() - 10_000, time.time() - 10_000))
    with pytest.raises(wl.WorkdirLocked, match=f"pid {os.getppid()}"):
        wl.acquire(w, "train")


def test_other_host_lock_is_stale_after_its_heartbeat_timeout(tmp_path, monkeypatch):
    w = str(tmp_path / "w")
    path = write_lock(w, host="another-node", pid=1, pid_start="5", boot_id="x")
    with pytest.raises(wl.WorkdirLocked, match="another-node"):
        wl.acquire(w, "train")
    old = time.time() - 2 * wl.DEFAULT_STALE_S
    os.utime(path, (old, old))
    monkeypatch.setenv(wl.STALE_ENV, str(4 * wl.DEFAULT_STALE_S))
    with pytest.raises(wl.WorkdirLocked, match="heartbeat"):
        wl.acquire(w, "train")
    monkeypatch.setenv(wl.STALE_ENV, "nan")
    with pytest.raises(UserError, match=wl.STALE_ENV):
        wl.acquire(w, "train")
    monkeypatch.delenv(wl.STALE_ENV)
    wl.acquire(w, "train").release()


def test_a_stale_looking_lock_whose_flock_is_held_is_kept(tmp_path):
    w = str(tmp_path / "w")
    path = write_lock(w, host=socket.gethostname(), pid=dead_pid(), pid_start=None, boot_id=None)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its holder is alive after all (e.g. a stopped job)
    try:
        with pytest.raises(wl.WorkdirLocked):
            wl.acquire(w, "train")
        assert os.path.exists(path)
    finally:
        os.close(fd)
    wl.acquire(w, "train").release()


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(wl, "HEARTBEAT_S", 0.05)
    w = str(tmp_path / "w")
    lock = wl.acquire(w, "train")
    path = os.path.join(w, wl.LOCK_FILE)
    old = time.time() - 1000
    os.utime(path, (old, old))
    deadline = time.time() + 10
    while os.stat(path).st_mtime < old + 500 and time.time() < deadline:
        time.sleep(0.05)
    assert os.stat(path).st_mtime > old + 500
    lock.release()


def test_import_hf_and_export_refuse_a_held_workdir(tmp_path):
    """(`reshard --dst`: tests/test_train_start.py, which has a checkpoint to read.)"""
    from support.cli_runs import assert_one_line_error, run_cli, tree_digest

    w = tmp_path / "w"
    own_lock(w)
    before = tree_digest(w)
    for module, args in (
        ("import_hf", ["--hf", tmp_path / "nothing", "--out", w]),
        ("export", ["--checkpoint", tmp_path / "nothing", "--out", w]),
    ):
        assert_one_line_error(run_cli(module, *args), str(w), f"pid {os.getpid()}")
        assert tree_digest(w) == before
