"""The training config of a benchmark: a config file and its overrides, validated at start-up."""

from __future__ import annotations

import argparse
import importlib.util
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

from zaya_jax import config as config_lib
from zaya_jax.model import ZayaConfig

DTYPES = ("float32", "bfloat16")


# ------------------------------------------------------------------------------------------ config
def load_config(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of a config file; `file.py:arg` passes `arg` as for zaya_jax.train."""
    path, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location(f"_benchmark_config_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--config {path!r}: not a python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


OVERRIDE = "--config."  # ml_collections' own override flags, as `python -m zaya_jax.train` reads them


def apply_override(c: ml_collections.ConfigDict, assignment: str) -> None:
    """`section.key=value` into `c`, the value parsed by ml_collections' config flag as the field's
    type (as `--config.section.key=value`); KeyError for an unknown key."""
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ValueError(f"{OVERRIDE}{assignment}: expected {OVERRIDE}KEY=VALUE")
    *parents, name = key.strip().split(".")
    node = c
    for part in parents:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise KeyError(f"{OVERRIDE}{key}: no config section {part!r}")
        node = node[part]
    if name not in node:
        raise KeyError(f"{OVERRIDE}{key}: unknown key (known here: {sorted(node.keys())})")
    argv = ["benchmark", f"{OVERRIDE}{key.strip()}={raw}"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", c, flag_values=fv, sys_argv=argv)
    try:
        fv(argv)
    except flags.Error as e:
        raise ValueError(str(e)) from None


def parse_with_overrides(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """p's arguments, and every `--config.KEY=VALUE` (or `--config.KEY VALUE`) into args.set as
    KEY=VALUE; any other unknown argument is p's usage error."""
    args, rest = p.parse_known_args(argv)
    args.set, other = [], []
    while rest:
        item = rest.pop(0)
        if not item.startswith(OVERRIDE):
            other.append(item)
        elif "=" in item:
            args.set.append(item[len(OVERRIDE) :])
        elif rest:
            args.set.append(f"{item[len(OVERRIDE) :]}={rest.pop(0)}")
        else:
            other.append(item)
    if other:
        p.error(f"unrecognized arguments: {' '.join(other)}")
    return args


def build_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """The config file + `--config.` overrides + `--dtype`, validated (ValueError / KeyError names the key)."""
    c = load_config(args.config)
    for assignment in args.set or []:
        apply_override(c, assignment)
    if args.dtype:
        c.model.dtype = args.dtype
    cfg = config_lib.validate(c)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype={cfg.dtype!r}: this benchmark supports {DTYPES}")
    return c, cfg


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--config, as build_config reads it with its `--config.KEY=VALUE` overrides (parse_with_overrides)."""
    p.add_argument(
        "--config",
        default="configs/tiny.py",
        help="training config file (default configs/tiny.py); override any key with --config.KEY=VALUE, "
        "repeatable, e.g. --config.train.batch_size=4 --config.model.num_hidden_layers=2",
    )


def checked_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """build_config at start-up: a bad config file or override ends in one `error:` line."""
    try:
        return build_config(args)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")
