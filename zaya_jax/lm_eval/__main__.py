"""`python -m zaya_jax.lm_eval --model zaya_jax --model_args checkpoint=PATH[,...] --tasks ... [flags]`

lm-eval's own command line (`lm-eval run`, or `ls` / `validate` when named first) with the model
`zaya_jax` registered and the default model. Before anything is loaded, the numeric and enumerated
values are checked (`check_args`): a bad one, like any user error, ends with one `error:` line
naming it (exit 2). `--batch_size N` is the backend's batch_size (model_args' wins when both are
set and equal; without either the backend's default applies, not lm-eval's 1).

Several processes (launch/local_multiprocess.sh, SLURM): every process runs every request on the
mesh over all of them; only process 0 prints and writes --output_path (each process is lm-eval's
rank 0 of one, and LOCAL_RANK = its process index keeps lm-eval's output on process 0 and gives
each process its own --use_cache file, as lm-eval does for tensor-parallel launchers).

SIGINT / SIGTERM stop it within seconds with one line, exit 130 / 143 (zaya_jax/runtime/interrupt.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from zaya_jax.lm_eval import require_lm_eval
from zaya_jax.runtime import cli, interrupt

MODEL = "zaya_jax"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _limit(text: str) -> float:
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value == int(value))):
        raise ValueError("outside")
    return value


def _seeds(text: str) -> list[int | None]:
    """lm-eval's --seed: one seed for all, or four comma-separated ones (None allowed), each in
    [0, 2**32): numpy's seeds."""
    parts = text.split(",")
    if len(parts) not in (1, 4):
        raise ValueError("one or four values")
    seeds = [None if p.strip() == "None" else int(p) for p in parts]
    if any(s is not None and not 0 <= s < 2**32 for s in seeds):
        raise ValueError("outside [0, 2**32)")
    return seeds * 4 if len(seeds) == 1 else seeds


def _verbosity(text: str) -> str:
    return cli.OneOf(*LOG_LEVELS).parse(text.upper())


# lm-eval's numeric and enumerated flags of `run`, declared with zaya_jax.runtime.cli's values (the walking
# test, tests/support/cli_walk.py, feeds each the values it refuses).
DECLARED = {
    "--limit": cli.Parsed(_limit, "a whole count >= 1 or a fraction in (0, 1)", ("0", "2.5", "-1")),
    "--num_fewshot": cli.Int(min=0),
    "--max_batch_size": cli.Int(min=1),
    "--batch_size": cli.Int(min=1, what="a whole number (zaya_jax takes no 'auto')"),
    "--seed": cli.Parsed(_seeds, "one or four seeds in [0, 2**32) (or None)", ("-1", "4294967296", "1,2")),
    "--verbosity": cli.Parsed(_verbosity, f"one of {', '.join(LOG_LEVELS)}", ("loud",)),
}


def check_args(args: argparse.Namespace) -> None:
    """zaya_jax's --model_args and --gen_kwargs, range-checked (lm-eval's own flags are declared
    on the parser: DECLARED): ValueError naming the flag. Rewrites args.model_args (checked, with
    the batch size settled)."""
    from zaya_jax.lm_eval.backend import check_gen_kwargs, check_model_args

    if args.model != MODEL:
        return
    if getattr(args, "apply_chat_template", False):
        raise ValueError("--apply_chat_template: zaya_jax models have no chat template")
    check_gen_kwargs(args.gen_kwargs or {}, "--gen_kwargs")
    model_args = dict(args.model_args or {})
    # lm-eval names its --output_path folder after `pretrained` (a random name without)
    model_args.setdefault("pretrained", check_model_args(model_args).checkpoint)
    flag = getattr(args, "batch_size", None)  # absent unless given (argparse.SUPPRESS)
    if flag is not None:
        if model_args.get("batch_size") not in (None, flag):
            raise ValueError(
                f"--batch_size {flag} and --model_args batch_size={model_args['batch_size']} differ"
            )
        model_args["batch_size"] = flag
    model_args.setdefault("batch_size", None)  # the backend's default, not lm-eval's batch_size=1
    args.model_args = model_args


def _raise_user_error(message: str) -> NoReturn:
    raise cli.UserError(message)


def _harness():
    """lm-eval's command line, its `run` flags typed by DECLARED, every parser's errors one line."""
    from lm_eval._cli.harness import HarnessCLI

    harness = HarnessCLI()
    for p in [harness._parser, *harness._subparsers.choices.values()]:
        p.error = _raise_user_error  # argparse's usage + message + exit -> one `error:` line
    for action in harness._subparsers.choices["run"]._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in DECLARED:
            action.type = DECLARED[flag]
    return harness


def arg_parser() -> argparse.ArgumentParser:
    """The parser of `python -m zaya_jax.lm_eval [run] ...` (lm-eval's, flags declared)."""
    require_lm_eval("python -m zaya_jax.lm_eval")
    return _harness()._subparsers.choices["run"]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """lm-eval's parser (`run` inserted unless a subcommand comes first), its errors one line."""
    harness = _harness()
    argv = list(argv)
    if not argv or argv[0] not in harness._subparsers.choices:
        argv = ["run", *argv]
    args = harness._parser.parse_args(argv)
    if args.command == "run" and args.model is None:
        args.model = MODEL
    return args


def main(argv: Sequence[str] | None = None) -> Any:
    require_lm_eval("python -m zaya_jax.lm_eval")
    import jax
    from lm_eval.utils import setup_logging

    import zaya_jax.lm_eval.backend  # noqa: F401  (registers --model zaya_jax)
    from zaya_jax.parallel.distributed import initialize_from_env

    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        check_args(args)
    logging.getLogger("absl").setLevel(logging.WARNING)
    setup_logging()
    initialize_from_env()
    if jax.process_count() > 1:
        os.environ["LOCAL_RANK"] = str(jax.process_index())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    output = getattr(args, "output_path", None)
    kept = f"nothing written to {output} (written once every task is done)" if output else ""
    try:
        with interrupt.handled("lm_eval", mode="raise", kept=lambda: kept):
            return args.func(args)
    except interrupt.Interrupted as e:
        raise interrupt.Interrupted(e.signum, kept) from None


if __name__ == "__main__":
    cli.run(main)
