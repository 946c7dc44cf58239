"""Orbax checkpoints of the whole training run under WORKDIR/checkpoints/<step>/.

Each checkpoint holds `state` (params, optimizer state, balancing biases and their optimizer, step),
`data` (the grain iterator state, JSON) and `config` (the training config, JSON). Orbax writes a
step into a temporary directory and renames it when complete, so a crash mid-save never leaves a
checkpoint that `latest_step` would pick. Saves are asynchronous: training continues while the
arrays are written; `wait()` blocks until the last save is durable.

Retention: the last `keep` checkpoints, plus every `keep_period`-th step permanently. Saving is
due every `every_steps` steps or `every_minutes` minutes of wall time (`due()`).

`restore_latest` is the resume path. Before reading any array it compares the checkpoint's own
metadata (every tensor's path, shape and dtype: mesh-independent) with the restore target; a
mismatch (the run was started with another model or optimizer) raises `CheckpointMismatch` naming
the differing config keys and leaves every file where it is. A checkpoint that cannot be read
(truncated or deleted array files, torn JSON or metadata) is skipped with a warning, moved aside
to WORKDIR/checkpoints.corrupt/, and the next older one is tried. If checkpoints exist and none
can be read it raises `CheckpointError` naming the directory: never a silent restart from step 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from zaya_jax.runtime.cli import UserError

# The config sections that fix the saved tensors' shapes whatever the mesh (named in a mismatch).
SHAPE_SECTIONS = ("model", "optim", "balancing")

# Orbax writes a replicated array in slices, one per replica, only where a replica's slice has at
# least this many bytes. Each slice is an eager `jax.lax.slice_in_dim`, a program compiled once per
# device and shape; a small array (a norm's scale, every tensor of a tiny model) is written faster
# whole, by one replica, than those compiles take. ZAYA1's weight stacks split over 1,024 replicas
# still give slices of hundreds of KiB.
MIN_REPLICA_SLICE_BYTES = 64 * 1024


def _register_array_handler() -> None:
    """Orbax's jax.Array handler (its default array metadata store) with MIN_REPLICA_SLICE_BYTES,
    registered once per process."""
    from orbax.checkpoint._src.metadata import array_metadata_store  # the default handler's store

    current = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(current, "_min_slice_bytes_for_replica_parallel", None) == MIN_REPLICA_SLICE_BYTES:
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    )
    with _absl_errors_only():  # Orbax warns that a handler replaces its default one
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


@contextlib.contextmanager
def _absl_errors_only(quiet: bool = True) -> Iterator[None]:
    """absl logging (Orbax's) at ERROR inside the block when `quiet`, as it was after."""
    verbosity = logging.get_verbosity()
    if quiet:
        logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


class CheckpointError(UserError):
    """Checkpoints exist but none of them can be restored."""


class CheckpointMismatch(UserError):
    """A readable checkpoint whose tensors do not match the current config (nothing was moved)."""


class Checkpointer:
    """A thin, typed wrapper over `ocp.CheckpointManager` for our three items."""

    def __init__(
        self,
        workdir: str,
        *,
        keep: int = 3,
        keep_period: int = 0,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        async_save: bool = True,
        read_only: bool = False,
    ):
        _register_array_handler()
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self._last_save_time = time.monotonic()
        if read_only:  # Orbax warns about each retention option a read-only manager ignores
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(f"no checkpoints in {self.workdir} ({self.directory} does not exist)")
            options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep or None,
                keep_period=keep_period or None,
                create=True,
                enable_async_checkpointing=async_save,
            )
        # Orbax warns "Given directory is read only" on every read-only open
        with _absl_errors_only(quiet=read_only):
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._closed = False

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def due(self, step: int, *, now: float | None = None) -> bool:
        """Whether `step` (optimizer steps done) should be saved by the step or time policy."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        now = time.monotonic() if now is None else now
        return bool(self.every_minutes) and now - self._last_save_time >= 60.0 * self.every_minutes

    def save(self, step: int, state: Any, data_state: dict | None, config: dict) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state or {}),
                config=ocp.args.JsonSave(config),
            ),
            force=True,
        )
        self._last_save_time = time.monotonic()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """Restores into `abstract_state` (a pytree of jax.ShapeDtypeStruct with shardings)."""
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
            ),
        )
        return out.state, out.data, out.config

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{tensor path: (shape, dtype)} of the `state` saved at `step`, from its metadata alone."""
        path = os.path.join(self.directory, str(step), "state")
        handler = ocp.PyTreeCheckpointHandler()
        try:
            meta = handler.metadata(epath.Path(path))
        finally:
            handler.close()
        return tree_shapes(getattr(meta, "tree", meta))

    def check_matches(self, step: int, abstract_state: Any, config: dict | None) -> None:
        """Raises CheckpointMismatch if checkpoint `step` holds other tensors than `abstract_state`;
        `config` (the current config, JSON) names the differing keys. Reads metadata only."""
        diffs = self.mismatch(step, abstract_state, config)
        if diffs:
            raise CheckpointMismatch(
                f"{self.workdir}: checkpoint {step} was saved with another model or optimizer: "
                f"{diffs}. Nothing was changed; resume with the checkpoint's config, or start this "
                "config in a new --workdir"
            )

    def mismatch(
        self, step: int, abstract: Any, config: dict | None, sections: tuple[str, ...] = SHAPE_SECTIONS
    ) -> str:
        """'' if checkpoint `step` holds the tensors of `abstract` (all of the saved state, or, for a
        dict of some of its top-level fields, those fields), else the differing keys of `sections`
        of `config` (or, if none differ, the differing tensors), '; '-joined. Reads metadata only."""
        saved, want = self.saved_shapes(step), tree_shapes(abstract)
        if isinstance(abstract, dict):  # a partial restore (restore_params): only those fields
            saved = {p: v for p, v in saved.items() if p.split(".", 1)[0] in abstract}
        if saved == want:
            return ""
        diffs = config_diff(self._manager.restore(step, args=_CONFIG_ONLY).config, config or {}, sections)
        if not diffs:  # the same config keys, other tensors (e.g. another version of the code)
            paths = sorted(set(saved) | set(want))
            diffs = [
                f"{p}: checkpoint {saved.get(p)}, config {want.get(p)}"
                for p in paths
                if saved.get(p) != want.get(p)
            ]
        return f"{'; '.join(diffs[:8])}{' ...' if len(diffs) > 8 else ''}"

    def restore_latest(
        self,
        abstract_state: Any,
        *,
        max_step: int | None = None,
        on_corrupt: Callable[[int, str], None] | None = None,
        config: dict | None = None,
    ) -> tuple[int, Any, dict, dict] | None:
        """(step, state, data_state, config) of the newest readable checkpoint (<= max_step), or None if
        there is no checkpoint at all. Unreadable ones are skipped with a warning and moved aside; a
        readable one that does not match `abstract_state` raises CheckpointMismatch (see
        check_matches; `config` is the current config's JSON) before any array is read."""
        steps = [s for s in self.all_steps() if max_step is None or s <= max_step]
        if not steps:
            return None
        errors = []
        for step in reversed(steps):
            try:
                self.check_matches(step, abstract_state, config)
                state, data, saved_config = self.restore(step, abstract_state)
                return step, state, data, saved_config
            except CheckpointMismatch:
                raise
            except Exception as e:
                msg, short = f"{type(e).__name__}: {str(e)[:500]}", read_error(e)
                errors.append(f"step {step}: {short}")
                moved = self._quarantine(step)
                print(  # one line; the event log (on_corrupt) keeps the longer message
                    f"WARNING: checkpoint {step} cannot be restored ({short}); "
                    f"{f'moved to {moved}, ' if moved else ''}trying the previous one",
                    flush=True,
                )
                if on_corrupt is not None:
                    on_corrupt(step, msg)
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}: all of steps {steps} failed to restore and "
            f"were moved to {self.corrupt_directory}/ ({'; '.join(errors)})"
        )

    @property
    def corrupt_directory(self) -> str:
        return self.directory + ".corrupt"

    def quarantined(self) -> list[str]:
        """The checkpoints moved to checkpoints.corrupt/ (names `<step>-<unix time>`)."""
        d = self.corrupt_directory
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def restore_config(self, step: int | None = None) -> dict:
        """The training config (JSON) saved with `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self._manager.restore(step, args=_CONFIG_ONLY).config

    def restore_params(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        """Only some top-level fields of the saved TrainState (e.g. {"params": ..., "balancing": ...}),
        without building (or reading) the optimizer state."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True)
            ),
        )
        return out.state

    def _quarantine(self, step: int) -> str | None:
        """Moves an unreadable checkpoint out of the way so later saves can reuse its step; returns
        where it went (None on other processes)."""
        dst = None
        src = os.path.join(self.directory, str(step))
        if jax.process_index() == 0 and os.path.exists(src):
            os.makedirs(self.corrupt_directory, exist_ok=True)
            dst = os.path.join(self.corrupt_directory, f"{step}-{int(time.time())}")
            shutil.move(src, dst)
        self._manager.reload()
        return dst

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and closes the manager (again: a no-op)."""
        if not self._closed:
            self._closed = True
            self._manager.close()


_CONFIG_ONLY = ocp.args.Composite(config=ocp.args.JsonRestore())


def read_error(e: BaseException) -> str:
    """A failed restore in one line: the file TensorStore could not read and why ('reading
    .../state/d/ab12: Requested byte range [0, 416) is not valid for value of size 138'), without
    its spec; else the exception's first line."""
    text = str(e).split("[tensorstore_spec", 1)[0].strip()
    first = text.splitlines()[0] if text else type(e).__name__
    files = [f for f in re.findall(r'local file "([^"]+)"', text) if not f.endswith("/")]
    if files:
        return f"reading {files[-1]}: {first.rsplit(': ', 1)[-1]}"
    return f"{type(e).__name__}: {first[:300]}"


def tree_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{'params.embed_tokens.embedding': ((V, d), 'float32'), ...} of arrays, abstract arrays or
    Orbax array metadata: the same paths for a TrainState and its saved metadata."""

    def name(key) -> str:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(name(k) for k in path): (tuple(x.shape), str(x.dtype)) for path, x in leaves}


def config_diff(saved: dict, current: dict, sections: tuple[str, ...] = SHAPE_SECTIONS) -> list[str]:
    """'model.hidden_size: checkpoint 128, config 96' for every differing key of `sections`."""

    def flat(d: Any, prefix: str) -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}.{key}").items()}

    out = []
    for section in sections:
        a, b = flat(saved.get(section, {}), section), flat(current.get(section, {}), section)
        out += [
            f"{k}: checkpoint {a.get(k)}, config {b.get(k)}"
            for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)
        ]
    return out


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete pytree: the restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


def checkpoint_workdir(path: str) -> tuple[str, int | None]:
    """WORKDIR, WORKDIR/checkpoints or WORKDIR/checkpoints/<step> -> (WORKDIR, step or None = latest)."""
    path = os.path.abspath(path.rstrip("/"))
    base = os.path.basename(path)
    if base.isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints":
        return os.path.dirname(os.path.dirname(path)), int(base)
    if base == "checkpoints":
        return os.path.dirname(path), None
    return path, None
