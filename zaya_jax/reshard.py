"""`python -m zaya_jax.reshard --src CKPT --dst CKPT2 [--step N] --config.mesh.data=4 --config.mesh.expert=2
[--overwrite]`

Restores a training checkpoint (WORKDIR, WORKDIR/checkpoints or .../<step>) onto a different device
mesh and saves it under DST (same step, same data position; the saved config gets the new mesh;
SRC's tokenizer/ is copied too).
Orbax reads each array straight into the shards of the new layout: the restore target is the
abstract TrainState of the new mesh (`train_state.abstract_train_state`). Mesh keys not given keep
the source's values. `--config.mesh.zero1` may be changed too. A run on the new mesh then
resumes from DST (`python -m zaya_jax.train --workdir DST ...` with the same config and new mesh).
DST must be new or empty (`--overwrite` replaces an existing one, never the source's workdir) and
appears complete or not at all (zaya_jax.runtime.output_dir).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import ml_collections
from absl import app, flags, logging
from ml_collections import config_dict, config_flags

from zaya_jax import config as config_lib
from zaya_jax.data.tokenizer import load_tokenizer
from zaya_jax.hf.pretrained import TOKENIZER_DIR, store_tokenizer
from zaya_jax.parallel.mesh import check_mesh_sizes, mesh_from_config
from zaya_jax.runtime import cli, output_dir, workdir_lock
from zaya_jax.training.checkpoint import Checkpointer, checkpoint_workdir
from zaya_jax.training.train_state import abstract_train_state

MESH_KEYS = ("data", "fsdp", "expert", "zero1")


def reshard(
    src: str, dst: str, mesh: dict[str, Any], *, step: int | None = None, overwrite: bool = False
) -> dict[str, Any]:
    workdir, path_step = checkpoint_workdir(src)
    reading = [("the workdir of --src", workdir)]
    workdir_lock.check_free(dst, "reshard into it")  # a running trainer's workdir
    output_dir.check(dst, flag="--dst", overwrite=overwrite, reading=reading)  # before anything is read
    ck = Checkpointer(workdir, read_only=True)
    step = step if step is not None else path_step if path_step is not None else ck.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {ck.directory}")
    c = config_lib.from_json(ck.restore_config(step))
    old_mesh = {k: c.mesh[k] for k in MESH_KEYS}
    for k, v in mesh.items():
        if v is not None:
            c.mesh[k] = v
    cfg = config_lib.validate(c)
    new_mesh = mesh_from_config(c)
    target = abstract_train_state(c, cfg, new_mesh)
    state, data_state, _ = ck.restore(step, target)
    ck.close()
    with output_dir.staged(
        dst, flag="--dst", overwrite=overwrite, reading=reading, last=("checkpoints",)
    ) as tmp:
        out = Checkpointer(tmp, keep=0, async_save=False)
        out.save(step, state, data_state, json.loads(c.to_json_best_effort()))
        out.wait()
        out.close()
        stored = os.path.join(workdir, TOKENIZER_DIR)
        if os.path.isdir(stored):  # DST stands on its own as SRC did
            store_tokenizer(load_tokenizer(stored), tmp)
    return {
        "step": step,
        "src": os.path.join(ck.directory, str(step)),
        "dst": os.path.join(os.path.abspath(dst), "checkpoints", str(step)),
        "from_mesh": old_mesh,
        "to_mesh": dict(new_mesh.shape),
        "zero1": c.mesh.zero1,
    }


FLAGS = flags.FLAGS


def _define_flags(fv=None) -> None:
    """The CLI's flags, on absl's FLAGS (or the FlagValues `fv`)."""
    fv = FLAGS if fv is None else fv
    overrides = ml_collections.ConfigDict()
    overrides.mesh = ml_collections.ConfigDict(
        {k: config_dict.placeholder(bool if k == "zero1" else int) for k in MESH_KEYS}
    )
    try:  # reads its --config. overrides from sys.argv now
        config_flags.DEFINE_config_dict(
            "config", overrides, "Only config.mesh.* (the new mesh).", flag_values=fv
        )
    except (AttributeError, KeyError):
        known = [f"--config.mesh.{k}" for k in MESH_KEYS]
        bad = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config.")]
        bad = [a for a in bad if a not in known] or bad
        raise cli.UserError(
            f"{bad[0] if bad else '--config'}: unknown config key; reshard takes only {', '.join(known)}"
            f"{cli.near_key(bad[0][9:], [k[9:] for k in known], '--config.') if bad else ''}"
        ) from None
    flags.DEFINE_string("src", None, "source checkpoint", flag_values=fv)
    flags.DEFINE_string("dst", None, "destination WORKDIR", flag_values=fv)
    cli.define_flag("step", None, "source step (default: from --src, else the latest)", cli.Int(min=0), fv)
    flags.DEFINE_bool("overwrite", False, "replace --dst if it exists (never --src)", flag_values=fv)


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.src or not FLAGS.dst:
        raise app.UsageError("--src and --dst are required")
    mesh = FLAGS.config.mesh.to_dict()
    try:  # before the checkpoint is read: the sizes given (the source's fill the rest)
        check_mesh_sizes({k: v for k, v in mesh.items() if k != "zero1" and v is not None})
    except ValueError as e:
        raise ValueError(f"--config.{e}") from None
    print(json.dumps(reshard(FLAGS.src, FLAGS.dst, mesh, step=FLAGS.step, overwrite=FLAGS.overwrite)))


if __name__ == "__main__":
    cli.run_absl(main, _define_flags)
