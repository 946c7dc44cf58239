"""The training config of a benchmark: a config file and its overrides, validated at start-up."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from typing import Any

import ml_collections

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


def _parse_value(raw: str, typ: Any) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    if typ is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a bool, got {raw!r}")
    if typ is int:
        return int(raw)
    if typ is float:
        return float(raw)
    if typ is str:
        return raw
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def apply_override(c: ml_collections.ConfigDict, assignment: str) -> None:
    """`section.key=value` (value parsed as the field's type) into `c`; KeyError for unknown keys."""
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set {assignment!r}: expected key=value")
    *parents, name = key.strip().split(".")
    node = c
    for part in parents:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise KeyError(f"--set {key}: no config section {part!r}")
        node = node[part]
    if name not in node:
        raise KeyError(f"--set {key}: unknown key (known here: {sorted(node.keys())})")
    try:
        node[name] = _parse_value(raw.strip(), node.get_type(name))
    except (TypeError, ValueError) as e:
        raise ValueError(f"--set {key}={raw}: {e}") from None


def build_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """The config file + `--set` overrides + `--dtype`, validated (ValueError / KeyError names the key)."""
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
    """--config and --set, as build_config reads them (the benchmarks that build a training config)."""
    p.add_argument(
        "--config", default="configs/tiny.py", help="training config file (default configs/tiny.py)"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config override, repeatable: --set train.batch_size=4 --set model.num_hidden_layers=2",
    )


def checked_config(args: argparse.Namespace) -> tuple[ml_collections.ConfigDict, ZayaConfig]:
    """build_config at start-up: a bad config file or override ends in one `error:` line."""
    try:
        return build_config(args)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")
