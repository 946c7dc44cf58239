"""Attention at long sequences: forward + backward of a model's loss with
attention_impl "xla" (the dense [S, T] softmax) against "blockwise" (kernels/blockwise_attention.py),
by sequence length, each (impl, length) in a fresh process.

    python -m benchmarks.long_context [--config configs/tiny.py] [--seq 1024,2048,4096,8192]
        [--impls xla,blockwise] [--batch 1] [--steps 3] [--block N] [--out results/long_context.json]

Per row: the median wall time of jit(value_and_grad(loss)) over `--steps` calls after one warm-up
(compile excluded; `--steps 0` compiles only), XLA's temporaries of the compiled program (memory_analysis), and the process'
peak RSS (getrusage maxrss, compile included). The loss is the mean token cross-entropy of a random
batch [B, S] with the config's model (no optimizer). A length that fails (out of memory) is a row
with its error. `--block N` sets blockwise's block_q = block_k (default: the table's,
zaya_jax/kernels/block_sizes.py) in the measuring processes. The measurement behind attention_impl="auto"'s BLOCKWISE_AUTO_MIN_SEQ
(zaya_jax/kernels/block_sizes.py; numbers: docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(config: str, impl: str, seq: int, batch: int, steps: int, block: int = 0) -> dict:
    """One row, in this process."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    from zaya_jax.config import model_config
    from zaya_jax.kernels import block_sizes
    from zaya_jax.model import ZayaForCausalLM, init_variables
    from zaya_jax.model.loss import token_cross_entropy

    if block:  # this measuring process only
        block_sizes.TABLE["blockwise_attention"] = {"block_q": block, "block_k": block}
    spec = importlib.util.spec_from_file_location("bench_config", config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.model.attention_impl = impl
    c.model.max_position_embeddings = max(seq, c.model.max_position_embeddings)
    cfg = model_config(c)
    model = ZayaForCausalLM(cfg)
    variables = init_variables(cfg, jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32)

    def loss(params):
        out = model.apply({**variables, "params": params}, ids[:, :-1])
        return jnp.mean(token_cross_entropy(out.logits, ids[:, 1:]))

    compiled = jax.jit(jax.value_and_grad(loss)).lower(variables["params"]).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    if steps == 0:  # compile only: the temporaries of a program that would not fit here
        return {"impl": impl, "seq": seq, "step_s": None, "temp_bytes": temp, "peak_rss_bytes": None}
    jax.block_until_ready(compiled(variables["params"]))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(variables["params"]))
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step = float(np.median(times))
    row = {"impl": impl, "seq": seq, "step_s": step, "temp_bytes": temp, "peak_rss_bytes": rss}
    return {**row, "block": block or None}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs/tiny.py"))
    p.add_argument("--seq", default="1024,2048,4096,8192")
    p.add_argument("--impls", default="xla,blockwise")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--block", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "impl,seq": the child process
    a = p.parse_args(argv)
    if a.one:
        impl, seq = a.one.split(",")
        print(json.dumps(measure(a.config, impl, int(seq), a.batch, a.steps, a.block)))
        return []
    rows = []
    for seq in (int(s) for s in a.seq.split(",")):
        for impl in a.impls.split(","):
            cmd = [sys.executable, "-m", "benchmarks.long_context", "--config", a.config]
            cmd += ["--one", f"{impl},{seq}", "--batch", str(a.batch), "--steps", str(a.steps)]
            cmd += ["--block", str(a.block)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                error = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                row = {"impl": impl, "seq": seq, "error": error}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(_line(row), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['impl']:10s} {row['seq']:7d}  error: {row['error']}"
    gib = 2.0**30
    if row["step_s"] is None:
        return f"{row['impl']:10s} {row['seq']:7d}  (compiled only)  temp {row['temp_bytes'] / gib:7.3f} GiB"
    return (
        f"{row['impl']:10s} {row['seq']:7d}  {row['step_s']:8.3f} s  temp {row['temp_bytes'] / gib:7.3f} GiB"
        f"  peak RSS {row['peak_rss_bytes'] / gib:7.3f} GiB"
    )


if __name__ == "__main__":
    main()
