"""Tokenized dataset on disk: `python -m zaya_jax.data.prepare` writes it, `load_split` reads it.

    python -m zaya_jax.data.prepare --input a.txt b.jsonl ... --out DIR \
        [--tokenizer byte|path/to/tokenizer.json] [--eval-fraction 0.01] [--shard-tokens N] \
        [--doc-separator none|blank-line|form-feed|LITERAL] [--text-field text] [--overwrite] \
        [--workers N] [--format zaya|megatron] [--resume]

Inputs (.txt / .jsonl optionally compressed: `.gz`, or `.zst` with the `data` extra):
    .txt      by default the whole file is one document; `--doc-separator` cuts it into several
              (`blank-line`: one or more empty lines, `form-feed`: "\\f", anything else is taken as a
              literal string with backslash escapes, e.g. '\\n\\n\\n').
    .jsonl    one JSON object per line with a string field "text" (`--text-field`); blank lines are
              skipped, anything else is an error naming file:line.
    .parquet  the `--text-field` column, streamed by record batches (zaya_jax.data.input_formats).
    DIR       a Hugging Face dataset saved with `save_to_disk`: its `--text-field` column.
The same documents give the same output whatever their input format. `--workers N` tokenizes on N
processes (default: every core) and writes exactly what one writes (zaya_jax.data.encode); a
progress line (documents, tokens, tokens/s, ETA) goes to stderr every few seconds. An interrupted
run leaves nothing behind that looks complete. Without `--resume` it leaves nothing at all and is
restarted from the beginning; with `--resume` its shards are kept beside DIR, and the same command
with `--resume` continues from them without tokenizing their documents again
(zaya_jax.data.prepare_resume), writing what one uninterrupted run writes.
`--format megatron` writes OUT.bin + OUT.idx instead (zaya_jax.data.megatron_format): every
document in input order, each followed by the EOS token, no split (the reader holds out
data.eval_fraction of them as `prepare` would).
Whitespace-only documents are skipped. Documents are assigned to train/eval by systematic sampling
(`zaya_jax.data.is_eval_document`), so the split streams and is deterministic. When that leaves
the eval split empty (fewer than ~1 / eval_fraction documents, e.g. one .txt file read whole), the
eval split is the tail of the last document: ceil(eval_fraction * all tokens) of them. Only
`--eval-fraction 0` writes an empty eval split.

Layout of DIR:
    meta.json                     format version, tokenizer ids, per-split doc/token counts and shard list
    zaya_tokenizer.json (+ tokenizer.json)   the tokenizer that made the data (`load_tokenizer(DIR)`)
    train/shard_00000.npy         flat token array, uint16 if vocab_size <= 65536 else uint32,
                                  every document followed by one EOS token
    train/shard_00000.offsets.npy int64 [num_docs + 1]; document d (incl. its EOS) is tokens[off[d]:off[d+1]]
    eval/...                      same for the held-out split
Documents never straddle shards. The directory is built under a temporary name and moved into
place at the end, so an interrupted run never leaves a directory that looks complete. DIR must be
new or empty; `--overwrite` replaces an existing one (never one holding an input).
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from zaya_jax.data import input_formats, is_eval_document, prepare_resume
from zaya_jax.data.documents import _input_kind, _Inputs, parse_separator
from zaya_jax.data.encode import Progress, encode_documents
from zaya_jax.data.megatron_format import MegatronWriter, megatron_dtype
from zaya_jax.data.prepared import FORMAT_NAME, FORMAT_VERSION, META_FILENAME, SPLITS
from zaya_jax.data.tokenizer import Tokenizer, load_tokenizer
from zaya_jax.runtime import cli, interrupt, output_dir

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens = 128 MiB of uint16 per shard
_SPAWN_MIN_BYTES = 4 << 20  # inputs smaller than this are tokenized in one process
_ENCODE_BATCH = 256  # documents per tokenizer call (the HF tokenizer parallelises within a batch)


# ----------------------------------------------------------------------------------------------
# Reading


# ----------------------------------------------------------------------------------------------
# Writing


class _ShardWriter:
    """Accumulates documents of one split and writes them out in shards of ~shard_tokens tokens."""

    def __init__(self, split_dir: Path, dtype: np.dtype, shard_tokens: int):
        self.split_dir = split_dir
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.num_docs = 0
        self.num_tokens = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        split_dir.mkdir(parents=True, exist_ok=True)

    def restore(self, summary: dict, pending: list[np.ndarray]) -> None:
        """Continues where a checkpoint's writer was: its shards written, `pending` not yet."""
        self.shards = list(summary["shards"])
        self.num_docs, self.num_tokens = summary["num_docs"], summary["num_tokens"]
        self._pending = list(pending)
        self._pending_tokens = sum(len(d) for d in pending)

    @property
    def pending(self) -> list[np.ndarray]:
        return self._pending

    def add(self, doc: np.ndarray) -> None:
        self._pending.append(doc)
        self._pending_tokens += len(doc)
        self.num_docs += 1
        self.num_tokens += len(doc)
        if self._pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        stem = f"shard_{len(self.shards):05d}"
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in self._pending])]).astype(np.int64)
        np.save(self.split_dir / f"{stem}.npy", np.concatenate(self._pending).astype(self.dtype))
        np.save(self.split_dir / f"{stem}.offsets.npy", offsets)
        self.shards.append(
            {
                "tokens": f"{stem}.npy",
                "offsets": f"{stem}.offsets.npy",
                "num_docs": len(self._pending),
                "num_tokens": int(offsets[-1]),
            }
        )
        self._pending, self._pending_tokens = [], 0

    def summary(self) -> dict:
        return {"num_docs": self.num_docs, "num_tokens": self.num_tokens, "shards": self.shards}


def split_tail(doc: np.ndarray, n: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """A document (ending in EOS) -> (its head + EOS, its last `n` tokens + EOS); each side keeps at
    least one token. ValueError if the document is too short to cut."""
    body = doc[:-1]
    if len(body) < 2:
        raise ValueError(
            "the eval split would be empty: the inputs hold too little text to hold out any "
            "(add text, or pass --eval-fraction 0 to train without an eval split)"
        )
    n = min(max(n, 1), len(body) - 1)
    eos = np.asarray([eos_id], doc.dtype)
    return np.concatenate([body[:-n], eos]), np.concatenate([body[-n:], eos])


def prepare_dataset(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | Tokenizer | None = None,
    eval_fraction: float = 0.01,
    split_seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    doc_separator: str | None = None,
    text_field: str = "text",
    overwrite: bool = False,
    workers: int = 1,
    output_format: str = "zaya",
    progress=None,
    resume: bool = False,
) -> dict:
    """Tokenizes `inputs` into a prepared dataset at `out_dir` (layout in the module docstring),
    on `workers` processes; `progress`: a stream for progress lines (None: none).
    output_format "megatron" writes `out_dir`.bin + .idx instead (`_prepare_megatron`).
    `resume`: keep the shards written when interrupted, and continue from those an interrupted
    run with the same options kept (zaya_jax.data.prepare_resume).

    Returns the meta dict that was written to meta.json.
    """
    paths = [Path(p) for p in inputs]
    _check_inputs(paths, shard_tokens, eval_fraction, split_seed, text_field)
    separator = parse_separator(doc_separator)
    if output_format not in ("zaya", "megatron"):
        raise ValueError(f"unknown output format {output_format!r} (zaya or megatron)")
    if resume and output_format != "zaya":
        raise ValueError("--resume applies to --format zaya only (a --format megatron export restarts)")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    reading = [("--input", str(p)) for p in paths]
    if isinstance(tokenizer, (str, os.PathLike)) and str(tokenizer) != "byte":
        reading.append(("--tokenizer", str(tokenizer)))
    inputs_ = _Inputs(paths, separator, text_field)
    # Small inputs are quicker on one process than spawning more; the output is the same.
    encode = {"workers": 1 if sum(inputs_.sizes) < _SPAWN_MIN_BYTES else workers, "progress": progress}
    if output_format == "megatron":
        return _prepare_megatron(inputs_, str(out_dir), tok, overwrite=overwrite, reading=reading, **encode)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    meta = _meta(tok, dtype, paths, doc_separator, text_field, eval_fraction, split_seed)
    output_dir.check(str(out_dir), overwrite=overwrite, reading=reading)
    if not resume:
        prepare_resume.refuse_leftover(out_dir)
    state = None
    if resume:
        options = {k: v for k, v in meta.items() if k not in ("created_unix", "inputs")}
        options.update(inputs=prepare_resume.input_stamps(paths), shard_tokens=shard_tokens)
        state = prepare_resume.ResumeState.open(out_dir, options)
    write = functools.partial(_write_splits, inputs_, tok, dtype, shard_tokens, eval_fraction, split_seed,
                              encode=encode, progress=progress)  # fmt: skip
    # Built beside the destination and moved into place: meta.json, the last file, marks a complete dataset.
    staged = functools.partial(output_dir.staged, str(out_dir), overwrite=overwrite, reading=reading,
                               last=(META_FILENAME,))  # fmt: skip
    if state is None:
        with staged() as tmp:
            _write_meta(Path(tmp), tok, meta, *write(Path(tmp)))
        return meta
    written = write(state.root, state=state)  # the shards outlive an interrupt in state.root
    with staged() as tmp:
        state.forget()  # from here a kill restarts the run: a half-moved state must not be resumed
        for split in SPLITS:
            shutil.move(str(state.root / split), str(Path(tmp) / split))
        state.remove()
        _write_meta(Path(tmp), tok, meta, *written)
    return meta


def _write_splits(
    inputs: _Inputs,
    tok: Tokenizer,
    dtype,
    shard_tokens: int,
    eval_fraction: float,
    split_seed: int,
    work: Path,
    *,
    encode: dict,
    progress,
    state: prepare_resume.ResumeState | None = None,
) -> tuple[dict, int, int]:
    """The train and eval shards of `inputs` in `work` (with a checkpoint of `state` after each
    one, continuing from its last): (the writers, eval tail tokens, empty documents skipped)."""
    splitter = _Splitter(
        tok, {s: _ShardWriter(work / s, dtype, shard_tokens) for s in SPLITS}, eval_fraction, split_seed
    )
    if state is not None and state.checkpoint is not None:
        splitter.restore(state.checkpoint, state.pending)
        inputs.start_at(state.checkpoint)
        _say(progress, f"prepare: resuming from {state.root}: {splitter.doc_index:,} documents in "
                       f"{splitter.num_shards()} shards already written")  # fmt: skip
    for ids in _encoded(inputs, tok, **encode):
        shards_before = splitter.num_shards()
        splitter.add(ids)
        if state is not None and splitter.num_shards() != shards_before:
            position = {"doc_index": splitter.doc_index, **inputs.written()}
            state.save(position, splitter.writers, splitter.pending())
    writers, held_out_tokens = splitter.finish()
    return writers, held_out_tokens, inputs.skipped


def _write_meta(
    out: Path, tok: Tokenizer, meta: dict, writers: dict, held_out_tokens: int, skipped: int
) -> None:
    """The tokenizer files and meta.json (completed with the split sizes) into `out`."""
    tok.save(out)
    meta.update(
        skipped_empty_docs=skipped,
        eval_tail_tokens=held_out_tokens,
        splits={s: w.summary() for s, w in writers.items()},
    )
    (out / META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n")


def _say(progress, line: str) -> None:
    if progress is not None:
        progress.write(line + "\n")  # one write (Progress.report says why)
        progress.flush()


def _encoded(inputs: _Inputs, tok: Tokenizer, *, workers: int, progress) -> Iterator[np.ndarray]:
    """Each non-empty input document's token ids, in order, with progress lines on `progress`."""
    meter = Progress(inputs.position, out=progress) if progress is not None else None
    for ids in encode_documents(inputs.texts(), tok, workers=workers, batch=_ENCODE_BATCH):
        inputs.taken()
        if meter is not None:
            meter.add(len(ids))
        yield ids
    if meter is not None:
        meter.report()


def _prepare_megatron(
    inputs: _Inputs, prefix: str, tok: Tokenizer, *, overwrite: bool, reading, **encode
) -> dict:
    """Every document, EOS appended, in input order into PREFIX.bin + PREFIX.idx (the two files
    are checked as `--out` directories are: never over an input, replaced only with --overwrite)."""
    for suffix in (".bin", ".idx"):
        output_dir.check(prefix + suffix, overwrite=overwrite, reading=reading)
    writer = MegatronWriter(prefix, megatron_dtype(tok.vocab_size))
    try:
        for ids in _encoded(inputs, tok, **encode):
            writer.add(np.append(ids, tok.eos_id))
        if len(writer.doc_ends) == 1:
            raise ValueError("no documents to write (are the inputs empty?)")
        counts = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return {"format": "megatron", "prefix": prefix, "tokenizer": tokenizer_meta(tok),
            "skipped_empty_docs": inputs.skipped, **counts}  # fmt: skip


def tokenizer_meta(tok: Tokenizer) -> dict:
    """meta.json's record of a tokenizer (mixture sources must agree on it)."""
    return {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "pad_id": tok.pad_id, "bos_id": tok.bos_id}  # fmt: skip


def _meta(
    tok: Tokenizer, dtype: np.dtype, paths: list[Path], doc_separator, text_field, eval_fraction, split_seed
) -> dict:
    """meta.json's record of how the dataset was made (the split sizes are added once written)."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_unix": int(time.time()),
        "tokenizer": tokenizer_meta(tok),
        "dtype": dtype.name,
        "inputs": [str(p) for p in paths],
        "doc_separator": doc_separator,
        "text_field": text_field,
        "eval_fraction": eval_fraction,
        "split_seed": split_seed,
    }


def _check_inputs(
    paths: list[Path], shard_tokens: int, eval_fraction: float, split_seed: int, text_field: str = "text"
) -> None:
    """Every argument of prepare_dataset that can be wrong, checked before any work is done."""
    if not paths:
        raise ValueError("no input files given")
    for p in paths:
        if not p.is_file() and not input_formats.is_hf_dataset_dir(p):
            raise FileNotFoundError(f"input file not found: {p}")
        kind = _input_kind(p)
        if kind in ("parquet", "hf"):
            input_formats.check_text_column(p, kind, text_field)
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    is_eval_document(0, eval_fraction, split_seed)  # validates eval_fraction


class _Splitter:
    """Token documents -> EOS-terminated documents, each to the train or eval writer by
    is_eval_document. The last train document is written one document late, since it may give the
    eval split its tokens (finish)."""

    def __init__(self, tok: Tokenizer, writers: dict, eval_fraction: float, split_seed: int):
        self.tok, self.writers = tok, writers
        self.eval_fraction, self.split_seed = eval_fraction, split_seed
        self.doc_index = 0
        self.last_train: list[np.ndarray] = []

    def num_shards(self) -> int:
        return sum(len(w.shards) for w in self.writers.values())

    def pending(self) -> dict[str, list[np.ndarray]]:
        """The documents not yet in a shard (a checkpoint's)."""
        return {"train": self.writers["train"].pending, "eval": self.writers["eval"].pending,
                "last": self.last_train}  # fmt: skip

    def restore(self, checkpoint: dict, pending: dict[str, list[np.ndarray]]) -> None:
        for split, writer in self.writers.items():
            writer.restore(checkpoint["writers"][split], pending[split])
        self.last_train = list(pending["last"])
        self.doc_index = checkpoint["doc_index"]

    def add(self, ids: np.ndarray) -> None:
        """One document's token ids (without EOS)."""
        doc = np.append(np.asarray(ids, np.int64), self.tok.eos_id)
        if is_eval_document(self.doc_index, self.eval_fraction, self.split_seed):
            self.writers["eval"].add(doc)
        else:
            if self.last_train:
                self.writers["train"].add(self.last_train.pop())
            self.last_train.append(doc)
        self.doc_index += 1

    def finish(self) -> tuple[dict, int]:
        """(the flushed writers, tokens of the last document held out as the eval split)."""
        writers, held_out_tokens = self.writers, 0
        if self.last_train and writers["eval"].num_docs == 0 and self.eval_fraction > 0:
            # Too few documents for a whole one to fall to eval (e.g. one .txt file read whole):
            # the eval split is the tail of the last document, a fraction of all tokens.
            total = writers["train"].num_tokens + len(self.last_train[0])
            n = math.ceil(self.eval_fraction * total)
            train_part, eval_part = split_tail(self.last_train.pop(), n, self.tok.eos_id)
            writers["train"].add(train_part)
            writers["eval"].add(eval_part)
            held_out_tokens = len(eval_part) - 1
        if self.last_train:
            writers["train"].add(self.last_train.pop())
        for w in writers.values():
            w.flush()
        if writers["train"].num_docs == 0:
            raise ValueError("no documents ended up in the train split (are the inputs empty?)")
        return writers, held_out_tokens


def _format_summary(out_dir: Path, meta: dict) -> str:
    tok = meta["tokenizer"]
    lines = [
        (f"wrote {out_dir} (tokenizer {tok['name']}, vocab_size {tok['vocab_size']}, "
        f"eos {tok['eos_id']}, pad {tok['pad_id']}, {meta['dtype']})")
    ]
    for split, s in meta["splits"].items():
        lines.append(
            f"  {split:5s}: {s['num_docs']:>10,d} docs {s['num_tokens']:>14,d} tokens "
            f"{len(s['shards']):>4d} shards"
        )
    if meta["skipped_empty_docs"]:
        lines.append(f"  skipped {meta['skipped_empty_docs']} empty documents")
    if meta.get("eval_tail_tokens"):
        lines.append(
            f"  eval holds the last {meta['eval_tail_tokens']:,d} tokens of the last document "
            "(too few documents for a whole one; --doc-separator cuts .txt files into documents)"
        )
    if meta["splits"]["eval"]["num_docs"] == 0:
        lines.append("  the eval split is empty (--eval-fraction 0): training needs one to evaluate")
    return "\n".join(lines)


def arg_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m zaya_jax.data.prepare",
        description="Tokenize .txt/.jsonl files into train/eval token shards for zaya_jax training.",
    )
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help=".txt or .jsonl files (optionally .gz)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output dataset directory")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (default), a tokenizer.json, or a directory saved by a tokenizer",
    )
    parser.add_argument(
        "--eval-fraction",
        type=cli.Float(min=0.0, max=1.0, max_open=True),
        default=0.01,
        help="fraction of documents held out for eval (default 0.01)",
    )
    parser.add_argument("--split-seed", type=cli.Int(min=0), default=0, help="seed of the train/eval split")
    parser.add_argument(
        "--shard-tokens",
        type=cli.Int(min=1),
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})",
    )
    parser.add_argument(
        "--doc-separator",
        default="none",
        help="how .txt files are cut into documents: none (whole file, default), "
        "blank-line, form-feed, or a literal string such as '\\n\\n\\n'",
    )
    parser.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DIR if it exists (never one holding an input)"
    )
    parser.add_argument(
        "--workers",
        type=cli.Int(min=1),
        default=multiprocessing.cpu_count(),
        help="tokenizing processes (default: every core; one for inputs under 4 MiB); "
        "the output is the same for any number",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the shards written if interrupted (in .DIR.prepare-resume beside DIR), and continue "
        "from those an interrupted --resume run of the same command kept",
    )
    parser.add_argument(
        "--format",
        choices=("zaya", "megatron"),
        default="zaya",
        help="zaya: DIR of train/eval shards (default); megatron: OUT.bin + OUT.idx, every document",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)
    kept = f"nothing written to {args.out}"
    if args.resume:
        kept += f"; its shards are kept in {prepare_resume.state_dir(args.out)}: run it again to continue"
    try:
        # a signal raises at once: prepare_dataset removes its unfinished temporary directory
        with interrupt.handled("prepare", mode="raise", kept=lambda: kept):
            meta = prepare_dataset(
                args.input,
                args.out,
                tokenizer=args.tokenizer,
                eval_fraction=args.eval_fraction,
                split_seed=args.split_seed,
                shard_tokens=args.shard_tokens,
                doc_separator=args.doc_separator,
                text_field=args.text_field,
                overwrite=args.overwrite,
                workers=args.workers,
                output_format=args.format,
                progress=sys.stderr,
                resume=args.resume,
            )
    except interrupt.Interrupted as e:
        raise interrupt.Interrupted(e.signum, kept) from None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.format == "megatron":
        print(f"wrote {args.out}.bin + {args.out}.idx: {meta['num_docs']:,} docs, {meta['num_tokens']:,} "
              f"tokens, {meta['dtype']} (tokenizer {meta['tokenizer']['name']}, "
              f"eos {meta['tokenizer']['eos_id']})")  # fmt: skip
    else:
        print(_format_summary(Path(args.out), meta))
    return 0


if __name__ == "__main__":
    cli.run(main)
