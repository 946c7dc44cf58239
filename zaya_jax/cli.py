"""One line for user errors: every `python -m zaya_jax.<cli>` entry point runs through here.

A mistake in what the user gave (a config key, a flag, a file, a directory, a checkpoint) ends the
program with one line `error: <what, naming the key / file / tensor>` on stderr and exit code 2,
without a traceback. A real bug (any other exception) keeps its traceback. `ZAYA_DEBUG=1` shows the
traceback of user errors too.

Which exceptions are user errors: `UserError` (raised where the code knows the user is at fault),
and the built-in kinds our input checks raise (`OSError`: a missing / unreadable / existing file;
`ValueError`: a bad value, named by the check that raised it). absl flag errors (an unknown
`--config.` key, a value of the wrong type) are reported the same way, with the nearest known key.

    def main(argv): ...
    if __name__ == "__main__":
        cli.run(main)                      # argparse CLIs: main(None) parses sys.argv itself
        cli.run_absl(main, _define_flags)  # absl CLIs: flags parsed here, then app.run(main)
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, Callable, NoReturn

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the command, config or files the user gave: reported as one line."""


USER_ERRORS: tuple[type[BaseException], ...] = (UserError, OSError, ValueError)


def debug() -> bool:
    return os.environ.get("ZAYA_DEBUG", "") not in ("", "0")


def one_line(e: BaseException) -> str:
    """The message of `e` on one line (a multi-line message's lines joined by '; ')."""
    text = str(e) or type(e).__name__
    if isinstance(e, KeyError) and len(e.args) == 1:
        text = str(e.args[0])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines)


def fail(message: str) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_USER_ERROR)


def run(main: Callable[..., Any], *args: Any) -> Any:
    """Calls main(*args); a user error becomes one `error:` line and exit 2 (traceback with ZAYA_DEBUG=1)."""
    try:
        out = main(*args)
    except USER_ERRORS as e:
        if debug():
            raise
        fail(one_line(e))
    if isinstance(out, int) and not isinstance(out, bool):
        sys.exit(out)  # argparse-style mains return an exit code
    return out


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (UserError) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message)


def run_absl(main: Callable[[list[str]], Any], define_flags: Callable[[], None] | None = None, argv=None):
    """`app.run(main)` with one-line errors: flag parsing (unknown key -> nearest match), UsageError,
    and user errors raised by main."""
    from absl import app, flags

    if define_flags is not None:
        define_flags()

    def parse(argv_: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv_)
        except (flags.Error, AttributeError, KeyError) as e:  # ml_collections: unknown override key
            if debug():
                raise
            fail(_flag_message(e, argv_))

    def guarded(argv_: list[str]) -> Any:
        try:
            return run(main, argv_)
        except app.UsageError as e:
            if debug():
                raise
            fail(one_line(e))

    return app.run(guarded, argv=argv, flags_parser=parse)


def _flag_message(e: BaseException, argv: list[str]) -> str:
    """absl's flag error; an unknown `--config.` key is named as given, with ml_collections' nearest match."""
    inner: object = e  # ml_collections raises AttributeError(KeyError(message))
    while isinstance(inner, (AttributeError, KeyError)) and inner.args:
        inner = inner.args[0]
    text = str(inner)
    name = re.match(r"'(\w+)'", text)
    near = re.search(r'Did you mean "(\w+)"', text)
    for arg in argv[1:]:
        path = arg.split("=", 1)[0]
        parts = path.split(".")
        if name and path.startswith("--config.") and name.group(1) in parts:
            hint = ""
            if near:
                parts[parts.index(name.group(1))] = near.group(1)
                hint = f" (did you mean {'.'.join(parts)}?)"
            return f"{path}: unknown config key{hint}"
    return one_line(e)


def near_key(key: str, known: list[str], prefix: str = "") -> str:
    """' (did you mean PREFIX+X?)' for the nearest of `known`, or ''."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{near[0]}?)" if near else ""
