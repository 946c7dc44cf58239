"""Checkpoint I/O: what a user's Orbax save, restore and `zaya_jax.export` cost, against the disk's
own speed and the train state's size; and the training stall of an async save.

    python -m benchmarks.checkpoint_io [--config configs/tiny.py] [--config.model.hidden_size=256 ...]
        [--dir SCRATCH] [--repeats 3] [--steps 8] [--out DIR]

On one scratch directory (default: a temporary directory under the current one, so it measures the
disk the runs would use). Every measured operation runs in a spawned process of its own, and its
peak RSS is that process' own (VmHWM): getrusage's ru_maxrss, or wait4's, carries a parent's
high-water mark across fork + exec, which once reported an export's peak as 23 GB.

  disk write / read   one file of the state's size, random bytes: write + fsync, then read back
                      (the read may be served from the page cache, as a restore right after a
                      save would be; so may Orbax's)
  save                a *trained* state: the optimizer moments filled with random values of their
                      own dtypes and shapes (zeros, as at step 0, compress: the checkpoint was half
                      the state and the save "outran" the disk). Synchronous Orbax save of the
                      whole TrainState (+ wait), best of --repeats; the extra RSS the save needs
                      over the state already held (the high-water mark reset just before)
  async stall         in the same process: median step time without saving vs the steps while an
                      async save runs: blocking time of save() and the extra time of the steps
  restore             a fresh process per repeat restores into the sharded abstract state, as a
                      resume does; best of --repeats, its peak RSS
  export              `zaya_jax.export` (fp32 and bf16), each in a fresh process: its peak RSS, and
                      that minus the peak of a process that only imports the same modules
MB/s = state bytes / time. Prints a table and writes DIR/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/checkpoint_io.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    in_own_process,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    set_env,
    simulate_cpu_devices,
)
from zaya_jax.runtime import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_FILL = (
    "optimizer moments: random uniform(1e-8, 1e-3) values in their own dtypes and shapes (a trained "
    "state's are non-zero); parameters as initialised (random)"
)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def disk_throughput(path: str, nbytes: int) -> dict[str, float]:
    """Write + fsync, then read back, one file of `nbytes` random bytes (incompressible)."""
    import numpy as np

    buf = np.random.default_rng(0).integers(0, 255, size=max(nbytes, 1 << 20), dtype=np.uint8)
    f = os.path.join(path, "disk_probe.bin")
    t = time.perf_counter()
    with open(f, "wb") as fh:
        fh.write(memoryview(buf))  # no bytes copy: the probe holds the state's size once
        fh.flush()
        os.fsync(fh.fileno())
    w = time.perf_counter() - t
    t = time.perf_counter()
    with open(f, "rb") as fh:
        read = fh.readinto(memoryview(buf))
    r = time.perf_counter() - t
    assert read == buf.size
    os.remove(f)
    return {"bytes": int(buf.size), "write_MBps": buf.size / w / 1e6, "read_MBps": buf.size / r / 1e6}


def build_config(path: str, overrides: Sequence[str]):
    """(config, validated model config): the file + `--config.` overrides, as benchmarks.train_step."""
    from benchmarks.train_config import apply_override
    from benchmarks.train_config import load_config as load_file
    from zaya_jax import config as config_lib

    c = load_file(os.path.join(ROOT, path) if not os.path.isabs(path) else path)
    for item in overrides:
        apply_override(c, item)
    return c, config_lib.validate(c)


def state_sizes(config) -> tuple[int, int]:
    """(train state bytes, parameter bytes), from shapes only: nothing is allocated."""
    import jax

    from zaya_jax.parallel.mesh import mesh_from_config
    from zaya_jax.training.train_state import train_program

    c, cfg = config
    abstract = train_program(c, cfg, mesh_from_config(c)).abstract_state()
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return nbytes(abstract), nbytes(abstract.params)


# ---------------------------------------------------------------------------------- child processes
def _trained_state(program, seed: int):
    """A fresh state whose optimizer moments hold random values (STATE_FILL), laid out as training
    lays it out."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from zaya_jax.training.train_state import run_once

    def fill(state):
        leaves, treedef = jax.tree.flatten(state.opt_state)
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        filled = [
            jax.random.uniform(k, x.shape, x.dtype, 1e-8, 1e-3)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
            else x
            for k, x in zip(keys, leaves)
        ]
        return dataclasses.replace(state, opt_state=jax.tree.unflatten(treedef, filled))

    return run_once(lambda: fill(program.create()), program.shardings)


def save_child(config, scratch: str, repeats: int, steps: int, seed: int) -> dict[str, Any]:
    """In its own process: the trained state saved --repeats times (sync), then the async stall."""
    import jax

    from zaya_jax.parallel.mesh import mesh_from_config
    from zaya_jax.training.checkpoint import Checkpointer
    from zaya_jax.training.train_state import train_program

    c, cfg = config
    program = train_program(c, cfg, mesh_from_config(c))
    state = jax.block_until_ready(_trained_state(program, seed))
    config_json = json.loads(c.to_json_best_effort())
    held = rss_bytes()
    reset = reset_peak_rss()  # from here the high-water mark is the save's, over the state held
    seconds = []
    for i in range(repeats):
        ck = Checkpointer(os.path.join(scratch, f"sync{i}"), keep=0, async_save=False)
        t = time.perf_counter()
        ck.save(1, state, {}, config_json)
        ck.wait()
        seconds.append(time.perf_counter() - t)
        on_disk = _dir_bytes(ck.directory)
        ck.close()
    peak = peak_rss_bytes()
    return {
        "seconds": seconds,
        "checkpoint_bytes_on_disk": on_disk,
        "rss_before_bytes": held,
        "peak_rss_bytes": peak,
        "extra_peak_rss_bytes": peak - held if reset and peak and held else None,
        "async_save": async_stall(c, program, state, os.path.join(scratch, "async"), steps, config_json),
        "process_peak_rss_bytes": peak_rss_bytes(),
    }


def async_stall(c, program, state, directory: str, steps: int, config_json: dict) -> dict[str, Any]:
    """Median step time without saving vs the steps while an async save of the state runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.training.checkpoint import Checkpointer

    B, S = c.train.batch_size, c.train.seq_len
    ids = np.random.default_rng(0).integers(3, 259, size=(B, S + 1)).astype(np.int32)
    batch = {
        "input_ids": jnp.asarray(ids[:, :-1]),
        "targets": jnp.asarray(ids[:, 1:]),
        "loss_mask": jnp.ones((B, S), jnp.float32),
    }
    state, _ = program.train_step(state, batch)  # compiles
    jax.block_until_ready(state)

    def timed_steps(n: int) -> list[float]:
        nonlocal state
        out = []
        for _ in range(n):
            t = time.perf_counter()
            state, m = program.train_step(state, batch)
            jax.block_until_ready(m["loss"])
            out.append(time.perf_counter() - t)
        return out

    base = timed_steps(steps)
    ck = Checkpointer(directory, keep=0, async_save=True)
    t = time.perf_counter()
    ck.save(2, state, {}, config_json)
    blocking = time.perf_counter() - t
    during, t0 = [], time.perf_counter()
    while True:
        during += timed_steps(1)
        if not ck._manager.is_saving_in_progress() or len(during) >= 10 * steps:
            break
    save_wall = blocking + (time.perf_counter() - t0)
    ck.wait()
    ck.close()
    median = statistics.median(base)
    extra = sum(during) - median * len(during)
    return {
        "step_median_s": median,
        "save_blocking_s": blocking,
        "steps_during_save": len(during),
        "save_wall_s": save_wall,
        "extra_step_time_s": extra,
        "stall_s": blocking + max(extra, 0.0),
    }


def restore_child(config, workdir: str) -> dict[str, Any]:
    """In a fresh process, as a resume: the latest checkpoint straight into the sharded state."""
    import jax

    from zaya_jax.parallel.mesh import mesh_from_config
    from zaya_jax.training.checkpoint import Checkpointer
    from zaya_jax.training.train_state import train_program

    c, cfg = config
    abstract = train_program(c, cfg, mesh_from_config(c)).abstract_state()
    process_peak, held = peak_rss_bytes(), rss_bytes()
    reset = reset_peak_rss()  # from here the high-water mark is the restore's
    ck = Checkpointer(workdir, read_only=True)
    t = time.perf_counter()
    got = ck.restore_latest(abstract)
    jax.block_until_ready(got[1])
    seconds = time.perf_counter() - t
    ck.close()
    peak = peak_rss_bytes()
    return {
        "seconds": seconds,
        "rss_before_bytes": held,
        "peak_rss_bytes": max(peak or 0, process_peak or 0) or None,
        "extra_peak_rss_bytes": peak - held if reset and peak and held else None,
    }


def export_child(argv: list[str] | None) -> int | None:
    """In a fresh one-device CPU process: `python -m zaya_jax.export ARGV` (None: only its imports
    and jax's start-up, the baseline); returns the process' own peak RSS."""
    set_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    simulate_cpu_devices(1)
    import jax

    from zaya_jax import export

    jax.devices()
    if argv is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # its JSON summary: not part of the table
            export.main(argv)
    return peak_rss_bytes()


# --------------------------------------------------------------------------------------- benchmark
def run(args) -> dict[str, Any]:
    config = build_config(args.config, args.set)
    state_bytes, param_bytes = state_sizes(config)
    scratch = args.dir or tempfile.mkdtemp(prefix=".ckpt_io-", dir=os.getcwd())
    os.makedirs(scratch, exist_ok=True)
    report: dict[str, Any] = {
        "config": args.config,
        "set": args.set,
        "state_bytes": state_bytes,
        "param_bytes": param_bytes,
        "scratch": scratch,
        "method": {
            "state_fill": STATE_FILL,
            "processes": "the saves (then the async stall), each restore and each export in a spawned "
            "process of its own, one at a time",
            "peak_rss": "VmHWM of that process; the save's over the state it held (reset before)",
            "load_average_before": os.getloadavg(),
        },
    }
    try:
        report["disk"] = disk_throughput(scratch, state_bytes)
        saved = in_own_process(save_child, config, scratch, args.repeats, args.steps, args.seed)
        src = os.path.join(scratch, "sync0")
        restores = [in_own_process(restore_child, config, src) for _ in range(args.repeats)]
        report.update(io_report(report, saved, restores))
        report["export"] = export_report(src, scratch, state_bytes, param_bytes)
        report["method"]["load_average_after"] = os.getloadavg()
    finally:
        if not args.keep_dir:
            shutil.rmtree(scratch, ignore_errors=True)
    return report


def io_report(report: dict[str, Any], saved: dict[str, Any], restores: list[dict[str, Any]]) -> dict:
    """The save / restore sections: MB/s against the disk, peak RSS against the state's size."""
    state_bytes, disk = report["state_bytes"], report["disk"]
    save_s = min(saved["seconds"])
    restore_s = min(r["seconds"] for r in restores)
    restore_peak = max(r["peak_rss_bytes"] or 0 for r in restores) or None
    restore_extra = max(r["extra_peak_rss_bytes"] or 0 for r in restores) or None
    extra = saved["extra_peak_rss_bytes"]
    return {
        "checkpoint_bytes_on_disk": saved["checkpoint_bytes_on_disk"],
        "on_disk_over_state": saved["checkpoint_bytes_on_disk"] / state_bytes,
        "save": {
            "seconds_best": save_s,
            "seconds": saved["seconds"],
            "MBps": state_bytes / save_s / 1e6,
            "fraction_of_disk_write": state_bytes / save_s / 1e6 / disk["write_MBps"],
            "rss_before_bytes": saved["rss_before_bytes"],
            "peak_rss_bytes": saved["peak_rss_bytes"],
            "extra_peak_rss_bytes": extra,
            "extra_peak_over_state": None if extra is None else extra / state_bytes,
            "process_peak_rss_bytes": saved["process_peak_rss_bytes"],
        },
        "restore": {
            "seconds_best": restore_s,
            "seconds": [r["seconds"] for r in restores],
            "MBps": state_bytes / restore_s / 1e6,
            "fraction_of_disk_read": state_bytes / restore_s / 1e6 / disk["read_MBps"],
            "peak_rss_bytes": restore_peak,
            "peak_over_state": None if restore_peak is None else restore_peak / state_bytes,
            "rss_before_bytes": restores[0]["rss_before_bytes"],
            "extra_peak_rss_bytes": restore_extra,
            "extra_peak_over_state": None if restore_extra is None else restore_extra / state_bytes,
        },
        "async_save": saved["async_save"],
    }


def export_report(src: str, scratch: str, state_bytes: int, param_bytes: int) -> dict[str, Any]:
    """Each export's own peak RSS, over the state, and over an import-only process' peak."""
    base = in_own_process(export_child, None)
    out: dict[str, Any] = {"baseline_peak_rss_bytes": base}
    for dtype in ("float32", "bfloat16"):
        hf_dir = os.path.join(scratch, f"hf_{dtype}")
        t = time.perf_counter()
        peak = in_own_process(export_child, ["--checkpoint", src, "--out", hf_dir, "--dtype", dtype])
        extra = None if peak is None or base is None else peak - base
        out[dtype] = {
            "seconds": time.perf_counter() - t,
            "peak_rss_bytes": peak,
            "peak_over_state": None if peak is None else peak / state_bytes,
            "extra_rss_bytes": extra,
            "extra_rss_over_param_bytes": None if extra is None else extra / param_bytes,
            "hf_bytes": _dir_bytes(hf_dir),
        }
    return out


def table(r: dict[str, Any]) -> str:
    mb = lambda b: "-" if b is None else f"{b / 1e6:,.0f} MB"
    x = lambda v: "-" if v is None else f"{v:.2f}x"
    a, e, s, rs = r["async_save"], r["export"], r["save"], r["restore"]
    disk = r["disk"]
    rows = [
        ("state (params + optimizer)", mb(r["state_bytes"]), f"params {mb(r['param_bytes'])}"),
        ("checkpoint on disk", mb(r["checkpoint_bytes_on_disk"]), f"{x(r['on_disk_over_state'])} the state"),
        ("disk write (fsync) / read", f"{disk['write_MBps']:.0f} / {disk['read_MBps']:.0f} MB/s", ""),
        ("orbax save (sync)", f"{s['MBps']:.0f} MB/s", f"{s['fraction_of_disk_write']:.0%} of disk write"),
        ("save: extra peak RSS", mb(s["extra_peak_rss_bytes"]), f"{x(s['extra_peak_over_state'])} the state"),
        ("orbax restore", f"{rs['MBps']:.0f} MB/s", f"{rs['fraction_of_disk_read']:.0%} of disk read"),
        ("restore: peak RSS", mb(rs["peak_rss_bytes"]), f"{x(rs['peak_over_state'])} the state"),
        (
            "restore: extra peak RSS",
            mb(rs["extra_peak_rss_bytes"]),
            f"{x(rs['extra_peak_over_state'])} the state",
        ),
        ("async save: blocking", f"{1e3 * a['save_blocking_s']:.1f} ms", f"step {a['step_median_s']:.3f} s"),
        ("async save: stall total", f"{1e3 * a['stall_s']:.1f} ms", f"{a['steps_during_save']} steps in it"),
    ]
    for dt in ("float32", "bfloat16"):
        d = e[dt]
        note = f"{x(d['peak_over_state'])} the state; +{mb(d['extra_rss_bytes'])} over imports"
        rows.append((f"export {dt}: peak RSS", mb(d["peak_rss_bytes"]), note))
    w = max(len(row[0]) for row in rows)
    return "\n".join(f"{k:<{w}}  {v:>18}  {n}" for k, v, n in rows)


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", default="configs/tiny.py", help="training config file; --config.KEY=VALUE overrides a key"
    )
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    p.add_argument("--keep-dir", action="store_true")
    p.add_argument("--repeats", type=cli.Int(min=1), default=3)
    p.add_argument(
        "--steps", type=cli.Int(min=1), default=8, help="baseline steps for the async-stall measurement"
    )
    p.add_argument("--seed", type=cli.Int(min=0), default=0, help="seed of the random optimizer moments")
    p.add_argument("--out", default=".", help="directory for checkpoint_io.json")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from benchmarks.train_config import parse_with_overrides

    return parse_with_overrides(arg_parser(), argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    print(table(report))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checkpoint_io.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    cli.run(main)
