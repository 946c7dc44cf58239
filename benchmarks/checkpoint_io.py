"""Checkpoint I/O: Orbax save / restore throughput against the disk's own, the training stall of an
async save, and the peak memory of `zaya_jax.export` against the checkpoint's size.

    python -m benchmarks.checkpoint_io [--config configs/tiny.py] [--set model.hidden_size=256 ...]
        [--dir SCRATCH] [--repeats 3] [--steps 8] [--out DIR]

All in one process, on the same scratch directory (default: a temporary directory under the
current one, so it measures the disk the runs would use):
  disk write / read   one file of the checkpoint's size: write + fsync, then read back
                      (the read may be served from the page cache, as a restore right after a
                      save would be; so may Orbax's)
  save / restore      synchronous Orbax save of the whole TrainState (+ wait), restore into the
                      sharded abstract state; MB/s = state bytes / time; best of --repeats
  async stall         median step time without saving vs the steps while an async save runs:
                      blocking time of save() and the extra time of the following steps
  export              `python -m zaya_jax.export` (fp32 and bf16) in a subprocess: its peak RSS
                      minus the RSS of a subprocess that only imports the same modules
Prints a table and writes DIR/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # `python benchmarks/checkpoint_io.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zaya_jax import cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def disk_throughput(path: str, nbytes: int) -> dict[str, float]:
    import numpy as np

    buf = np.random.default_rng(0).integers(0, 255, size=max(nbytes, 1 << 20), dtype=np.uint8)
    f = os.path.join(path, "disk_probe.bin")
    t = time.perf_counter()
    with open(f, "wb") as fh:
        fh.write(buf.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    w = time.perf_counter() - t
    t = time.perf_counter()
    with open(f, "rb") as fh:
        data = fh.read()
    r = time.perf_counter() - t
    assert len(data) == buf.size
    os.remove(f)
    return {"bytes": int(buf.size), "write_MBps": buf.size / w / 1e6, "read_MBps": buf.size / r / 1e6}


def _child_peak_rss_mb(cmd: list[str], env: dict) -> float:
    """Peak RSS (MB) of one subprocess, via wait4's rusage."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024.0  # KB on Linux


def run(args) -> dict[str, Any]:
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax import balancing as bal
    from zaya_jax import config as config_lib
    from zaya_jax.checkpoint import Checkpointer, abstract_like
    from zaya_jax.optim.chain import lr_schedule, make_optimizer
    from zaya_jax.parallel.mesh import mesh_from_config
    from zaya_jax.train_state import balancing_config, create_train_state, make_train_step, state_shardings

    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, args.config))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    for item in args.set:
        key, value = item.split("=", 1)
        section, name = key.rsplit(".", 1)
        node = c
        for part in section.split("."):
            node = node[part]
        node[name] = type(node[name])(json.loads(value) if not isinstance(node[name], str) else value)
    cfg = config_lib.validate(c)
    mesh = mesh_from_config(c)
    tx = make_optimizer(c, total_steps=c.train.steps)
    bal_cfg = balancing_config(c)
    create = lambda: create_train_state(cfg, tx, bal_cfg or bal.BalancingConfig(), jax.random.key(0))
    shardings = state_shardings(jax.eval_shape(create), mesh, zero1=c.mesh.zero1)
    state = jax.jit(create, out_shardings=shardings)()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))

    scratch = args.dir or tempfile.mkdtemp(prefix=".ckpt_io-", dir=os.getcwd())
    os.makedirs(scratch, exist_ok=True)
    report: dict[str, Any] = {
        "config": args.config,
        "set": args.set,
        "devices": len(jax.devices()),
        "platform": jax.devices()[0].platform,
        "state_bytes": state_bytes,
        "param_bytes": param_bytes,
        "scratch": scratch,
    }
    config_json = json.loads(c.to_json_best_effort())
    try:
        report["disk"] = disk_throughput(scratch, state_bytes)
        saves, restores = [], []
        for i in range(args.repeats):
            w = os.path.join(scratch, f"sync{i}")
            ck = Checkpointer(w, keep=0, async_save=False)
            jax.block_until_ready(state)
            t = time.perf_counter()
            ck.save(1, state, {}, config_json)
            ck.wait()
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = ck.restore_latest(abstract_like(state))
            jax.block_until_ready(got[1])
            restores.append(time.perf_counter() - t)
            report["checkpoint_bytes_on_disk"] = _dir_bytes(ck.directory)
            ck.close()
        report["save"] = {
            "seconds_best": min(saves),
            "MBps": state_bytes / min(saves) / 1e6,
            "fraction_of_disk_write": state_bytes / min(saves) / 1e6 / report["disk"]["write_MBps"],
        }
        report["restore"] = {
            "seconds_best": min(restores),
            "MBps": state_bytes / min(restores) / 1e6,
            "fraction_of_disk_read": state_bytes / min(restores) / 1e6 / report["disk"]["read_MBps"],
        }

        # Async stall: step times around an async save.
        step = jax.jit(
            make_train_step(
                cfg, tx, bal_cfg, lr_schedule(c, total_steps=c.train.steps), c.train.grad_accum, mesh
            ),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        rng = np.random.default_rng(0)
        B, S = c.train.batch_size, c.train.seq_len
        ids = rng.integers(3, 259, size=(B, S + 1)).astype(np.int32)
        batch = {
            "input_ids": jnp.asarray(ids[:, :-1]),
            "targets": jnp.asarray(ids[:, 1:]),
            "loss_mask": jnp.ones((B, S), jnp.float32),
        }
        state, _ = step(state, batch)
        jax.block_until_ready(state)

        def timed_steps(n):
            nonlocal state
            out = []
            for _ in range(n):
                t = time.perf_counter()
                state, m = step(state, batch)
                jax.block_until_ready(m["loss"])
                out.append(time.perf_counter() - t)
            return out

        base = timed_steps(args.steps)
        ck = Checkpointer(os.path.join(scratch, "async"), keep=0, async_save=True)
        t = time.perf_counter()
        ck.save(2, state, {}, config_json)
        blocking = time.perf_counter() - t
        during, t0 = [], time.perf_counter()
        while True:
            during += timed_steps(1)
            if not ck._manager.is_saving_in_progress() or len(during) >= 10 * args.steps:
                break
        save_wall = blocking + (time.perf_counter() - t0)
        ck.wait()
        ck.close()
        median = statistics.median(base)
        report["async_save"] = {
            "step_median_s": median,
            "save_blocking_s": blocking,
            "steps_during_save": len(during),
            "save_wall_s": save_wall,
            "extra_step_time_s": sum(during) - median * len(during),
            "stall_s": blocking + max(sum(during) - median * len(during), 0.0),
        }

        # Export peak memory (fp32, bf16) in a subprocess vs an import-only subprocess.
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
        src = os.path.join(scratch, "sync0")
        base_rss = _child_peak_rss_mb(
            [sys.executable, "-c", "import zaya_jax.export, jax; jax.devices()"], env
        )
        report["export"] = {"baseline_rss_MB": base_rss}
        for dtype in ("float32", "bfloat16"):
            out = os.path.join(scratch, f"hf_{dtype}")
            t = time.perf_counter()
            peak = _child_peak_rss_mb(
                [
                    sys.executable,
                    "-m",
                    "zaya_jax.export",
                    "--checkpoint",
                    src,
                    "--out",
                    out,
                    "--dtype",
                    dtype,
                ],
                env,
            )
            report["export"][dtype] = {
                "seconds": time.perf_counter() - t,
                "peak_rss_MB": peak,
                "extra_rss_MB": peak - base_rss,
                "hf_bytes": _dir_bytes(out),
                "extra_rss_over_param_bytes": (peak - base_rss) * 1e6 / 1.048576 / param_bytes,
            }
    finally:
        if not args.keep_dir:
            shutil.rmtree(scratch, ignore_errors=True)
    return report


def table(r: dict[str, Any]) -> str:
    mb = lambda b: f"{b / 1e6:.1f} MB"
    a, e = r["async_save"], r["export"]
    rows = [
        ("state (params + optimizer)", mb(r["state_bytes"]), f"params {mb(r['param_bytes'])}"),
        ("checkpoint on disk", mb(r["checkpoint_bytes_on_disk"]), ""),
        (
            "disk write (fsync) / read",
            f"{r['disk']['write_MBps']:.0f} / {r['disk']['read_MBps']:.0f} MB/s",
            "",
        ),
        (
            "orbax save (sync)",
            f"{r['save']['MBps']:.0f} MB/s",
            f"{100 * r['save']['fraction_of_disk_write']:.0f}% of disk write",
        ),
        (
            "orbax restore",
            f"{r['restore']['MBps']:.0f} MB/s",
            f"{100 * r['restore']['fraction_of_disk_read']:.0f}% of disk read",
        ),
        (
            "async save: blocking",
            f"{1e3 * a['save_blocking_s']:.1f} ms",
            f"step median {1e3 * a['step_median_s']:.1f} ms",
        ),
        (
            "async save: stall total",
            f"{1e3 * a['stall_s']:.1f} ms",
            f"{a['steps_during_save']} steps during the save",
        ),
    ]
    for dt in ("float32", "bfloat16"):
        rows.append(
            (
                f"export {dt}: peak RSS",
                f"{e[dt]['peak_rss_MB']:.0f} MB",
                f"+{e[dt]['extra_rss_MB']:.0f} MB over imports ({e[dt]['extra_rss_over_param_bytes']:.2f}x params)",
            )
        )
    w = max(len(x[0]) for x in rows)
    return "\n".join(f"{k:<{w}}  {v:>18}  {n}" for k, v, n in rows)


def arg_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    p.add_argument("--keep-dir", action="store_true")
    p.add_argument("--repeats", type=cli.Int(min=1), default=3)
    p.add_argument(
        "--steps", type=cli.Int(min=1), default=8, help="baseline steps for the async-stall measurement"
    )
    p.add_argument("--out", default=".", help="directory for checkpoint_io.json")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


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
