"""Autoregressive generation with a per-layer cache (K/V, CCA conv state, delayed value).

    cache = init_cache(cfg, batch, max_len)
    logits, cache = prefill(cfg, variables, ids, attention_mask, cache)          # [B, V] last logits
    logits, cache = decode_step(cfg, variables, token_b, positions_b, index, cache)
    tokens = generate(cfg, variables, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0, eos_id=None)

`generate` runs prefill, sampling and decoding in one jitted `lax.while_loop` (the building blocks
above stay public for custom loops); with a `stop` callback (lm-eval's stop sequences) it decodes
`stop_every` tokens per `lax.while_loop` and asks the host between them which rows to end; with a
`mesh` the rows are split over the mesh's batch axes. Prompts of different lengths are left padded:
pad tokens are zeroed before the CCA projections and hidden as keys; positions count real tokens
only (cumsum(mask) - 1, as transformers' generate), so padding changes no result. The batch is padded to
a power-of-two length (`prompt_bucket`), so a loop over prompts of many lengths compiles one program
per bucket rather than one per length.

    python -m zaya_jax.generate --checkpoint CKPT_OR_HF_DIR --prompt "..." [--prompt "..." ...]
        [--prompts-file FILE] [--batch-size 8] [--max-new-tokens N] [--temperature T] [--top-p P]
        [--seed S] [--tokenizer T] [--prefix auto|bos|eos|ID|none] [--out completions.jsonl]

The checkpoint is an Orbax training checkpoint or an HF directory (zaya_jax.hf.pretrained.load_model);
each prompt is encoded after the model's prefix token (the document boundary it was trained with).
A prompt + --max-new-tokens beyond the model's max_position_embeddings is refused before anything
runs. Prompts are generated --batch-size at a time, decoded in chunks of about CHUNK_S seconds: a
batch of one prompt is printed as it grows, and each batch's completions are printed and appended to
--out (one JSON line per prompt) when it ends. SIGINT / SIGTERM stop at the next chunk (exit 130 /
143, one line): the batch under way is written as far as it got, with `"interrupted": true`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.transformer import KVCache, ZayaForCausalLM, init_cache
from zaya_jax.parallel.sharding import BATCH_AXES
from zaya_jax.runtime import cli, interrupt

__all__ = [
    "KVCache",
    "decode_step",
    "generate",
    "init_cache",
    "left_pad",
    "prefill",
    "prompt_bucket",
    "sample",
]

MIN_PROMPT_BUCKET = 16
CHUNK_S = 0.5  # seconds of decoding between two host checks when a caller watches the progress
MAX_CHUNK = 4096  # tokens per call at most


def prompt_bucket(length: int) -> int:
    """The padded prompt length of a batch whose longest prompt has `length` tokens: the next power
    of two, at least MIN_PROMPT_BUCKET."""
    return max(MIN_PROMPT_BUCKET, 1 << (length - 1).bit_length())


def left_pad(
    prompts: Sequence[Sequence[int]], width: int | None = None, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, S], attention mask [B, S]) int32, every prompt right-aligned; S = width or the longest."""
    s = width or max(len(p) for p in prompts)
    ids = np.full((len(prompts), s), pad_id, np.int32)
    mask = np.zeros((len(prompts), s), np.int32)
    for i, p in enumerate(prompts):
        ids[i, s - len(p) :], mask[i, s - len(p) :] = p, 1
    return ids, mask


@functools.partial(jax.jit, static_argnums=0)
def prefill(cfg: ZayaConfig, variables: Any, ids_bs: jax.Array, attention_mask_bs: jax.Array, cache: KVCache):
    """Runs the (left-padded) prompts [B, S] into an empty cache at slots 0..S-1.
    Returns (fp32 logits of the last slot [B, V], cache)."""
    mask = attention_mask_bs.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask
    out = ZayaForCausalLM(cfg).apply(
        variables, ids_bs, mask, positions=positions, cache=cache, cache_index=0, return_logits=False
    )
    logits = ZayaForCausalLM(cfg).apply(variables, out.hidden[:, -1], method="logits_from_hidden")
    return logits, out.cache


def _decode(cfg: ZayaConfig, variables: Any, token_b, position_b, index, cache: KVCache):
    out = ZayaForCausalLM(cfg).apply(
        variables, token_b[:, None], None, positions=position_b[:, None], cache=cache, cache_index=index
    )
    return out.logits[:, 0], out.cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=5)
def decode_step(
    cfg: ZayaConfig,
    variables: Any,
    token_b: jax.Array,
    position_b: jax.Array,
    index: jax.Array,
    cache: KVCache,
):
    """One token per sequence at position position_b [B], written at cache slot `index`.
    Returns (fp32 logits [B, V], cache)."""
    return _decode(cfg, variables, token_b, position_b, index, cache)


def sample(logits_bv: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Greedy with temperature <= 0, else nucleus sampling (top_p) at `temperature`."""
    if temperature <= 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        keep = (cum - probs) < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _start(cfg: ZayaConfig, variables: Any, prompt, max_new_tokens: int, pad_id: int, key) -> tuple:
    """Prefill -> the decoding carry: (step, logits, cache, position, key, tokens [B, max_new_tokens],
    done [B])."""
    ids, mask = prompt
    b, s = ids.shape
    logits, cache = prefill(cfg, variables, ids, mask, init_cache(cfg, b, s + max_new_tokens))
    position = jnp.sum(mask, axis=-1, dtype=jnp.int32)  # the next token's position per row
    tokens = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
    return jnp.zeros((), jnp.int32), logits, cache, position, key, tokens, jnp.zeros((b,), bool)


def _decode_until(cfg: ZayaConfig, variables: Any, carry: tuple, limit, prompt_len: int, sampling: tuple):
    """Samples and decodes in a `lax.while_loop` on the device (no host round trip per token) until
    step `limit` or until every row is done (produced eos_id or was stopped)."""
    temperature, top_p, eos_id, pad_id = sampling

    def cond(c):
        step, *_, done = c
        return (step < limit) & ~jnp.all(done)

    def body(c):
        step, logits, cache, position, key, tokens, done = c
        key, sub = jax.random.split(key)
        token = jnp.where(done, pad_id, sample(logits, sub, temperature, top_p))
        tokens = tokens.at[:, step].set(token)
        done = done | (token == eos_id)
        # the logits after the last token are not needed; the cache has a slot for them all the same
        logits, cache = _decode(cfg, variables, token, position, prompt_len + step, cache)
        return step + 1, logits, cache, position + 1, key, tokens, done

    return jax.lax.while_loop(cond, body, carry)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def _generate_loop(
    cfg: ZayaConfig,
    variables: Any,
    prompt: tuple[jax.Array, jax.Array],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Prefill, then sample and decode to the end in one program, stopping early once every row has
    produced eos_id (-1: never). Returns (tokens [B, max_new_tokens] (pad_id after a row's EOS),
    steps taken)."""
    carry = _start(cfg, variables, prompt, max_new_tokens, pad_id, key)
    sampling = (temperature, top_p, eos_id, pad_id)
    steps, *_, tokens, _ = _decode_until(cfg, variables, carry, max_new_tokens, prompt[0].shape[1], sampling)
    return tokens, steps


_start_jit = jax.jit(_start, static_argnums=(0, 3, 4))


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def _resume(
    cfg: ZayaConfig, variables: Any, carry: tuple, stopped_b, limit, prompt_len: int, sampling: tuple
):
    """Rows with stopped_b [B] set are done; then `_decode_until` step `limit`."""
    carry = (*carry[:-1], carry[-1] | stopped_b)
    return _decode_until(cfg, variables, carry, limit, prompt_len, sampling)


def _to_host(x: jax.Array) -> np.ndarray:
    """A (global) array as numpy on every process, rows from all processes included."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _placer(mesh: Mesh | None) -> Callable[[np.ndarray], Any]:
    """Host arrays [B, ...] -> device arrays: rows split over the mesh's batch axes (every process
    holds the whole batch; each device takes its rows), or as they are without a mesh."""
    if mesh is None:
        return jnp.asarray
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    return lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _trim(row: list[int], eos_id: int) -> list[int]:
    """A row's new tokens up to and with its first eos_id (-1: never)."""
    return row[: row.index(eos_id) + 1] if eos_id in row else row


def _decode_chunked(
    cfg, variables, prompt, max_new_tokens: int, sampling: tuple, key, put, stop, every: int, on_chunk
):
    """Decodes `every` tokens per call; after each call, stop(row, new tokens) ends a row and
    on_chunk(rows so far) sees the progress. Without `stop` the chunk length follows the measured
    speed, about CHUNK_S seconds a call. Returns the new tokens per row (a stopped row's up to
    where it was stopped)."""
    b, prompt_len = prompt[0].shape
    carry = _start_jit(cfg, variables, prompt, max_new_tokens, sampling[3], key)
    stopped, ends = np.zeros(b, bool), np.full(b, max_new_tokens)
    step, chunk = 0, every
    while step < max_new_tokens:
        limit = np.int32(min(step + chunk, max_new_tokens))
        t0, first = time.perf_counter(), step == 0  # the first call may compile
        carry = _resume(cfg, variables, carry, put(stopped), limit, prompt_len, sampling)
        step, tokens, done = int(_to_host(carry[0])), _to_host(carry[5]), _to_host(carry[6])
        if stop is None and not first:
            scale = CHUNK_S / max(time.perf_counter() - t0, 1e-4)
            chunk = int(np.clip(chunk * min(scale, 4.0), 1, MAX_CHUNK))
        for i in np.flatnonzero(~done) if stop is not None else ():  # rows still going
            if stop(int(i), tokens[i, :step].tolist()):
                stopped[i], ends[i] = True, step
        if on_chunk is not None:
            on_chunk([_trim(tokens[i, : min(ends[i], step)].tolist(), sampling[2]) for i in range(b)])
        if np.all(done | stopped) or step < limit:
            break
    return [tokens[i, : min(ends[i], step)].tolist() for i in range(b)]


def generate(
    cfg: ZayaConfig,
    variables: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    bucket: bool = True,
    *,
    stop: Callable[[int, list[int]], bool] | None = None,
    stop_every: int = 16,
    mesh: Mesh | None = None,
    on_chunk: Callable[[list[list[int]]], None] | None = None,
) -> list[list[int]]:
    """Continues each prompt by up to max_new_tokens tokens (stopping after eos_id); returns the
    new tokens per prompt (eos included when produced). One jitted program per (batch, padded
    prompt length, max_new_tokens, sampling settings); the prompts are left padded to
    `prompt_bucket` of the longest, or to the longest itself with bucket=False.

    stop(row, new_tokens) -> bool, checked every `stop_every` tokens, ends a row early (e.g. once
    its text holds a stop string); the row's tokens end where it was stopped. Sampling does not
    depend on stop_every (the key is split once per token either way). With a `mesh` the rows are
    split over its batch axes (len(prompts) must divide evenly; `variables` laid out on the mesh,
    every process passing the same prompts) and every process gets every row back.

    on_chunk(rows), called between chunks of decoding with each row's new tokens so far (as the
    result would hold them now), lets a caller stream the text or stop: an exception it raises
    ends the generation. With it (and no `stop`) the chunks last about CHUNK_S seconds each."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if stop_every < 1:
        raise ValueError(f"generate: stop_every={stop_every} must be >= 1")
    rows = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    if len(prompts) % rows:
        raise ValueError(f"generate: {len(prompts)} prompts do not split over the mesh's {rows} batch rows")
    s = max(len(p) for p in prompts)
    ids, mask = left_pad(prompts, prompt_bucket(s) if bucket else s, pad_id)
    put = _placer(mesh)
    prompt = (put(ids), put(mask))
    key = np.asarray(jax.random.PRNGKey(seed))  # host data: replicated on any mesh
    sampling = (float(temperature), float(top_p), -1 if eos_id is None else int(eos_id), pad_id)
    if stop is None and on_chunk is None:
        tokens, steps = _generate_loop(cfg, variables, prompt, max_new_tokens, *sampling, key)
        rows = _to_host(tokens)[:, : int(_to_host(steps))].tolist()
    else:
        rows = _decode_chunked(
            cfg, variables, prompt, max_new_tokens, sampling, key, put, stop, stop_every, on_chunk
        )
    return [_trim(row, sampling[2]) for row in rows]


def read_prompts(prompts: Sequence[str] | None, prompts_file: str | None) -> list[str]:
    """--prompt values, then the lines of --prompts-file (one prompt a line, blank lines skipped)."""
    out = list(prompts or [])
    if prompts_file is not None:
        if not os.path.isfile(prompts_file):
            raise FileNotFoundError(f"--prompts-file {prompts_file} not found")
        try:
            with open(prompts_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {prompts_file}: not UTF-8 text ({e.reason})") from None
        if not lines:
            raise ValueError(f"--prompts-file {prompts_file} is empty (no non-blank line): one prompt a line")
        out += lines
    if not out:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    return out


def arg_parser() -> cli.ArgumentParser:
    from zaya_jax.hf.pretrained import PREFIX_FLAG

    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--checkpoint", required=True, help="Orbax WORKDIR[/checkpoints[/STEP]] or an HF directory"
    )
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", default=None, help="a text file of prompts, one a line")
    ap.add_argument(
        "--batch-size", type=cli.Int(min=1), default=8, help="prompts generated together (default 8)"
    )
    ap.add_argument("--max-new-tokens", type=cli.Int(min=1), default=64)
    ap.add_argument("--temperature", type=cli.Float(min=0.0), default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=cli.Float(min=0.0, max=1.0, min_open=True), default=1.0)
    ap.add_argument("--seed", type=cli.Int(min=0), default=0, help="batch i samples with seed + i")
    ap.add_argument("--tokenizer", default=None, help="override: byte, a tokenizer.json or a saved dir")
    ap.add_argument(
        "--prefix",
        type=PREFIX_FLAG,
        default="auto",
        help="auto | bos | eos | ID | none: token before the prompt",
    )
    ap.add_argument("--out", default=None, help="write {prompt, completion, tokens, eos} per prompt (JSONL)")
    return ap


def check_sizes(encoded: Sequence[Sequence[int]], max_new_tokens: int, max_positions: int) -> None:
    """ValueError naming the longest prompt when it and max_new_tokens need more positions than the
    model has."""
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    n = len(encoded[longest])
    if n + max_new_tokens > max_positions:
        which = f"prompt {longest + 1} of {len(encoded)}" if len(encoded) > 1 else "the prompt"
        raise ValueError(
            f"{which} ({n} tokens) + --max-new-tokens {max_new_tokens} = {n + max_new_tokens} "
            f"positions: beyond the model's max_position_embeddings ({max_positions})"
        )


class _Output:
    """Completions as they finish: printed (a batch of one prompt streamed chunk by chunk) and
    appended to --out (flushed), so an interrupted run keeps what it finished."""

    def __init__(self, tokenizer, out: str | None):
        self.tokenizer, self.path, self.texts, self.rows = tokenizer, out, [], 0
        self.file = None
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            self.file = open(out, "w", encoding="utf-8")
        self._streamed: str | None = None  # the text of a streamed row printed so far

    def _print(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def start(self, prompt: str) -> None:
        """A batch of one prompt: its text now, the completion as it comes (`chunk`)."""
        self._print(("\n" + "-" * 40 + "\n" if self.texts else "") + prompt)
        self._streamed = ""

    def chunk(self, new: list[int]) -> None:
        text = self.tokenizer.decode(new).rstrip("\ufffd")  # a partial character waits
        if self._streamed is not None and text.startswith(self._streamed):
            self._print(text[len(self._streamed) :])
            self._streamed = text

    def finish(self, prompt: str, new: list[int], interrupted: bool = False) -> None:
        completion = self.tokenizer.decode(new)
        if self._streamed is not None and completion.startswith(self._streamed):
            self._print(completion[len(self._streamed) :])
        else:
            self._print(("\n" + "-" * 40 + "\n" if self.texts else "") + prompt + completion)
        self._streamed = None
        self.texts.append(prompt + completion)
        if self.file is not None:
            eos = bool(new) and new[-1] == self.tokenizer.eos_id
            row = {"prompt": prompt, "completion": completion, "tokens": new, "eos": eos}
            self.file.write(json.dumps({**row, "interrupted": True} if interrupted else row) + "\n")
            self.file.flush()
            self.rows += 1

    def close(self) -> None:
        self._print("\n")
        if self.file is not None:
            self.file.close()

    def kept(self, total: int) -> str:
        where = f" in {self.path}" if self.file is not None else ""
        return f"{self.rows if self.file is not None else len(self.texts)} of {total} completions kept{where}"


def main(argv: Sequence[str] | None = None) -> list[str]:
    ap = arg_parser()
    args = ap.parse_args(argv)
    try:
        texts = read_prompts(args.prompt, args.prompts_file)
    except (OSError, ValueError) as e:
        ap.error(str(e))

    from absl import logging

    from zaya_jax.hf.pretrained import load_model, tokenizer_line

    logging.set_verbosity(logging.WARNING)
    prefix = "auto" if args.prefix == "none" else args.prefix
    out: _Output | None = None
    kept = lambda: out.kept(len(texts)) if out is not None else ""
    try:
        with interrupt.handled("generate", mode="raise", kept=kept):  # the load: stop at once
            m = load_model(args.checkpoint, tokenizer=args.tokenizer, prefix=prefix)
            encoded = [m.tokenizer.encode(t) for t in texts]
            if args.prefix != "none":
                encoded = [[m.prefix_id, *p] for p in encoded]
            check_sizes(encoded, args.max_new_tokens, m.cfg.max_position_embeddings)
            print(tokenizer_line(m), file=sys.stderr, flush=True)
            out = _Output(m.tokenizer, args.out)
            with interrupt.polling():  # decoding: stop between chunks, the rows consistent
                _generate_batches(m, args, texts, encoded, out)
    except interrupt.Interrupted as e:
        raise interrupt.Interrupted(e.signum, kept()) from None
    finally:
        if out is not None:
            out.close()
    return out.texts


def _generate_batches(m, args, texts: list[str], encoded: list[list[int]], out: _Output) -> None:
    """Generates --batch-size prompts at a time, each batch's completions written as it ends."""
    for i in range(0, len(encoded), args.batch_size):
        sampling = {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed + i // args.batch_size,
        }
        _generate_batch(m, args.max_new_tokens, texts[i : i + args.batch_size], encoded[i : i + args.batch_size],
                        sampling, out)  # fmt: skip
        interrupt.check()


def _generate_batch(
    m, max_new_tokens: int, texts: list[str], encoded: list[list[int]], sampling, out
) -> None:
    """One batch; on an interrupt its completions are written as far as they got (`"interrupted":
    true` in --out)."""
    partial: list[list[int]] = [[] for _ in texts]

    def on_chunk(rows: list[list[int]]) -> None:
        partial[:] = rows
        if len(texts) == 1:
            out.chunk(rows[0])
        interrupt.check()

    if len(texts) == 1:
        out.start(texts[0])
    try:
        new = generate(
            m.cfg,
            m.variables,
            encoded,
            max_new_tokens,
            eos_id=m.tokenizer.eos_id,
            on_chunk=on_chunk,
            **sampling,
        )
    except interrupt.Interrupted:
        for text, row in zip(texts, partial):
            out.finish(text, row, interrupted=True)
        raise
    for text, row in zip(texts, new):
        out.finish(text, row)


if __name__ == "__main__":
    cli.run(main)
