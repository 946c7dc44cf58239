"""The trainer's start-up time and peak RSS on Megatron datasets of several sizes, read in place.

    python -m benchmarks.megatron_startup [--sizes-gb 0.1,10] [--work DIR] [--steps 3] [--out DIR]

For each size it writes PREFIX.bin + PREFIX.idx (uint16 byte-tokenizer ids, documents of
`--doc-tokens` tokens each ending in EOS; the .bin is one random 64 MiB block written over and
over, so writing 10 GB takes seconds, not a tokenizer), runs

    /usr/bin/time -v python -m zaya_jax.train --config configs/tiny.py --workdir W \
        --config.data.path=PREFIX --config.data.tokenizer=byte --config.train.steps=N ...

and reports: start-up (seconds from the start to the first logged step, in which the first
step's compile is included), wall (the whole run), peak RSS (/usr/bin/time's maximum resident set
size), and the .bin size. Memory-mapped reading keeps RSS flat in the dataset's size; what grows
is the document table (3 int64 per document) and the start-up's token-id scan (one read of the
.bin, 64 MiB at a time, when the dtype can hold ids outside the tokenizer's vocabulary). The
datasets are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import add_out_arg, format_rows, report_path, write_report
from zaya_jax.data.megatron_format import _HEADER, DTYPES, MAGIC, VERSION

BLOCK_TOKENS = 1 << 25  # 64 MiB of uint16 written over and over


def write_dataset(prefix: str, num_bytes: int, doc_tokens: int, eos_id: int = 1, seed: int = 0) -> int:
    """PREFIX.bin + .idx of about `num_bytes` (whole blocks of whole documents); returns the documents."""
    if BLOCK_TOKENS % doc_tokens:
        raise SystemExit(f"--doc-tokens must divide {BLOCK_TOKENS}")
    rng = np.random.default_rng(seed)
    block = rng.integers(3, 259, size=BLOCK_TOKENS, dtype=np.uint16)
    block[doc_tokens - 1 :: doc_tokens] = eos_id
    left = max(doc_tokens, num_bytes // 2 // doc_tokens * doc_tokens)  # tokens still to write
    with open(prefix + ".bin", "wb") as f:
        while left:
            n = min(left, BLOCK_TOKENS)
            f.write(block[:n].tobytes())
            left -= n
    num_docs = os.path.getsize(prefix + ".bin") // 2 // doc_tokens
    lengths = np.full(num_docs, doc_tokens, np.int32)
    pointers = np.arange(num_docs, dtype=np.int64) * doc_tokens * 2
    doc_idx = np.arange(num_docs + 1, dtype=np.int64)
    code = {np.dtype(t): c for c, t in DTYPES.items()}[np.dtype(np.uint16)]
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, code, num_docs, num_docs + 1))
        f.writelines(part.tobytes() for part in (lengths, pointers, doc_idx))
    return num_docs


def open_data(prefix: str, batches: int = 10) -> dict:
    """In this process: the trainer's data start-up alone (the token-id scan, both splits, the
    first `batches` train batches of the tiny config's shape), timed, with the RSS after."""
    from benchmarks.common import peak_rss_bytes, rss_bytes
    from zaya_jax.data.megatron import MegatronOptions, load_megatron_split
    from zaya_jax.data.megatron_format import check_token_ids
    from zaya_jax.data.pipeline import make_dataset

    t0 = time.monotonic()
    scanned = check_token_ids(prefix, 320)
    t_scan = time.monotonic() - t0
    options = MegatronOptions("byte")
    docs = {split: load_megatron_split(prefix, split, options).num_docs for split in ("train", "eval")}
    it = iter(make_dataset(prefix, seq_len=128, global_batch_size=16, megatron=options))
    for _ in range(batches):
        next(it)
    total = time.monotonic() - t0
    return {"scan_s": t_scan, "scanned_gb": scanned / 1e9, "data_startup_s": total, "docs": docs,
            "data_rss_mib": rss_bytes() / 2**20, "data_peak_rss_mib": peak_rss_bytes() / 2**20}  # fmt: skip


def open_data_in_own_process(prefix: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.megatron_startup", "--open-data", prefix],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_trainer(prefix: str, workdir: str, steps: int) -> dict:
    """One short training run under /usr/bin/time -v: start-up, wall, peak RSS."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "zaya_jax.train", "--config", "configs/tiny.py",
           "--workdir", workdir, f"--config.data.path={prefix}", "--config.data.tokenizer=byte",
           f"--config.train.steps={steps}", "--config.logging.every_steps=1",
           "--config.eval.every_steps=1000", "--config.checkpoint.every_steps=1000",
           "--config.optim.warmup_steps=0", "--config.eval.batches=2"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, lines = None, []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if first_step is None and re.match(r"^step\s+1\b", line.strip()):
            first_step = time.monotonic() - t0
    code = proc.wait()
    wall = time.monotonic() - t0
    text = "\n".join(lines)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if code != 0 or rss is None:
        raise SystemExit(f"the trainer failed (exit {code}):\n" + "\n".join(lines[-30:]))
    return {"startup_s": first_step, "wall_s": wall, "peak_rss_mib": int(rss.group(1)) / 1024,
            "log_tail": lines[-25:]}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.megatron_startup", description=__doc__.split("\n")[0]
    )
    p.add_argument("--sizes-gb", default="0.1,10", help="dataset sizes in GB (.bin bytes / 1e9)")
    p.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document")
    p.add_argument("--steps", type=int, default=3, help="train steps per run")
    p.add_argument("--work", default=None, help="where the datasets go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the datasets")
    add_out_arg(p, "megatron_startup")
    p.add_argument("--open-data", metavar="PREFIX", help=argparse.SUPPRESS)  # open_data_in_own_process
    args = p.parse_args(argv)
    if args.open_data:
        print(json.dumps(open_data(args.open_data)))
        return 0
    work = args.work or tempfile.mkdtemp(prefix="megatron_startup.")
    os.makedirs(work, exist_ok=True)
    rows = [["size GB", "docs", "write s", "data: scan s", "open s", "RSS MiB", "trainer: start-up s",
             "wall s", "peak RSS MiB"]]  # fmt: skip
    results = []
    try:
        for size in (float(s) for s in args.sizes_gb.split(",")):
            prefix = os.path.join(work, f"ds_{size:g}gb")
            t0 = time.monotonic()
            docs = write_dataset(prefix, int(size * 1e9), args.doc_tokens)
            written = time.monotonic() - t0
            print(f"wrote {prefix}.bin: {os.path.getsize(prefix + '.bin') / 1e9:.2f} GB in {written:.1f} s",
                  file=sys.stderr)  # fmt: skip
            data = open_data_in_own_process(prefix)
            run = run_trainer(prefix, os.path.join(work, f"run_{size:g}gb"), args.steps)
            run.update(data)
            results.append({"size_gb": os.path.getsize(prefix + ".bin") / 1e9, "num_docs": docs,
                            "write_s": written, **run})  # fmt: skip
            rows.append([f"{results[-1]['size_gb']:.2f}", f"{docs:,}", f"{written:.1f}", f"{run['scan_s']:.1f}",
                         f"{run['data_startup_s']:.1f}", f"{run['data_peak_rss_mib']:.0f}", f"{run['startup_s']:.1f}",
                         f"{run['wall_s']:.1f}", f"{run['peak_rss_mib']:.0f}"])  # fmt: skip
            for suffix in (".bin", ".idx"):
                if not args.keep:
                    os.unlink(prefix + suffix)
            shutil.rmtree(os.path.join(work, f"run_{size:g}gb"), ignore_errors=True)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(format_rows(rows))
    report = {"benchmark": "megatron_startup", "load_avg": os.getloadavg(), "nproc": os.cpu_count(),
              "steps": args.steps, "runs": results}  # fmt: skip
    write_report(report, *report_path(args.out, "megatron_startup"))
    print(json.dumps([{k: v for k, v in r.items() if k != "log_tail"} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
