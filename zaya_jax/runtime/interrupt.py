"""SIGINT / SIGTERM in a long-running command: stop within seconds, keep what was finished, say so
in one line, exit 128 + the signal number (130 for SIGINT, 143 for SIGTERM).

    with interrupt.handled("generate", kept=lambda: f"{n} completions in {out}"):
        for batch in batches:
            interrupt.check()          # mode "poll": raises Interrupted here once a signal came
            ...

The first signal raises `Interrupted` in the main thread: at the next `check()` (mode "poll"), or
at the next Python line (mode "raise", for loops that are not ours, e.g. lm-eval's). `finally` and
`except BaseException` clean-ups run on the way out; the command may catch it to write what it
finished and re-raise with `kept` set. `cli.run` prints `interrupted by SIGINT: <kept>` on stderr
and ends the process with 128 + signum (`exit_with`).

A signal arrives in Python only between bytecodes of the main thread, so one that comes while the
main thread is inside compiled code (an XLA compile, a long device computation) would wait for it.
A watchdog thread woken by the signal itself (`signal.set_wakeup_fd`) ends the process with
`os._exit(128 + signum)` and the same line when the command is still running `grace_s` after the
signal, or at once on a second signal. After a signal it stays for the clean-up, which it bounds
the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 3.0  # from the first signal to the watchdog's forced exit
RESEND = 255  # a byte to the watchdog: send the signal again (not a signal number)


class Interrupted(BaseException):
    """A SIGINT / SIGTERM the command stops for; `kept` says what it left behind (or "")."""

    def __init__(self, signum: int, kept: str = ""):
        super().__init__(signum, kept)
        self.signum, self.kept = signum, kept

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        name = signal.Signals(self.signum).name
        return f"interrupted by {name}" + (f": {self.kept}" if self.kept else "")


class _State:
    signum: int | None = None
    mode: str = "poll"
    again: bool = False  # raise Interrupted again: the last one was dropped (`_raise_again`)
    resent: int = 0  # signals the watchdog sent again itself, which it does not count
    wake: socket.socket | None = None  # the watchdog's socket
    command: str = ""
    kept: Callable[[], str] | None = None


_state = _State()


def requested() -> int | None:
    """The signal number received inside `handled`, or None."""
    return _state.signum


def check() -> None:
    """Raises Interrupted if a signal came (a safe point of a loop)."""
    if _state.signum is not None:
        raise Interrupted(_state.signum)


def _kept() -> str:
    try:
        return _state.kept() if _state.kept is not None else ""
    except Exception:
        return ""


def _force_exit(signum: int, why: str) -> None:
    line = Interrupted(signum, "; ".join(filter(None, [why, _kept()]))).line()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os.write(2, (line + "\n").encode())
    os._exit(128 + signum)


def _watchdog(sock: socket.socket, grace_s: float, stop: threading.Event) -> None:
    """Waits for signal bytes; forces the exit `grace_s` after the first, or at the second."""
    first: float | None = None
    while not stop.is_set():
        timeout = None if first is None else max(0.0, first + grace_s - time.monotonic())
        ready, _, _ = select.select([sock], [], [], timeout)
        if stop.is_set():
            return
        if not ready:  # the grace period ran out
            _force_exit(_state.signum or signal.SIGINT, f"{_state.command} still running {grace_s:g} s later")
        for signum in sock.recv(64):
            if signum == RESEND and _state.signum is not None:
                time.sleep(0.05)  # `_raise_again` has returned: the handler raises in the code
                _state.resent += 1
                signal.pthread_kill(threading.main_thread().ident, _state.signum)
            if signum not in SIGNALS:
                continue
            if _state.resent:  # the one sent again just above
                _state.resent -= 1
                continue
            if first is not None:
                _force_exit(signum, "a second signal")
            first = time.monotonic()


@contextlib.contextmanager
def polling() -> Iterator[None]:
    """Inside `handled(mode="raise")`: mode "poll" for a block whose loop calls `check()` (it then
    stops where its results are consistent); a signal that came in it raises at its end."""
    mode, _state.mode = _state.mode, "poll"
    try:
        yield
    finally:
        _state.mode = mode
    check()


def _raise_again(hook, unraisable) -> None:
    """sys.unraisablehook: an Interrupted raised where Python drops exceptions (a gc callback, a
    __del__) is raised again at the next line, through the signal handler, and not printed."""
    if not isinstance(unraisable.exc_value, Interrupted):
        hook(unraisable)
        return
    _state.again = True
    with contextlib.suppress(OSError):  # the watchdog sends the signal again, once this returned
        _state.wake.send(bytes([RESEND]))


@contextlib.contextmanager
def handled(
    command: str, *, mode: str = "poll", kept: Callable[[], str] | None = None, grace_s: float = GRACE_S
) -> Iterator[None]:
    """SIGINT / SIGTERM handled as the module docstring says while inside; `kept()` describes what
    a forced exit leaves behind. Outside the main thread (no signal reaches it) nothing is installed."""
    if mode not in ("poll", "raise"):
        raise ValueError(f"mode={mode!r}: must be 'poll' or 'raise'")
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame):
        if _state.signum is None or _state.again:
            _state.signum, _state.again = signum, False
            if _state.mode == "raise":
                raise Interrupted(signum)

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    stop = threading.Event()
    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _state.signum, _state.command, _state.kept, _state.again, _state.resent = None, command, kept, False, 0
    _state.mode, _state.wake = mode, writer
    old_hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_raise_again, sys.unraisablehook)
    watchdog = threading.Thread(target=_watchdog, args=(reader, grace_s, stop), daemon=True)
    watchdog.start()
    try:
        yield
        if _state.signum is not None:  # came after the last check(): the work is complete
            raise Interrupted(_state.signum, _kept())
    finally:
        # after a signal the process is ending: the handlers and the watchdog stay, so the
        # clean-up is bounded too and a second signal ends it at once
        if _state.signum is None:
            stop.set()
            signal.set_wakeup_fd(old_fd)
            sys.unraisablehook = old_hook
            for s, handler in previous.items():
                signal.signal(s, handler)
            with contextlib.suppress(OSError):
                writer.send(b"\0")  # wakes the watchdog, which sees `stop`
            watchdog.join(timeout=1.0)
            reader.close()
            writer.close()
            _state.kept = None


def exit_with(e: Interrupted) -> NoReturn:
    """Prints `e`'s line on stderr and ends the process with 128 + signum. os._exit: the
    interpreter's own exit can wait minutes for an XLA compile under way (its objects are freed
    then), and the watchdog no longer runs by that time. The command has closed its files."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.write(e.line() + "\n")
        sys.stderr.flush()
    if "multiprocessing.util" in sys.modules:  # what Python's exit runs for it: worker pools
        with contextlib.suppress(Exception):  # ended, their semaphores released (no leak warning)
            sys.modules["multiprocessing.util"]._exit_function()
    os._exit(e.exit_code)
