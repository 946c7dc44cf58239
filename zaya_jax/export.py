"""`python -m zaya_jax.export --checkpoint WORKDIR[/checkpoints/STEP] --out HF_DIR [--dtype bfloat16]
[--tokenizer byte|tokenizer.json|DIR] [--max-shard-bytes N]`

Writes a training checkpoint as a transformers ZayaForCausalLM directory: config.json,
generation_config.json, safetensors (sharded with an index past --max-shard-bytes) and the
tokenizer files. Only the params and balancing biases are read from the Orbax checkpoint (no
optimizer state); the model config is rebuilt from the training config saved with it. The
safetensors are written tensor by tensor (zaya_jax.hf.save_pretrained). Without --tokenizer the
training data's own tokenizer is written (the byte tokenizer for the embedded corpus).
"""

from __future__ import annotations

import argparse
import json
import os

from absl import logging

from zaya_jax import cli, hf
from zaya_jax.pretrained import load_checkpoint_variables
from zaya_jax.tokenizer import load_tokenizer


def export(
    checkpoint: str,
    out: str,
    *,
    dtype: str = "bfloat16",
    tokenizer: str | None = None,
    max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
) -> dict:
    c, cfg, variables, step = load_checkpoint_variables(checkpoint)
    hf.save_pretrained(cfg, variables, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if tokenizer is None:
        from zaya_jax.data.pipeline import source_tokenizer

        tok = source_tokenizer(c.data.path)
    else:
        tok = load_tokenizer(tokenizer)
    tok.save(out)
    return {
        "step": step,
        "out": os.path.abspath(out),
        "dtype": dtype,
        "tokenizer": tok.name,
        "files": sorted(os.listdir(out)),
    }


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", required=True, help="WORKDIR (latest step), WORKDIR/checkpoints or .../<step>"
    )
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(hf.EXPORT_DTYPES))
    p.add_argument("--tokenizer", default=None, help="byte, a tokenizer.json or a saved tokenizer dir")
    p.add_argument("--max-shard-bytes", type=int, default=hf.DEFAULT_MAX_SHARD_BYTES)
    a = p.parse_args(argv)
    logging.set_verbosity(logging.WARNING)
    print(
        json.dumps(
            export(
                a.checkpoint, a.out, dtype=a.dtype, tokenizer=a.tokenizer, max_shard_bytes=a.max_shard_bytes
            )
        )
    )


if __name__ == "__main__":
    cli.run(main)
