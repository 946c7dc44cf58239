"""`python -m zaya_jax.evaluate --checkpoint CKPT_OR_HF_DIR --data SPEC [--data SPEC ...]`

Prints one table row per task and writes --out (JSON: settings + metrics per task) and, for
multiple-choice tasks, --samples-out (JSONL: every choice's log-likelihood per example).
Data SPECs and checkpoints: see zaya_jax/evaluate/__init__.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence

import jax
from absl import logging

from zaya_jax.evaluate import evaluate
from zaya_jax.hf.pretrained import PREFIX_FLAG
from zaya_jax.parallel.distributed import initialize_from_env
from zaya_jax.parallel.mesh import MESH_FLAG
from zaya_jax.runtime import cli, interrupt


def format_table(results: dict) -> str:
    rows = [("task", "kind", "n", "metric", "value", "± stderr / ppl", "seconds")]
    for name, m in results.items():
        if m["kind"] == "mc":
            for key in ("acc", "acc_norm"):
                rows.append(
                    (name, "mc", str(m["examples"]), key, f"{m[key]:.4f}", f"{m[key + '_stderr']:.4f}", "")
                )
        else:
            rows.append(
                (
                    name,
                    m["kind"],
                    str(m["documents"]),
                    "bits/byte",
                    f"{m['bits_per_byte']:.4f}",
                    f"{m['perplexity']:.3f}",
                    "",
                )
            )
        rows[-1] = (*rows[-1][:-1], f"{m['seconds']:.1f}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def arg_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--checkpoint", required=True, help="Orbax WORKDIR[/checkpoints[/STEP]] or an HF directory"
    )
    ap.add_argument("--data", action="append", required=True, help="a task (repeatable): see --help above")
    ap.add_argument("--split", default="eval", choices=("train", "eval"), help="split of token data")
    ap.add_argument(
        "--batch-size",
        type=cli.Int(min=1),
        default=None,
        help="rows per step (default 8, rounded up to the mesh)",
    )
    ap.add_argument(
        "--max-len",
        type=cli.Int(min=2),
        default=None,
        help="tokens per row (default: the checkpoint's train.seq_len, else the model's max positions)",
    )
    ap.add_argument("--min-bucket", type=cli.Int(min=1), default=64, help="shortest sequence bucket")
    ap.add_argument(
        "--stride",
        type=cli.Int(min=1),
        default=None,
        help="perplexity: new tokens per window (default max-len)",
    )
    ap.add_argument(
        "--mesh",
        type=MESH_FLAG,
        default="auto",
        help="none | auto (all devices, data parallel) | data=2,expert=4",
    )
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="compute dtype override")
    ap.add_argument("--tokenizer", default=None, help="override: byte, a tokenizer.json or a saved dir")
    ap.add_argument(
        "--prefix",
        type=PREFIX_FLAG,
        default="auto",
        help="auto | bos | eos | ID: token every request starts with; none: only requests without "
        "context (lm-eval's default)",
    )
    ap.add_argument("--delimiter", default=" ", help="multiple choice: between context and choice")
    ap.add_argument("--separator", default=None, help="text: document separator (blank-line, form-feed, ...)")
    ap.add_argument("--text-field", default="text", help="text .jsonl: the field holding the text")
    ap.add_argument(
        "--limit", type=cli.Int(min=1), default=None, help="only the first N examples / documents per task"
    )
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--samples-out", default=None, help="write per-example multiple-choice scores (JSONL)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    a = arg_parser().parse_args(argv)
    logging.set_verbosity(logging.WARNING)
    initialize_from_env()
    unwritten = ", ".join(f for f, v in (("--out", a.out), ("--samples-out", a.samples_out)) if v)
    kept = f"nothing written ({unwritten}: written once every task is scored)" if unwritten else ""
    try:
        with interrupt.handled("evaluate", mode="raise", kept=lambda: kept):
            out = _evaluate(a)
    except interrupt.Interrupted as e:
        raise interrupt.Interrupted(e.signum, kept) from None
    samples = out.pop("samples")
    if jax.process_index() == 0:
        print(format_table(out["results"]))
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(_finite(out), f, indent=2)
        if a.samples_out:
            os.makedirs(os.path.dirname(os.path.abspath(a.samples_out)), exist_ok=True)
            with open(a.samples_out, "w") as f:
                for task, rows in samples.items():
                    f.writelines(json.dumps({"task": task, **row}) + "\n" for row in rows)
    return out


def _evaluate(a: argparse.Namespace) -> dict:
    return evaluate(
        a.checkpoint,
        a.data,
        mesh=a.mesh,
        batch_size=a.batch_size,
        max_len=a.max_len,
        min_bucket=a.min_bucket,
        dtype=a.dtype,
        tokenizer=a.tokenizer,
        prefix=a.prefix,
        split=a.split,
        stride=a.stride,
        delimiter=a.delimiter,
        separator=a.separator,
        text_field=a.text_field,
        limit=a.limit,
        progress=not a.quiet,
        log=lambda line: print(line, flush=True) if jax.process_index() == 0 else None,
    )


def _finite(x):
    """JSON has no NaN/inf: they become null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


if __name__ == "__main__":
    cli.run(main)
