"""`python -m zaya_jax.import_hf --hf HF_DIR --out CKPT_WORKDIR [--config configs/x.py] [--config.k=v ...]
[--overwrite]`

Writes a transformers ZayaForCausalLM directory as an Orbax training checkpoint: a TrainState at
step 0 with the HF params and balancing biases and a fresh optimizer state, under
CKPT_WORKDIR/checkpoints/0, which a run starts from with `--config.train.init_from=CKPT_WORKDIR`.
The directory's tokenizer (ours or a transformers tokenizer.json + tokenizer_config.json) is stored
as CKPT_WORKDIR/tokenizer, which evaluate, generate and export then use.
With --config the model section must describe the same parameter shapes (its compute settings are
kept); without it the model section comes from the HF config.json. CKPT_WORKDIR must be new or
empty (`--overwrite` replaces an existing one, never HF_DIR) and appears complete or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import config_flags

from zaya_jax import config as config_lib
from zaya_jax import hf
from zaya_jax.data.tokenizer import CONFIG_FILENAME, HF_FILENAME, load_tokenizer
from zaya_jax.hf.pretrained import TOKENIZER_DIR
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.runtime import cli, output_dir, workdir_lock
from zaya_jax.training.checkpoint import Checkpointer
from zaya_jax.training.train_state import train_program


def import_hf(hf_dir: str, out: str, c=None, *, overwrite: bool = False) -> dict:
    workdir_lock.check_free(out, "import into it")  # a running trainer's workdir
    reading = [("--hf", hf_dir)]
    output_dir.check(out, overwrite=overwrite, reading=reading)  # before the weights are read
    hf_cfg, variables = hf.load_pretrained(hf_dir)
    has_tokenizer = any(os.path.isfile(os.path.join(hf_dir, f)) for f in (CONFIG_FILENAME, HF_FILENAME))
    tok = load_tokenizer(hf_dir) if has_tokenizer else None
    if tok is not None and tok.vocab_size > hf_cfg.vocab_size:
        raise ValueError(f"{hf_dir}: tokenizer has {tok.vocab_size} tokens, the model {hf_cfg.vocab_size}")
    if c is None:
        c = config_lib.base_config()
        config_lib.set_model(c, hf_cfg)
    cfg = config_lib.validate(c)
    # the config's train program (optimizer, balancing, shardings): its abstract state is what the
    # HF tensors must match, its fresh state takes them in place of the random ones
    program = train_program(c, cfg, mesh_from_config(c))
    want = program.abstract_state().variables
    got_shapes = jax.tree.map(lambda x: tuple(x.shape), variables)
    want_shapes = jax.tree.map(lambda x: tuple(x.shape), want)
    if got_shapes != want_shapes:
        raise ValueError(
            f"{hf_dir}: its tensors do not match config.model (compare config.json with the --config)"
        )
    state = program.initial_state()
    cast = lambda new, old, s: jax.device_put(jnp.asarray(new, old.dtype), s)
    state = dataclasses.replace(
        state,
        params=jax.tree.map(cast, variables["params"], state.params, program.shardings.params),
        balancing=jax.tree.map(cast, variables["balancing"], state.balancing, program.shardings.balancing),
    )
    with output_dir.staged(out, overwrite=overwrite, reading=reading, last=("checkpoints",)) as tmp:
        ck = Checkpointer(tmp, keep=0, async_save=False)
        ck.save(0, state, {}, json.loads(c.to_json_best_effort()))
        ck.wait()
        ck.close()
        if tok is not None:
            tok.save(os.path.join(tmp, TOKENIZER_DIR))
    return {
        "out": os.path.abspath(out),
        "step": 0,
        "checkpoint": os.path.join(os.path.abspath(out), "checkpoints", "0"),
        "tokenizer": None if tok is None else tok.name,
    }


FLAGS = flags.FLAGS


def _define_flags(fv=None) -> None:
    """CLI flags, defined only when run as a program (on absl's FLAGS, or the FlagValues `fv`)."""
    fv = FLAGS if fv is None else fv
    config_flags.DEFINE_config_file(
        "config", None, "Training config file whose model section matches.", lock_config=True, flag_values=fv
    )
    flags.DEFINE_string("hf", None, "transformers ZayaForCausalLM directory", flag_values=fv)
    flags.DEFINE_string("out", None, "the new checkpoint WORKDIR", flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace --out if it exists (never --hf)", flag_values=fv)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.hf or not FLAGS.out:
        raise app.UsageError("--hf and --out are required")
    print(json.dumps(import_hf(FLAGS.hf, FLAGS.out, FLAGS.config, overwrite=FLAGS.overwrite)))


if __name__ == "__main__":
    cli.run_absl(main, _define_flags)
