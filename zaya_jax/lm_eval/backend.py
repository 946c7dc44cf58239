"""The lm-evaluation-harness model `zaya_jax`: `loglikelihood`, `loglikelihood_rolling` and
`generate_until` over our jitted bucketed scorer (zaya_jax/evaluate/scoring.py) and cached decoding
(zaya_jax/generate.py), on one device or any mesh.

Requests are encoded exactly as lm-eval's `--model hf` encodes them (`TemplateLM`: trailing context
spaces move to the continuation, an empty context is the prefix token, rolling windows from
`lm_eval.utils.get_rolling_token_windows`, contexts cut from the left to `max_length`), so the
numbers equal `--model hf` on the exported directory. Without `max_length` the window is the
checkpoint's train.seq_len (an Orbax checkpoint past step 0), else max_position_embeddings as
lm-eval's HF model takes it; one printed line names it. `prefix` maps onto the HF backend's options:

    prefix=none (default)  HF's default: nothing before a context with text; an empty context and a
                           document's first token are predicted from `prefix_token_id` (BOS, else EOS)
    prefix=bos             HF's add_bos_token=True: BOS before every encoded text
    prefix=eos | auto | ID that token before every encoded text (auto: EOS for models trained here,
                           the document boundary the packer puts before every document)

Every request of one call is scored in one `Scorer.score` (length-sorted batches, one compiled
step per sequence bucket); generation runs `batch_size` prompts at a time (longest first) and ends
a row once its text holds a stop sequence (checked every `STOP_EVERY` tokens). With several
processes every process runs every request (lm-eval's rank 0 of world size 1 on each: the mesh
spans the processes, so the jitted calls must be the same everywhere) and gets every result.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from zaya_jax.data.tokenizer import Tokenizer
from zaya_jax.evaluate import Request, Scorer, parse_mesh
from zaya_jax.generate import generate
from zaya_jax.model import ZayaConfig
from zaya_jax.parallel.context import row_devices
from zaya_jax.parallel.distributed import barrier
from zaya_jax.parallel.mesh import MESH_AXES, parse_mesh_spec

PREFIXES = ("none", "bos", "eos", "auto")
DEFAULT_BATCH = 8  # rows per step, rounded up to a multiple of the mesh's devices
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF default
STOP_EVERY = 16  # tokens decoded between two checks for stop sequences
# generation_kwargs we implement; anything else is an error rather than silently ignored
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")
MAX_TOKEN_ALIASES = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # of max_gen_toks
WINDOW_FROM = {  # where the default max_length comes from -> its words
    "train.seq_len": "the checkpoint's train.seq_len; max_length=N in --model_args sets another",
    "max_position_embeddings": "the model's max_position_embeddings, as lm-eval's HF model; "
    "max_length=N in --model_args sets another",
}
_CALLS = itertools.count()  # numbers the barriers: every process makes the same calls in order


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The checked `--model_args` of `zaya_jax` (see `check_model_args`)."""

    checkpoint: str
    batch_size: int | None = None  # None: DEFAULT_BATCH rounded up to the mesh
    max_length: int | None = None  # None: the checkpoint's train.seq_len, else max_position_embeddings
    prefix: str | int = "none"
    mesh: str = "auto"
    dtype: str | None = None
    tokenizer: str | None = None
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    seed: int = 0


def _int_at_least(key: str, value: Any, low: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():  # lm-eval reads "-1" as -1.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"--model_args {key}={value}: must be an int >= {low}")
    return value


def check_model_args(args: dict[str, Any]) -> ModelArgs:
    """`--model_args` as lm-eval parsed them (values typed: 8 -> int, None -> None) -> ModelArgs; a
    bad or unknown one is a ValueError naming it. `pretrained` (the HF backend's name, which lm-eval
    also names its output folder after) is another name for `checkpoint`. Checks that need the
    devices or the model (the mesh's device count, max_position_embeddings) come when it is loaded."""
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    for key in args:
        if key not in known | {"pretrained"}:
            hint = (
                ' (a mesh spec with commas goes in quotes: mesh="data=2,expert=4")'
                if key in MESH_AXES
                else ""
            )
            raise ValueError(f"--model_args {key}: unknown key (known: {', '.join(sorted(known))}){hint}")
    a = {k: v for k, v in args.items() if v is not None}
    alias = a.pop("pretrained", None)
    if alias is not None and a.setdefault("checkpoint", alias) != alias:
        raise ValueError(f"--model_args checkpoint={a['checkpoint']} and pretrained={alias} differ")
    if not a.get("checkpoint"):
        raise ValueError(
            "--model_args checkpoint=PATH is required (a training workdir, a step or an HF directory)"
        )
    a["checkpoint"] = str(a["checkpoint"])
    if not os.path.exists(a["checkpoint"]):
        raise FileNotFoundError(f"--model_args checkpoint={a['checkpoint']}: does not exist")
    for key, low in (("batch_size", 1), ("max_length", 2), ("max_gen_toks", 1), ("seed", 0)):
        if key in a:
            a[key] = _int_at_least(key, a[key], low)
    prefix = a.get("prefix", "none")
    if (
        not (isinstance(prefix, int) and not isinstance(prefix, bool) and prefix >= 0)
        and prefix not in PREFIXES
    ):
        raise ValueError(f"--model_args prefix={prefix}: must be {', '.join(PREFIXES)} or a token id >= 0")
    mesh = a["mesh"] = str(a.get("mesh", "auto"))
    if mesh not in ("none", "auto"):
        try:
            parse_mesh_spec(mesh)
        except ValueError as e:
            raise ValueError(f"--model_args mesh={mesh}: {e} (or none / auto)") from None
    if a.get("dtype") not in (None, "float32", "bfloat16"):
        raise ValueError(f"--model_args dtype={a['dtype']}: must be float32 or bfloat16")
    return ModelArgs(**a)


@register_model("zaya_jax")
class ZayaLM(TemplateLM):
    """lm-eval's `--model zaya_jax` (module docstring). From a checkpoint: `ZayaLM(checkpoint=PATH,
    ...)` (the `--model_args`); from a model in memory (the trainer): `ZayaLM.from_model(...)`,
    whose `variables` may be replaced between evaluations."""

    def __init__(self, checkpoint: str | None = None, **model_args: Any):
        super().__init__()
        a = check_model_args({"checkpoint": checkpoint, **model_args})
        from zaya_jax.hf.pretrained import load_model, tokenizer_line

        mesh = parse_mesh(a.mesh)
        if mesh is not None and a.batch_size is not None and a.batch_size % row_devices(mesh):
            raise ValueError(
                f"--model_args batch_size={a.batch_size}: must be a multiple of the {row_devices(mesh)} "
                f"devices of the mesh {dict(mesh.shape)} that split rows (all but the context axis)"
            )
        m = load_model(a.checkpoint, mesh=mesh, dtype=a.dtype, tokenizer=a.tokenizer, prefix=a.prefix)
        if a.max_length is not None and a.max_length > m.cfg.max_position_embeddings:
            raise ValueError(
                f"--model_args max_length={a.max_length}: exceeds the model's max_position_embeddings "
                f"({m.cfg.max_position_embeddings})"
            )
        if a.max_length is None:  # the trained length when the checkpoint records one
            length, source = m.default_window()
            a = dataclasses.replace(a, max_length=length)
            if jax.process_index() == 0:
                print(f"zaya_jax: max_length {length} ({WINDOW_FROM[source]})", flush=True)
        if m.prefix_id >= m.cfg.vocab_size:
            raise ValueError(
                f"--model_args prefix={a.prefix}: not a token id (vocab_size {m.cfg.vocab_size})"
            )
        self._setup(m.cfg, m.tokenizer, m.prefix_id, m.prefix_every_request, mesh, a)
        self.variables = m.variables
        self.info = {"checkpoint": os.path.abspath(a.checkpoint), "source": m.source, "step": m.step}
        if self.progress:  # process 0
            print(tokenizer_line(m), file=sys.stderr, flush=True)

    @classmethod
    def from_model(
        cls,
        cfg: ZayaConfig,
        variables: Any,
        tokenizer: Tokenizer,
        *,
        prefix_id: int,
        prefix_every_request: bool,
        mesh=None,
        batch_size: int | None = None,
        max_length: int | None = None,
        progress: bool = True,
    ) -> ZayaLM:
        self = cls.__new__(cls)
        TemplateLM.__init__(self)
        args = ModelArgs(checkpoint="", batch_size=batch_size, max_length=max_length)
        self._setup(cfg, tokenizer, prefix_id, prefix_every_request, mesh, args)
        self.variables = variables
        self.info = {}
        self.progress = progress and self.progress
        return self

    def _setup(self, cfg: ZayaConfig, tokenizer: Tokenizer, prefix_id: int, every: bool, mesh, a: ModelArgs):
        self.cfg = dataclasses.replace(cfg, moe_capacity_factor=None)  # dropless, as the scorer
        self.tokenizer, self.prefix_id, self.prefix_every_request = tokenizer, prefix_id, every
        self.mesh = mesh
        devices = row_devices(mesh)
        self.batch_size = -(-DEFAULT_BATCH // devices) * devices if a.batch_size is None else a.batch_size
        self.max_length = cfg.max_position_embeddings if a.max_length is None else a.max_length
        self._max_gen_toks, self.seed = a.max_gen_toks, a.seed
        self.scorer = Scorer(
            self.cfg, mesh=mesh, batch_size=self.batch_size, max_len=self.max_length,
            min_bucket=min(64, self.max_length),
        )  # fmt: skip
        self.progress = jax.process_index() == 0  # progress bars (process 0's)

    # lm-eval builds a model from --model_args plus its own --batch_size / --max_batch_size /
    # --device; ours runs on the JAX devices of its mesh, and model_args' batch_size wins.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ZayaLM:
        return cls.create_from_arg_obj(lm_eval_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> ZayaLM:
        args = dict(arg_dict)
        extra = additional_config or {}
        if "batch_size" not in args and extra.get("batch_size") is not None:
            args["batch_size"] = extra["batch_size"]
        return cls(**args)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.prefix_id

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template:
            raise ValueError("--apply_chat_template: zaya_jax models have no chat template")
        return None

    def get_model_info(self) -> dict:
        mesh = None if self.mesh is None else dict(self.mesh.shape)
        return {**self.info, "dtype": self.cfg.dtype, "mesh": mesh, "prefix_id": self.prefix_id}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw):
        """As lm-eval's HF `tok_encode`: the prefix token before the text when every request gets
        one, unless add_special_tokens=False or the text already starts with that token's text."""
        ids = self.tokenizer.encode(string)
        starts_with_it = string.startswith(self.tokenizer.token_text(self.prefix_id))
        if self.prefix_every_request and (
            add_special_tokens or (add_special_tokens is None and not starts_with_it)
        ):
            ids = [self.prefix_id, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]], desc: str) -> list:
        """(context, continuation) token lists -> Scores, cut from the left to max_length inputs as
        lm-eval's HF backend cuts them."""
        _together()
        requests = []
        for context, continuation in pairs:
            if not continuation or len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens: lm-eval needs 1 to max_length "
                    f"({self.max_length}) tokens"
                )
            tokens = (context + continuation)[-(self.max_length + 1) :]
            requests.append(Request.from_sequence(tokens, len(continuation)))
        bar = tqdm(total=len(requests), desc=desc, disable=not self.progress)
        scores = self.scorer.score(self.variables, requests, lambda done, _: bar.update(done - bar.n))
        bar.close()
        return scores

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        scores = self._score([(context, cont) for _, context, cont in requests], "zaya_jax loglikelihood")
        out = []
        for (request, _, _), s in zip(requests, scores, strict=True):
            out.append((s.logprob, s.greedy))
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every window of every document in one scoring call; a document's windows summed."""
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, cont in map(
                lm_eval_utils.make_disjoint_window,
                lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((list(context), list(cont)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(owner, self._score(windows, "zaya_jax loglikelihood_rolling"), strict=True):
            totals[i] += s.logprob
        for r, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation_kwargs, each group `batch_size` prompts at a time."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="zaya_jax generate_until", disable=not self.progress)
        for indices in groups.values():
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate(contexts, requests[indices[0]].args[1]), strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(1)
        bar.close()
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        until, max_gen_toks, temperature, top_p = self._sampling(gen_kwargs)
        _together()
        max_ctx = self.max_length - max_gen_toks  # room for every new token, as lm-eval's HF
        prompts = [self.tok_encode(c)[-max_ctx:] or [self.prefix_id] for c in contexts]
        stop = _stop_on(until, self.tokenizer) if until else None
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts: list[str] = [""] * len(prompts)
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            batch = [prompts[i] for i in rows]
            batch += [batch[-1]] * (self.batch_size - len(batch))  # one compiled shape per bucket
            new = generate(
                self.cfg, self.variables, batch, max_gen_toks, temperature=temperature, top_p=top_p,
                seed=self.seed + first // self.batch_size, eos_id=self.tokenizer.eos_id,
                stop=stop, stop_every=STOP_EVERY, mesh=self.mesh,
            )  # fmt: skip
            for i, tokens in zip(rows, new, strict=False):
                texts[i] = postprocess_generated_text(self.tokenizer.decode(tokens), until, None)
        return texts

    def _sampling(self, gen_kwargs: dict) -> tuple[list[str], int, float, float]:
        """(stop strings with the EOS text, max_gen_toks, temperature (0: greedy), top_p) of a
        task's generation_kwargs, normalised as lm-eval's HF backend does."""
        check_gen_kwargs(gen_kwargs, "generation_kwargs")
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)  # a deep copy
        max_gen_toks, top_p = kwargs["max_gen_toks"], float(kwargs.get("top_p", 1.0))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
        if kwargs["do_sample"] and not temperature > 0:
            raise ValueError(f"generation_kwargs do_sample=True needs a temperature > 0, got {temperature}")
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"generation_kwargs max_gen_toks={max_gen_toks}: must be < max_length={self.max_length} "
                "(the context keeps max_length - max_gen_toks tokens)"
            )
        eos = self.tokenizer.token_text(self.eot_token_id)
        return handle_stop_sequences(kwargs["until"], eos=eos), max_gen_toks, temperature, top_p


def check_gen_kwargs(gen_kwargs: dict, where: str) -> None:
    """Each generation kwarg on its own: a key we do not implement or a value out of range is a
    ValueError naming `where` and the key (`--gen_kwargs` or a task's generation_kwargs)."""
    for key, value in gen_kwargs.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in ("max_gen_toks", *MAX_TOKEN_ALIASES):
            ok = number and value == int(value) and value >= 1
            need = "a whole number >= 1"
        elif key == "temperature":
            ok, need = number and value >= 0, "a number >= 0"
        elif key == "top_p":
            ok, need = number and 0 < value <= 1, "a number in (0, 1]"
        elif key == "do_sample":
            ok, need = isinstance(value, bool), "true or false"
        elif key == "until":
            ok = isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(u, str) for u in value)
            )
            need = "a string or a list of strings"
        else:
            supported = ", ".join((*GEN_KWARGS, *MAX_TOKEN_ALIASES))
            raise ValueError(f"{where} {key}: not supported by zaya_jax (supported: {supported})")
        if not ok:
            raise ValueError(f"{where} {key}={value!r}: must be {need}")


def _together() -> None:
    """Every process starts a batch of requests together: lm-eval's host-side work before it
    (loading datasets, building requests) may take some much longer than others, and the first
    cross-process collective after it would time out (zaya_jax/parallel/distributed.py)."""
    barrier(f"zaya_jax/lm_eval/{next(_CALLS)}")


def _stop_on(until: Sequence[str], tokenizer: Tokenizer) -> Callable[[int, list[int]], bool]:
    """A row ends once its decoded text holds a stop string (lm-eval then cuts the text there)."""
    terms = [u for u in until if u]
    return lambda _row, tokens: any(u in tokenizer.decode(tokens) for u in terms)
