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
import dataclasses
import difflib
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from zaya_jax.runtime import python_gc
from zaya_jax.runtime.interrupt import Interrupted, exit_with

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
    """Calls main(*args); a user error becomes one `error:` line and exit 2 (traceback with ZAYA_DEBUG=1).
    Python's garbage collector runs rarely from here on (python_gc: the CLIs trace large programs)."""
    python_gc.collect_rarely()
    try:
        out = main(*args)
    except USER_ERRORS as e:
        if debug():
            raise
        fail(one_line(e))
    except Interrupted as e:  # SIGINT / SIGTERM (zaya_jax/runtime/interrupt.py): one line, 128 + signum
        exit_with(e)
    if isinstance(out, int) and not isinstance(out, bool):
        sys.exit(out)  # argparse-style mains return an exit code
    return out


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line (UserError) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message)

    def add_argument(self, *args, **kwargs):
        """argparse's, with the declared values of a FlagValue `type` added to the help."""
        value, help_ = kwargs.get("type"), kwargs.get("help")
        if isinstance(value, FlagValue) and help_ != argparse.SUPPRESS:
            kwargs["help"] = f"{help_} ({value.describe()})" if help_ else value.describe()
        return super().add_argument(*args, **kwargs)


def run_absl(main: Callable[[list[str]], Any], define_flags: Callable[[], None] | None = None, argv=None):
    """`app.run(main)` with one-line errors: flag parsing (unknown key -> nearest match; a config
    file that is missing or whose get_config raised -> the file and its message), UsageError, and
    user errors raised by main."""
    from absl import app, flags

    if define_flags is not None:
        try:  # a config dict flag reads its `--config.` overrides from sys.argv as it is defined
            define_flags()
        except (UserError, flags.Error, AttributeError, KeyError) as e:
            if debug():
                raise
            fail(one_line(e) if isinstance(e, UserError) else _flag_message(e, argv or sys.argv))

    def parse(argv_: list[str]) -> list[str]:
        files = _config_file_args(flags.FLAGS, argv_)
        for name, spec in files:  # before absl parses: it would defer or bury the error
            path = spec.split(":", 1)[0]
            if not os.path.isfile(path):
                where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
                what = "is a directory" if os.path.isdir(path) else "does not exist"
                fail(f"--{name}={spec}: config file {path or repr(path)} {what}{where}")
        try:
            rest = flags.FLAGS(argv_)
            for name, spec in files:  # a get_config that raised OSError: reported on first access
                getattr(flags.FLAGS[name].value, "keys", None)
        except (OSError, SyntaxError, ImportError, NameError) as e:  # in the config file's own code
            if debug() or not files:
                raise
            cause = e.__cause__ or e
            text = one_line(cause) if isinstance(cause, OSError) else f"{type(e).__name__}: {one_line(e)}"
            fail(f"--{files[0][0]}={files[0][1]}: {text}")
        except (flags.Error, AttributeError, KeyError) as e:  # ml_collections: unknown override key
            if debug():
                raise
            fail(_flag_message(e, argv_))
        return rest

    def guarded(argv_: list[str]) -> Any:
        try:
            return run(main, argv_)
        except app.UsageError as e:
            if debug():
                raise
            fail(one_line(e))

    return app.run(guarded, argv=argv, flags_parser=parse)


def _config_file_args(flag_values, argv: list[str]) -> list[tuple[str, str]]:
    """[(flag name, 'FILE[:ARG]')] of the config-file flags (DEFINE_config_file) given in argv."""
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    names = [n for n, f in flag_values._flags().items() if isinstance(f.parser, ConfigFileFlagParser)]
    out = []
    for i, arg in enumerate(argv[1:], start=1):
        for name in names:
            for dashes in ("--", "-"):
                if arg.startswith(f"{dashes}{name}="):
                    out.append((name, arg.split("=", 1)[1]))
                elif arg == f"{dashes}{name}" and i + 1 < len(argv):
                    out.append((name, argv[i + 1]))
    return out


_TRACEBACK_END = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): ", re.MULTILINE)


def _flag_message(e: BaseException, argv: list[str]) -> str:
    """absl's flag error; an unknown `--config.` key is named as given, with ml_collections' nearest
    match; a config file whose get_config raised gives that exception's message, not its traceback."""
    inner: object = e  # ml_collections raises AttributeError(KeyError(message))
    while isinstance(inner, (AttributeError, KeyError)) and inner.args:
        inner = inner.args[0]
    text = str(inner)
    if "Error whilst parsing config file" in text:
        flag = text.split(": Error whilst parsing", 1)[0].removeprefix("flag ")
        last = list(_TRACEBACK_END.finditer(text))
        message = text[last[-1].end() :] if last else text
        path = flag.split("=", 1)[-1].split(":", 1)[0]
        return f"{flag}: {one_line(ValueError(message.removeprefix(path + ': ')))}"
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


# -- declared flag values -------------------------------------------------------------------------
#
# Every numeric or enumerated flag declares what it takes next to its definition, and the parse
# checks it before anything is loaded:
#
#     ap.add_argument("--temperature", type=cli.Float(min=0.0), default=0.0)        # argparse
#     ap.add_argument("--dtype", choices=("float32", "bfloat16"))                     # argparse enum
#     cli.define_flag("num_devices", 8, "...", cli.Int(min=1), flag_values)            # absl
#     flags.DEFINE_enum("remat", None, [...], "...", flag_values=flag_values)         # absl enum
#
# A value outside ends the program with one line naming the flag (`error: argument --temperature:
# must be a number >= 0, got -1`; absl: `error: flag --num_devices=0: must be an int >= 1, got 0`),
# exit 2. `invalid()` lists values a flag refuses: tests/test_cli_ranges.py feeds them to every CLI
# in its table (and fails on a numeric flag that declares no range).


class FlagValue:
    """What a flag takes: `parse(text)` returns the value or raises ValueError("must be ...")."""

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def invalid(self) -> tuple[str, ...]:
        """Values outside (for the walking test)."""
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        """Whether a (default) value is inside."""
        try:
            self.parse(str(value))
        except ValueError:
            return False
        return True

    def __call__(self, text: str) -> Any:  # argparse `type=`: its message names the flag
        try:
            return self.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def __repr__(self) -> str:  # argparse's help and errors show the type by name
        return self.describe()


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True, repr=False)
class Int(FlagValue):
    """An int in [min, max] (None: unbounded). `convert` reads the text (default int(); e.g. a byte
    size '64K'), `what` names it in the message."""

    min: int | None = None
    max: int | None = None
    convert: Callable[[str], int] = int
    what: str = "an int"

    def describe(self) -> str:
        return f"{self.what}{_bounds(self.min, self.max, False, False)}"

    def parse(self, text: str) -> int:
        try:
            value = self.convert(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not _inside(value, self.min, self.max, False, False):
            raise ValueError(f"must be {self.describe()}, got {text!r}")
        return value

    def invalid(self) -> tuple[str, ...]:
        return tuple(
            str(v) for v in (_below(self.min, False, 1), _above(self.max, False, 1)) if v is not None
        )


@dataclasses.dataclass(frozen=True, repr=False)
class Float(FlagValue):
    """A finite number in [min, max]; min_open / max_open exclude the bound itself."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def describe(self) -> str:
        return f"a number{_bounds(self.min, self.max, self.min_open, self.max_open)}"

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or not _inside(value, self.min, self.max, self.min_open, self.max_open):
            raise ValueError(f"must be {self.describe()}, got {text!r}")
        return value

    def invalid(self) -> tuple[str, ...]:
        bad = (_below(self.min, self.min_open, 1.0), _above(self.max, self.max_open, 1.0))
        return ("nan", *(_num(float(v)) for v in bad if v is not None))


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {_num(hi)}"
    return ""


def _inside(value, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (value < lo or (lo_open and value == lo)):
        return False
    return not (hi is not None and (value > hi or (hi_open and value == hi)))


def _below(lo, lo_open: bool, step):
    return None if lo is None else (lo if lo_open else lo - step)


def _above(hi, hi_open: bool, step):
    return None if hi is None else (hi if hi_open else hi + step)


class OneOf(FlagValue):
    """One of `names`, or (with `other`) a value `other` takes, described as `other_doc`."""

    def __init__(self, *names: str, other: FlagValue | None = None, other_doc: str | None = None):
        self.names, self.other = names, other
        self.other_doc = other_doc or (other.describe() if other else None)

    def describe(self) -> str:
        return f"one of {', '.join(self.names)}" + (f" or {self.other_doc}" if self.other else "")

    def parse(self, text: str) -> Any:
        if text in self.names:
            return text
        if self.other is not None:
            try:
                return self.other.parse(text)
            except ValueError:
                pass
        raise ValueError(f"must be {self.describe()}, got {text!r}")

    def invalid(self) -> tuple[str, ...]:
        return ("no-such-value", *(self.other.invalid() if self.other else ()))


class ListOf(FlagValue):
    """A comma-separated list (empty items dropped) of `item` values (a FlagValue, or a tuple of
    names), `length` of them if given; parses to a list."""

    def __init__(self, item: FlagValue | tuple[str, ...], length: int | None = None):
        self.item = OneOf(*item) if isinstance(item, tuple) else item
        self.length = length

    def describe(self) -> str:
        count = f"{self.length} " if self.length else ""
        return f"a comma-separated list of {count}values each {self.item.describe()}"

    def parse(self, text: str) -> list[Any]:
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts or (self.length is not None and len(parts) != self.length):
            raise ValueError(f"must be {self.describe()}, got {text!r}")
        try:
            return [self.item.parse(p) for p in parts]
        except ValueError as e:
            raise ValueError(f"must be {self.describe()}; {e}") from None

    def accepts(self, value: Any) -> bool:
        return super().accepts(",".join(map(str, value)) if isinstance(value, (list, tuple)) else value)

    def invalid(self) -> tuple[str, ...]:
        return self.item.invalid()


class Parsed(FlagValue):
    """A value some parse function reads (ValueError for a bad one), e.g. a mesh spec; `invalid`
    lists examples it refuses."""

    def __init__(self, parse: Callable[[str], Any], what: str, invalid: tuple[str, ...]):
        self._parse, self.what, self._invalid = parse, what, invalid

    def describe(self) -> str:
        return self.what

    def parse(self, text: str) -> Any:
        try:
            return self._parse(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"must be {self.what}, got {text!r} ({one_line(e)})") from None

    def invalid(self) -> tuple[str, ...]:
        return self._invalid


def define_flag(name: str, default: Any, help: str, value: FlagValue, flag_values=None) -> None:
    """An absl flag whose values `value` declares (absl reports a bad one as `flag --NAME=V: must
    be ...`, which run_absl turns into the one error line)."""
    from absl import flags

    class Parser(flags.ArgumentParser):
        syntactic_help = value.describe()

        def parse(self, argument):
            return value.parse(argument) if isinstance(argument, str) else argument

        def flag_type(self) -> str:
            return type(value).__name__.lower()

    Parser.declared = value
    flags.DEFINE(Parser(), name, default, help, flag_values if flag_values is not None else flags.FLAGS)
