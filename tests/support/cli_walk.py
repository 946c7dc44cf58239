"""Walks every numeric or enumerated flag of every CLI with values outside what the flag declares
(zaya_jax/runtime/cli.py, "declared flag values"), each through the CLI's real `__main__` entry point
(runpy, as `python -m MODULE` runs it), all in this one process: `python tests/support/cli_walk.py` prints
one JSON object (see `walk`). tests/test_cli_ranges.py runs it and checks every case.

The flags are read off each CLI's own parser, so a flag is walked as soon as it is added:
argparse CLIs expose `arg_parser()`, absl CLIs `_define_flags(flag_values)`. A numeric flag
(argparse `type=int/float`, absl DEFINE_integer/DEFINE_float) that declares no range is reported
as undeclared. Nothing is loaded: a value the parse accepts stops the CLI right after parsing (it
is reported as accepted), so a missing check can never start a training run or a benchmark here.

Add a CLI: one row in CLIS (the module `python -m` runs, the module holding its parser, and the
argv every case starts from: its required flags, so that only the bad flag can be the error).

Config loading is walked too (`config_walk`): every absl CLI with a `--config FILE` flag gets a
missing file (alone and with an override), a config file whose get_config raises (an unknown
phase) and a misspelt `--config.` key; one with a `--config.` dict (reshard) gets an unknown and a
misspelt key. Each case lists what its one error line must name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.py")
BAD_CHOICE = "no-such-choice"


@dataclasses.dataclass(frozen=True)
class Cli:
    run: str  # what `python -m` runs
    parser_module: str  # where arg_parser() / _define_flags(fv) lives
    kind: str  # "argparse" | "absl"
    argv: tuple[str, ...] = ()  # the required flags, before the bad one


CLIS = (
    Cli("zaya_jax.train", "zaya_jax.train", "absl", ("--config", TINY, "--workdir", "/nonexistent/w")),
    Cli("zaya_jax.sizing", "zaya_jax.sizing.__main__", "absl", ("--config", TINY)),
    Cli(
        "zaya_jax.reshard", "zaya_jax.reshard", "absl", ("--src", "/nonexistent/a", "--dst", "/nonexistent/b")
    ),
    Cli(
        "zaya_jax.import_hf",
        "zaya_jax.import_hf",
        "absl",
        ("--hf", "/nonexistent/h", "--out", "/nonexistent/o"),
    ),
    Cli(
        "zaya_jax.data.prepare",
        "zaya_jax.data.prepare",
        "argparse",
        ("--input", "x.txt", "--out", "/nonexistent/o"),
    ),
    Cli(
        "zaya_jax.evaluate",
        "zaya_jax.evaluate.__main__",
        "argparse",
        ("--checkpoint", "/nonexistent/w", "--data", "x.jsonl"),
    ),
    Cli(
        "zaya_jax.generate",
        "zaya_jax.generate",
        "argparse",
        ("--checkpoint", "/nonexistent/w", "--prompt", "hi"),
    ),
    Cli(
        "zaya_jax.export",
        "zaya_jax.export",
        "argparse",
        ("--checkpoint", "/nonexistent/w", "--out", "/nonexistent/o"),
    ),
    Cli("zaya_jax.plot", "zaya_jax.plot", "argparse", ("/nonexistent/w",)),
    Cli(
        "zaya_jax.lm_eval",
        "zaya_jax.lm_eval.__main__",
        "argparse",
        ("--model_args", "checkpoint=/nonexistent/w", "--tasks", "x"),
    ),
    *(
        Cli(f"benchmarks.{name}", f"benchmarks.{name}", "argparse")
        for name in (
            "checkpoint_io",
            "collectives",
            "evaluate",
            "gemm",
            "generate",
            "gpu_check",
            "kernels",
            "membw",
            "newton_schulz",
            "profile_step",
            "train_step",
        )
    ),
)


class Accepted(Exception):
    """The parse accepted the case: the CLI is stopped before it does anything."""


def _long_name(option_strings: list[str]) -> str:
    return next((o for o in option_strings if o.startswith("--")), option_strings[0])


def argparse_flags(parser: argparse.ArgumentParser):
    """(cases [(flag, value)], undeclared numeric flags, flags whose default is outside)."""
    from zaya_jax.runtime import cli

    cases, undeclared, bad_defaults = [], [], []
    for action in parser._actions:
        if not action.option_strings:
            continue
        flag = _long_name(action.option_strings)
        if isinstance(action.type, cli.FlagValue):
            cases += [(flag, v) for v in action.type.invalid()]
            if action.default not in (None, argparse.SUPPRESS) and not action.type.accepts(action.default):
                bad_defaults.append(flag)
        elif action.choices is not None:
            cases.append((flag, BAD_CHOICE))
        elif action.type in (int, float):
            undeclared.append(flag)
    return cases, undeclared, bad_defaults


def absl_flags(define_flags):
    """The same for an absl CLI's `_define_flags(flag_values)`."""
    from absl import flags

    fv = flags.FlagValues()
    define_flags(fv)
    cases, undeclared, bad_defaults = [], [], []
    for flag in {f.name: f for f in fv._flags().values()}.values():
        declared = getattr(type(flag.parser), "declared", None)
        name = f"--{flag.name}"
        if declared is not None:
            cases += [(name, v) for v in declared.invalid()]
            if flag.default is not None and not declared.accepts(flag.default):
                bad_defaults.append(name)
        elif isinstance(flag.parser, flags.EnumParser):
            cases.append((name, BAD_CHOICE))
        elif isinstance(flag.parser, (flags.IntegerParser, flags.FloatParser)):
            undeclared.append(name)
    return cases, undeclared, bad_defaults


def _run_case(c: Cli, argv: list[str]) -> tuple[int | str, str]:
    """(exit code or 'accepted', stderr) of `python -m c.run *argv`, run here; the parse is the end."""
    from absl import flags

    from zaya_jax.runtime import cli

    err = io.StringIO()
    before = set(flags.FLAGS)
    real_parse, real_run = cli.ArgumentParser.parse_args, cli.run

    def parse_then_stop(self, *a, **k):
        real_parse(self, *a, **k)
        raise Accepted

    def stop(main, *a):  # run_absl calls run(main, argv) once the flags parsed
        raise Accepted

    sys.argv = [c.run, *argv]
    try:
        if c.kind == "absl":
            cli.run = stop
        else:
            cli.ArgumentParser.parse_args = parse_then_stop
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(c.run, run_name="__main__", alter_sys=False)
        code: int | str = "returned"
    except Accepted:
        code = "accepted"
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        cli.ArgumentParser.parse_args, cli.run = real_parse, real_run
        for name in set(flags.FLAGS) - before:  # the next run of the module defines them again
            if name in flags.FLAGS:
                delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
    return code, err.getvalue()


MISSING = "configs/no_such_config.py"
PHASE9 = "configs/zaya1_base.py:phase9"

# (argv replacing the CLI's own --config, what the error line names); {cli} is the CLI's module.
CONFIG_FILE_CASES = (
    (("--config", MISSING), (f"--config={MISSING}", "does not exist")),
    (("--config", MISSING, "--config.train.steps=3"), (f"--config={MISSING}", "does not exist")),
    (("--config", PHASE9), (f"--config={PHASE9}", "unknown phase 'phase9'")),
    (("--config", TINY, "--config.model.hidden_sz=3"), ("--config.model.hidden_sz", "hidden_size")),
)
CONFIG_DICT_CASES = (
    (("--config.model.hidden_size=3",), ("--config.model.hidden_size", "--config.mesh.data")),
    (("--config.mesh.dta=2",), ("--config.mesh.dta", "did you mean --config.mesh.data")),
)


def _config_flag_kind(c: Cli) -> str | None:
    """'file' (DEFINE_config_file), 'dict' (DEFINE_config_dict) or None: the CLI's --config flag."""
    from absl import flags
    from ml_collections.config_flags.config_flags import ConfigFileFlagParser

    if c.kind != "absl":
        return None
    fv = flags.FlagValues()
    importlib.import_module(c.parser_module)._define_flags(fv)
    if "config" not in fv:
        return None
    return "file" if isinstance(fv["config"].parser, ConfigFileFlagParser) else "dict"


def _without_config(argv: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a == "--config":
            skip = not skip
            continue
        out.append(a)
    return out


def config_walk(clis=CLIS) -> list[dict]:
    """[{cli, argv, names, code, stderr}] of the config-loading cases of every absl CLI."""
    out = []
    for c in clis:
        kind = _config_flag_kind(c)
        if kind is None:
            continue
        cases = CONFIG_FILE_CASES if kind == "file" else CONFIG_DICT_CASES
        for args, names in cases:
            argv = [*_without_config(c.argv), *args]
            code, stderr = _run_case(c, argv)
            out.append({"cli": c.run, "argv": argv, "names": list(names), "code": code, "stderr": stderr})
    return out


def walk(clis=CLIS) -> dict:
    """{"cases": [{cli, flag, value, code, stderr}], "undeclared": {cli: [flag]}, "bad_defaults": {...},
    "config_cases": config_walk()}."""
    import warnings

    warnings.simplefilter("ignore")  # runpy's "found in sys.modules" for a module imported before
    out = {"cases": [], "undeclared": {}, "bad_defaults": {}, "config_cases": config_walk(clis)}
    for c in clis:
        mod = importlib.import_module(c.parser_module)
        if c.kind == "absl":
            cases, undeclared, bad_defaults = absl_flags(mod._define_flags)
        else:
            cases, undeclared, bad_defaults = argparse_flags(mod.arg_parser())
        out["undeclared"][c.run], out["bad_defaults"][c.run] = undeclared, bad_defaults
        for flag, value in cases:
            code, stderr = _run_case(c, [*c.argv, f"{flag}={value}"])
            out["cases"].append({"cli": c.run, "flag": flag, "value": value, "code": code, "stderr": stderr})
    return out


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    result = walk()
    sys.stdout.write(json.dumps(result) + "\n")
