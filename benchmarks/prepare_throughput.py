"""`prepare`'s tokens/s by worker count and tokenizer, on a generated corpus, against the
Hugging Face `tokenizers` batch-encode rate of the same documents.

    python -m benchmarks.prepare_throughput [--size-mb 1024] [--workers 1,2,all] [--work DIR] [--out DIR]

It writes a JSONL corpus of about `--size-mb` MB (documents of 20-2000 words drawn from a
Zipf-distributed vocabulary of 20,000 made-up words, some non-ASCII; generated, nothing downloaded),
trains a byte-level BPE tokenizer of 8,192 tokens with `tokenizers` on its first 20 MB, then runs

    python -m zaya_jax.data.prepare --input corpus.jsonl --out OUT --tokenizer T --workers N

for T in (byte, the BPE tokenizer) and each N, each a process of its own, timed from start to exit
(the spawn of the workers and the writing of the shards included). The reference is the BPE
tokenizer's `encode_batch` over the same documents in batches of 256 in this process (the Rust
library's own threads, one per core; the JSON parsing not timed): the rate of tokenizing alone.
Report fields: tokens (written, EOS included), seconds, tokens/s, MB/s of input, and the ratio
to the reference. Timings move with the machine's load: the load average is recorded before and
after. The corpus and outputs go to a temporary directory, deleted at the end unless --work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import add_out_arg, format_rows, report_path, write_report

BPE_VOCAB = 8192
_DOCS_PER_CHUNK = 2000


def make_corpus(path: str, size_bytes: int, seed: int = 0) -> int:
    """A JSONL corpus of about `size_bytes`; returns its document count."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqzé"))
    vocab = np.array(["".join(rng.choice(letters, size=int(n))) for n in rng.integers(1, 12, size=20_000)])
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    written = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            lengths = rng.integers(20, 2000, size=_DOCS_PER_CHUNK)
            words = vocab[rng.choice(len(vocab), size=int(lengths.sum()), p=zipf)]
            ends = np.cumsum(lengths)
            lines = [json.dumps({"text": " ".join(words[e - n : e])}, ensure_ascii=False) + "\n"
                     for e, n in zip(ends, lengths)]  # fmt: skip
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode("utf-8"))
            docs += len(lines)
    return docs


def texts_of(path: str, max_bytes: int | None = None):
    done = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]
            done += len(line)
            if max_bytes is not None and done >= max_bytes:
                return


def train_bpe(corpus: str, out: str) -> str:
    """A byte-level BPE tokenizer.json trained on the corpus' first 20 MB (with <pad> and </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts_of(corpus, 20 << 20), trainer)
    path = os.path.join(out, "bpe.json")
    tok.save(path)
    return path


def reference_rate(corpus: str, tokenizer: str, batch: int = 256) -> dict:
    """HF tokenizers' encode_batch alone over the corpus: tokens (an EOS per document added, as
    prepare counts them) per second of encoding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    tokens, seconds, texts = 0, 0.0, []

    def encode():
        nonlocal tokens, seconds
        t0 = time.perf_counter()
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))
        seconds += time.perf_counter() - t0

    for text in texts_of(corpus):
        texts.append(text)
        if len(texts) == batch:
            encode()
            texts = []
    if texts:
        encode()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_prepare(corpus: str, out: str, tokenizer: str, workers: int) -> dict:
    """One `prepare` run in its own process: tokens written, wall seconds, tokens/s."""
    cmd = [sys.executable, "-m", "zaya_jax.data.prepare", "--input", corpus, "--out", out,
           "--tokenizer", tokenizer, "--workers", str(workers)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    meta = json.loads(open(os.path.join(out, "meta.json")).read())
    tokens = sum(s["num_tokens"] for s in meta["splits"].values())
    shutil.rmtree(out)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "last_progress": [ln for ln in proc.stderr.splitlines() if ln.startswith("prepare: ")][-1:]}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prepare_throughput", description=__doc__.split("\n")[0]
    )
    p.add_argument("--size-mb", type=float, default=1024, help="corpus size in MB (default 1024)")
    p.add_argument("--workers", default="1,2,all", help="worker counts; 'all' = every core (default 1,2,all)")
    p.add_argument("--tokenizers", default="byte,bpe", help="byte and/or bpe (default both)")
    p.add_argument(
        "--work", default=None, help="where the corpus and outputs go (default: a temporary directory)"
    )
    add_out_arg(p, "prepare_throughput")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    counts = sorted({cores if w == "all" else int(w) for w in args.workers.split(",")})
    work = args.work or tempfile.mkdtemp(prefix="prepare_throughput.")
    os.makedirs(work, exist_ok=True)
    load_before = os.getloadavg()
    try:
        corpus = os.path.join(work, "corpus.jsonl")
        t0 = time.monotonic()
        docs = make_corpus(corpus, int(args.size_mb * 1e6))
        size = os.path.getsize(corpus)
        print(
            f"corpus: {size / 1e6:.0f} MB, {docs:,} documents in {time.monotonic() - t0:.0f} s",
            file=sys.stderr,
        )
        names = args.tokenizers.split(",")
        tokenizers = {"byte": "byte", **({"bpe": train_bpe(corpus, work)} if "bpe" in names else {})}
        reference = reference_rate(corpus, tokenizers["bpe"]) if "bpe" in names else None
        runs = []
        for name in names:
            for n in counts:
                print(f"prepare --tokenizer {name} --workers {n} ...", file=sys.stderr, flush=True)
                run = run_prepare(corpus, os.path.join(work, "out"), tokenizers[name], n)
                runs.append(
                    {"tokenizer": name, "workers": n, **run, "input_mb_per_s": size / 1e6 / run["seconds"]}
                )
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    rows = [["tokenizer", "workers", "tokens", "seconds", "tokens/s", "MB/s", "vs HF encode_batch"]]
    for r in runs:
        ratio = (
            f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}x"
            if reference and r["tokenizer"] == "bpe"
            else "-"
        )
        rows.append([r["tokenizer"], str(r["workers"]), f"{r['tokens']:,}", f"{r['seconds']:.1f}",
                     f"{r['tokens_per_s']:,.0f}", f"{r['input_mb_per_s']:.1f}", ratio])  # fmt: skip
    if reference:
        rows.append(["bpe (HF encode_batch alone)", f"{cores} threads", f"{reference['tokens']:,}",
                     f"{reference['seconds']:.1f}", f"{reference['tokens_per_s']:,.0f}", "-", "1.00x"])  # fmt: skip
    print(format_rows(rows))
    report = {"benchmark": "prepare_throughput", "corpus_bytes": size, "corpus_docs": docs, "cores": cores,
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "bpe_vocab": BPE_VOCAB,
              "runs": runs, "reference_hf_encode_batch": reference}  # fmt: skip
    if args.out:
        write_report(report, *report_path(args.out, "prepare_throughput"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
