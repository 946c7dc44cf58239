"""`python -m zaya_jax.export --checkpoint WORKDIR[/checkpoints/STEP] --out HF_DIR [--dtype bfloat16]
[--tokenizer byte|tokenizer.json|DIR] [--max-shard-bytes N] [--overwrite]`

Writes a training checkpoint as a transformers ZayaForCausalLM directory: config.json,
generation_config.json, safetensors (sharded with an index past --max-shard-bytes) and the
tokenizer: zaya_tokenizer.json (ours) and tokenizer.json + tokenizer_config.json, which
`AutoTokenizer.from_pretrained` reads with the same ids (zaya_jax.data.tokenizer.save_for_transformers).
config.json and generation_config.json carry the tokenizer's pad / bos / eos ids. Only the params and balancing biases are read from the Orbax checkpoint (no
optimizer state); the model config is rebuilt from the training config saved with it. The
safetensors are written tensor by tensor (zaya_jax.hf.save_pretrained). Without --tokenizer the
run's own tokenizer is written (WORKDIR/tokenizer; see zaya_jax/hf/pretrained.py), and stderr names the
file it was read from.
HF_DIR must be new or empty (`--overwrite` replaces an existing one) and outside the checkpoint's
workdir; it appears complete or not at all (zaya_jax.runtime.output_dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
from absl import logging

from zaya_jax import hf
from zaya_jax.data.tokenizer import load_tokenizer, save_for_transformers
from zaya_jax.hf.pretrained import checkpoint_tokenizer, is_hf_dir, load_checkpoint_variables, tokenizer_file
from zaya_jax.runtime import cli, output_dir, workdir_lock
from zaya_jax.training.checkpoint import checkpoint_workdir


def skip_bias_warning(variables: dict) -> str | None:
    """Why transformers would load these weights differently, if it would.

    transformers 5.23's ZayaRouter._init_weights writes balancing_biases[-1] = -1 after the weights
    are loaded (an unguarded in-place write), so a skip-class bias moved away from its initial -1
    (balancing update_skip=True) is lost in transformers; our loaders keep it.
    """
    skip_l = np.asarray(variables["balancing"]["layers"]["mlp"]["gate"]["balancing_biases"])[:, -1]
    moved = np.flatnonzero(skip_l != -1.0)
    if not moved.size:
        return None
    return (
        f"layers {moved.tolist()}: skip-class balancing bias {skip_l[moved].tolist()} != -1; "
        "transformers==5.23.0 resets it to -1 when loading, so its outputs will differ from ours"
    )


def export(
    checkpoint: str,
    out: str,
    *,
    dtype: str = "bfloat16",
    tokenizer: str | None = None,
    max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> dict:
    if is_hf_dir(checkpoint):
        raise cli.UserError(
            f"--checkpoint {checkpoint} is a Hugging Face directory (it has config.json), already "
            "exported; export reads a training checkpoint: pass WORKDIR, WORKDIR/checkpoints or "
            "WORKDIR/checkpoints/STEP (generate and evaluate read HF directories as they are)"
        )
    workdir_lock.check_free(out, "export into it")  # a running trainer's workdir
    reading = [("the workdir of --checkpoint", checkpoint_workdir(checkpoint)[0])]
    if tokenizer not in (None, "byte"):
        reading.append(("--tokenizer", tokenizer))
    output_dir.check(out, overwrite=overwrite, reading=reading)  # before the checkpoint is read
    c, cfg, variables, step = load_checkpoint_variables(checkpoint)
    if tokenizer is None and c.data.path and os.path.isdir(c.data.path):  # its tokenizer may be read
        reading.append(("the training data", c.data.path))
    if tokenizer is None:
        tok, tok_file = checkpoint_tokenizer(c, checkpoint, step)
    else:
        tok, tok_file = load_tokenizer(tokenizer), tokenizer_file(tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    # the special ids transformers' generate and pipelines use are the tokenizer's
    cfg = dataclasses.replace(cfg, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    with output_dir.staged(out, overwrite=overwrite, reading=reading, last=("config.json",)) as tmp:
        hf.save_pretrained(cfg, variables, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
        tok.save(tmp)
        save_for_transformers(tok, tmp)
    warning = skip_bias_warning(variables)
    if warning:
        logging.warning("export %s: %s", out, warning)
    return {
        "warnings": [warning] if warning else [],
        "step": step,
        "out": os.path.abspath(out),
        "dtype": dtype,
        "tokenizer": tok.name,
        "tokenizer_file": tok_file,
        "files": sorted(os.listdir(out)),
    }


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="WORKDIR (latest step), WORKDIR/checkpoints or .../<step>"
    )
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(hf.EXPORT_DTYPES))
    p.add_argument("--tokenizer", default=None, help="byte, a tokenizer.json or a saved tokenizer dir")
    p.add_argument("--max-shard-bytes", type=cli.Int(min=1), default=hf.DEFAULT_MAX_SHARD_BYTES)
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (never the checkpoint)"
    )
    return p


def main(argv=None):
    a = arg_parser().parse_args(argv)
    logging.set_verbosity(logging.WARNING)
    out = export(
        a.checkpoint,
        a.out,
        dtype=a.dtype,
        tokenizer=a.tokenizer,
        max_shard_bytes=a.max_shard_bytes,
        overwrite=a.overwrite,
    )
    print(f"tokenizer {out['tokenizer']}: {out['tokenizer_file']}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    cli.run(main)
