"""`python -m zaya_jax.train --config configs/<name>.py --workdir DIR [--config.train.steps=100 ...]`

Trains a ZAYA1 model: validated config -> data (grain) -> jit-compiled train step with our Muon /
AdamW chain and aux-loss-free router balancing -> metrics (console, WORKDIR/metrics.jsonl,
TensorBoard) -> periodic held-out evaluation -> Orbax checkpoints. An existing WORKDIR resumes from
its latest checkpoint, data position included, read straight into the sharded arrays (a checkpoint
of another model or optimizer is an error that moves nothing; an unreadable newest checkpoint is
skipped with a warning; if none is readable the run stops with an error).

One run per workdir: the run holds WORKDIR/zaya_jax.lock (zaya_jax/runtime/workdir_lock.py). A resume
says which checkpoint it read and refuses other data or another learning-rate plan unless
allowed (zaya_jax/training/resume.py). Before the first step the train and eval steps are compiled and
their memory compared with the devices' (zaya_jax/runtime/device_memory.py): a step that cannot fit is one
`error:` line, the workdir left as it was. Fault handling, the one-step-late loss read, and where each part
lives: docs/design/trainer.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from zaya_jax.analysis import dry_run, hardware, prediction
from zaya_jax.parallel.distributed import initialize_from_env
from zaya_jax.runtime import cli, gpu_target, host_memory
from zaya_jax.runtime.cli import UserError
from zaya_jax.trainer.loop import Trainer
from zaya_jax.training import fault


def train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the training described by `c` in `workdir`. Returns a summary dict."""
    return Trainer(c, workdir).run()


FLAGS = flags.FLAGS


def _define_flags(fv=None) -> None:
    """CLI flags, defined only when run as a program: importing this module defines none. On absl's
    FLAGS, or the FlagValues `fv`; numeric and enumerated ones declare their values
    (zaya_jax/runtime/cli.py)."""
    fv = FLAGS if fv is None else fv
    config_flags.DEFINE_config_file(
        "config", None, "Training config file (configs/<name>.py[:arg]).", lock_config=True, flag_values=fv
    )
    flags.DEFINE_string(
        "workdir", None, "Run directory: checkpoints, metrics.jsonl, TensorBoard.", flag_values=fv
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Compile the full-size train step (for --dry_run_target), print memory per device, "
        "collectives and compile time, and exit; needs no --workdir (zaya_jax/analysis/dry_run.py).",
        flag_values=fv,
    )
    cli.define_flag(
        "dry_run_devices",
        None,
        "Devices --dry_run simulates (default: the mesh size; 8 if an axis is -1).",
        cli.Int(min=1),
        fv,
    )
    cli.define_flag(
        "dry_run_target",
        "cpu",
        "What --dry_run compiles for: cpu (simulated CPU devices), mi300x, h100 or h200 (deviceless GPUs, "
        "XLA's GPU compiler; pip install -e '.[gpu_compile]'), or a GpuTargetConfig text file.",
        gpu_target.TARGET_FLAG,
        fv,
    )
    flags.DEFINE_bool(
        "dry_run_fit",
        False,
        "With a GPU --dry_run_target: also find the largest microbatch (sequences per device) that fits.",
        flag_values=fv,
    )
    cli.define_flag(
        "dry_run_hardware",
        None,
        "A JSON file of hardware figures (any keys of zaya_jax/analysis/hardware.py) overriding the "
        "--dry_run_target's in the predicted step, e.g. a cluster's measured bandwidths.",
        cli.Parsed(hardware.read_file, "a JSON file of hardware keys", invalid=("/nonexistent/hw.json",)),
        fv,
    )
    cli.define_flag(
        "dry_run_json",
        None,
        "Also write the --dry_run report as JSON to this file (also when the step does not fit).",
        cli.Parsed(
            _new_file, "a file path in an existing directory", invalid=("/nonexistent/dir/report.json",)
        ),
        fv,
    )


def _new_file(path: str) -> str:
    """A path a report can be written to: its directory exists and it is not a directory."""
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError("no such directory" if not os.path.isdir(path) else "a directory")
    return path


def main(argv):
    if FLAGS.config is not None:
        # before jax creates a backend (XLA reads XLA_FLAGS then) and starts its threads; may
        # re-execute this command once (zaya_jax/runtime/host_memory.py). Checked as booleans later.
        t = FLAGS.config.train
        host_memory.configure(reuse=t.reuse_host_memory is True, lean=t.lean_cpu_compile is True)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if (FLAGS.dry_run_json or FLAGS.dry_run_hardware) and not FLAGS.dry_run:
        raise app.UsageError("--dry_run_json and --dry_run_hardware go with --dry_run")
    if FLAGS.dry_run and FLAGS.config is not None:  # before jax starts: it picks the simulated devices
        fault.install_stop_signals("during the dry run; nothing written")
        name = config_flags.get_config_filename(FLAGS["config"])
        report = dry_run.dry_run(
            FLAGS.config,
            FLAGS.dry_run_devices,
            name,
            target=FLAGS.dry_run_target,
            fit=FLAGS.dry_run_fit,
            hardware_override=FLAGS.dry_run_hardware,
        )
        print(report.text, flush=True)
        if FLAGS.dry_run_json:
            prediction.write_json(FLAGS.dry_run_json, report.data)
        if report.error:
            raise UserError(report.error)
        return
    if FLAGS.config is None or not FLAGS.workdir:
        raise app.UsageError("--config and --workdir are required")
    fault.install_stop_signals("before the first step; nothing saved")
    initialize_from_env()
    if jax.process_index() == 0:
        devices = jax.devices()
        print(
            f"train: {config_flags.get_config_filename(FLAGS['config'])} in {os.path.abspath(FLAGS.workdir)}, "
            f"{len(devices)} {devices[0].platform} device(s) in {jax.process_count()} process(es)",
            flush=True,
        )
    summary = train(FLAGS.config, FLAGS.workdir)
    print(json.dumps({"summary": summary}))
    signum = summary.get("stopped_by_signal")
    return None if signum is None else 128 + signum  # saved, but the run did not finish


if __name__ == "__main__":
    cli.run_absl(main, _define_flags)
