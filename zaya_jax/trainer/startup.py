"""What a training run checks and builds before its first step: inputs, the workdir lock, the
compiled steps' memory against the devices', data, checkpoints, `train.init_from`."""

from __future__ import annotations

import dataclasses
import os

import jax
import ml_collections

from zaya_jax import config as config_lib
from zaya_jax.analysis import fit
from zaya_jax.data import mixture as mixture_lib
from zaya_jax.data.megatron import MegatronOptions
from zaya_jax.data.megatron_format import check_token_ids, megatron_prefix, stderr_progress
from zaya_jax.data.pipeline import (
    batch_sequences,
    load_documents,
    make_dataset,
    source_tokenizer,
)
from zaya_jax.data.ramp import BatchRamp, parse_batch_ramp
from zaya_jax.hf.pretrained import check_stored_tokenizer
from zaya_jax.runtime import device_memory, workdir_lock
from zaya_jax.runtime.cli import UserError
from zaya_jax.trainer.evaluations import eval_rows
from zaya_jax.training import fault
from zaya_jax.training.checkpoint import Checkpointer, CheckpointError, abstract_like, checkpoint_workdir
from zaya_jax.training.train_state import (
    TrainState,
    abstract_batch,
)


def _checked_inputs(c: ml_collections.ConfigDict, workdir: str):
    """(validated ZayaConfig, data.mixture sources or None, the data's tokenizer), every input
    checked before anything is built; then creates `workdir` (every process: each writes into it)."""
    cfg = config_lib.validate(c)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UserError(f"--workdir {workdir} is a file, not a directory")
    sources = mixture_lib.parse_mixture(c.data.mixture) if c.data.mixture else None
    tokenizer = source_tokenizer(sources[0].path if sources else c.data.path, MegatronOptions.of(c.data))
    data_key = (
        f"config.data.mixture source {sources[0].path}"
        if sources
        else f"config.data.path={c.data.path or 'embedded'}"
    )
    check_stored_tokenizer(tokenizer, workdir, data_key)  # a resume on data of another tokenizer
    check_eval_data(c, sources)  # before step 1, not at the first evaluation
    if c.train.init_from:
        _init_from_checkpoint(c.train.init_from)[0].close()  # it exists, checked before anything is built
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer "
            f"vocabulary ({tokenizer.vocab_size}, {tokenizer.name})"
        )
    _check_megatron_tokens(c, sources, tokenizer.vocab_size)
    os.makedirs(workdir, exist_ok=True)
    return cfg, sources, tokenizer


def _check_megatron_tokens(c: ml_collections.ConfigDict, sources, vocab_size: int) -> None:
    """Every token id of every Megatron source below the tokenizer's vocabulary (itself within the
    model's): one scan of each .bin at start-up, with progress lines on stderr."""
    paths = [s.path for s in sources] if sources else [c.data.path]
    progress = stderr_progress if jax.process_index() == 0 else None
    for path in paths:
        prefix = megatron_prefix(path)
        if prefix is not None:
            check_token_ids(prefix, vocab_size, progress)


def _lock_workdir(workdir: str) -> workdir_lock.WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole run (zaya_jax/runtime/workdir_lock.py); the other
    processes of the run (one run, several processes) learn its outcome and stop with it."""
    lock, refused = None, ""
    if jax.process_index() == 0:
        try:
            lock = workdir_lock.acquire(workdir, "train")
        except UserError as e:
            refused = str(e)
    refused = fault.share_from_first("workdir_lock", refused)
    if refused:
        if lock is not None:
            lock.release()
        raise workdir_lock.WorkdirLocked(refused)
    return lock


def _check_memory(c: ml_collections.ConfigDict, program, abstract_state, eval_step) -> None:
    """Refuses, before anything is allocated or saved, a train step at the full batch, or the held-out
    evaluation's step (every run evaluates at its last step), that needs more memory than this
    process' devices have (zaya_jax/runtime/device_memory.py). Both are compiled here from abstract shapes;
    the run's first calls reuse the compiles."""
    mesh = program.mesh
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    eval_remedies = f"lower eval.batch_size (now {c.eval.batch_size}), or add devices"
    programs = (
        ("the train step", program.train_step, abstract_state, c.train.batch_size),
        ("the evaluation step", eval_step, abstract_state.variables, eval_rows(c, mesh)),
    )
    for what, jitted, state, rows in programs:
        batch = abstract_batch(rows, c.train.seq_len, mesh)
        remedies = fit.memory_remedies(c, mesh) if jitted is program.train_step else eval_remedies
        try:
            stats = jitted.lower(state, batch).compile().memory_analysis()
        except jax.errors.JaxRuntimeError as e:  # a compiler that refuses what cannot fit
            reason = str(e).strip().splitlines()[0][:300]
            if "RESOURCE_EXHAUSTED" not in reason and "out of memory" not in reason.lower():
                raise
            raise UserError(
                f"{what} does not fit this machine's memory (XLA: {reason}): {remedies}"
            ) from None
        error = None if stats is None else device_memory.shortfall(stats, local, what, remedies)
        if error is not None:
            raise UserError(error)


def _missing_root(path: str) -> str | None:
    """The outermost directory of `path` that does not exist yet; None when `path` exists."""
    path, root = os.path.abspath(path), None
    while not os.path.exists(path):
        path, root = os.path.dirname(path), path
    return root


def _remove_created(workdir: str, root: str | None) -> None:
    """Removes the empty directories from `workdir` up to `root` (those this run created)."""
    path = os.path.abspath(workdir)
    while root is not None and path.startswith(root):
        try:
            os.rmdir(path)
        except OSError:
            return  # something was written there meanwhile: leave it
        path = os.path.dirname(path)


def _batch_ramp(c: ml_collections.ConfigDict, devices: int) -> BatchRamp:
    ramp = parse_batch_ramp(c.train.batch_ramp, c.train.batch_size)
    try:
        ramp.check_divisible(devices, c.train.grad_accum)
    except ValueError as e:
        raise ValueError(f"config.train.batch_ramp={c.train.batch_ramp!r}: {e}") from None
    return ramp


def _checkpointer(c: ml_collections.ConfigDict, workdir: str) -> Checkpointer:
    k = c.checkpoint
    return Checkpointer(
        workdir,
        keep=k.keep,
        keep_period=k.keep_period,
        every_steps=k.every_steps,
        every_minutes=k.every_minutes,
    )


def _train_dataset(c: ml_collections.ConfigDict, sources, ramp: BatchRamp):
    """(this process' training batches, the MixedSequences of data.mixture or None)."""
    kwargs = dict(
        global_batch_size=c.train.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        ramp=ramp if c.train.batch_ramp else None,
        num_threads=c.data.num_threads,
        prefetch_buffer_size=c.data.prefetch,
    )
    kwargs["megatron"] = MegatronOptions.of(c.data)
    if sources is None:
        return make_dataset(c.data.path, seq_len=c.train.seq_len, seed=c.seed, **kwargs), None
    megatron = kwargs.pop("megatron")
    mixture = mixture_lib.mixed_sequences(sources, seq_len=c.train.seq_len, seed=c.seed, megatron=megatron)
    return batch_sequences(mixture, **kwargs), mixture


def _data_position(drawn: int, ramp: BatchRamp, mixture, sources, seq_len: int) -> dict[str, int]:
    """batch_size, tokens_seen and mixture/<name> (tokens drawn per source) after `drawn` batches (a
    step's own included): pure functions of the data position, so a resume continues them exactly."""
    consumed = ramp.consumed(drawn)
    out = {"batch_size": ramp.size(drawn - 1), "tokens_seen": consumed * seq_len}
    if mixture is not None:
        for source, n in zip(sources, mixture.counts(consumed)):
            out[f"mixture/{source.name}"] = n * seq_len
    return out


def check_eval_data(c: ml_collections.ConfigDict, sources) -> None:
    """The held-out split every evaluation (and the last step) reads exists and is not empty: that of
    data.path, or of every data.mixture source."""
    keyed = [("data.mixture", s.path) for s in sources] if sources else [("data.path", c.data.path)]
    for key, path in keyed:
        if load_documents(path, "eval", MegatronOptions.of(c.data)).num_docs == 0:
            raise UserError(
                f"config.{key}={path}: the 'eval' split has no documents, and the run evaluates "
                "at its last step; prepare the data again with a held-out split (--eval-fraction > 0)"
            )


def _refuse_fresh_start_after_quarantine(ckpt: Checkpointer, c: ml_collections.ConfigDict) -> None:
    """A workdir whose checkpoints were all moved aside as unreadable does not silently restart."""
    if ckpt.quarantined() and not c.checkpoint.allow_fresh_start:
        raise CheckpointError(
            f"{ckpt.workdir} has no checkpoint left, but {ckpt.corrupt_directory}/ holds "
            f"{len(ckpt.quarantined())} unreadable one(s); refusing to start from step 0 over it "
            "(pass --config.checkpoint.allow_fresh_start=True to start afresh)"
        )


def _init_from(state: TrainState, directory: str) -> tuple[TrainState, str]:
    """Phase chaining: params and balancing biases from another run's latest checkpoint; optimizer
    state and step start fresh (a new phase has its own schedule). Only those two fields are read,
    so the source run may have used a different optimizer. Returns the state and the checkpoint
    directory read."""
    src, step = _init_from_checkpoint(directory)
    try:
        part = src.restore_params(step, abstract_like({"params": state.params, "balancing": state.balancing}))
    finally:
        src.close()
    source = os.path.join(src.directory, str(step))
    return dataclasses.replace(state, params=part["params"], balancing=part["balancing"]), source


def _check_init_from(directory: str, abstract_state: TrainState, config_json: dict) -> None:
    """train.init_from holds this model's params and balancing biases (metadata only): another
    model is named by its differing config.model keys, as a resume names them."""
    src, step = _init_from_checkpoint(directory)
    try:
        part = {"params": abstract_state.params, "balancing": abstract_state.balancing}
        diffs = src.mismatch(step, part, config_json, sections=("model",))
    finally:
        src.close()
    if diffs:
        raise UserError(
            f"config.train.init_from={directory!r}: checkpoint {step} was saved with another model: "
            f"{diffs}. Nothing was changed; give this run the checkpoint's model keys"
        )


def _init_from_checkpoint(directory: str) -> tuple[Checkpointer, int]:
    """(read-only Checkpointer, step) of config.train.init_from; UserError if there is none."""
    workdir, step = checkpoint_workdir(directory)
    try:
        src = Checkpointer(workdir, read_only=True)
    except FileNotFoundError as e:
        raise UserError(f"config.train.init_from={directory!r}: {e}") from None
    step = src.latest_step() if step is None else step
    if step is None or step not in src.all_steps():
        src.close()
        raise UserError(f"config.train.init_from={directory!r}: no complete checkpoint there")
    return src, step
