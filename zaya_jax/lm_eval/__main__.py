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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from zaya_jax import cli
from zaya_jax.lm_eval import require_lm_eval

MODEL = "zaya_jax"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_args(args: argparse.Namespace) -> None:
    """lm-eval's numeric / enumerated flags and zaya_jax's --model_args, range-checked: ValueError
    naming the flag. Rewrites args.model_args (checked, with the batch size settled)."""
    from zaya_jax.lm_eval.backend import check_gen_kwargs, check_model_args

    if args.limit is not None and not (
        0 < args.limit < 1 or (args.limit >= 1 and args.limit == int(args.limit))
    ):
        raise ValueError(f"--limit {args.limit}: must be a whole count >= 1 or a fraction in (0, 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num_fewshot {args.num_fewshot}: must be >= 0")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ValueError(f"--max_batch_size {args.max_batch_size}: must be >= 1")
    for seed in args.seed or ():
        if seed is not None and not 0 <= seed < 2**32:
            raise ValueError(f"--seed {seed}: must be in [0, 2**32)")
    if args.verbosity is not None and args.verbosity not in LOG_LEVELS:
        raise ValueError(f"--verbosity {args.verbosity}: must be one of {', '.join(LOG_LEVELS)}")
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
        if not str(flag).isdigit() or int(flag) < 1:
            raise ValueError(f"--batch_size {flag}: zaya_jax takes a whole number >= 1 (no 'auto')")
        if model_args.get("batch_size") not in (None, int(flag)):
            raise ValueError(
                f"--batch_size {flag} and --model_args batch_size={model_args['batch_size']} differ"
            )
        model_args["batch_size"] = int(flag)
    model_args.setdefault("batch_size", None)  # the backend's default, not lm-eval's batch_size=1
    args.model_args = model_args


def _raise_user_error(message: str) -> NoReturn:
    raise cli.UserError(message)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """lm-eval's parser (`run` inserted unless a subcommand comes first), its errors one line."""
    from lm_eval._cli.harness import HarnessCLI

    harness = HarnessCLI()
    parsers = [harness._parser, *harness._subparsers.choices.values()]
    for p in parsers:
        p.error = _raise_user_error  # argparse's usage + message + exit -> one `error:` line
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
    return args.func(args)


if __name__ == "__main__":
    cli.run(main)
