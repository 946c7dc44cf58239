"""One loader for every way a trained model is stored: `load_model(path)`.

    m = load_model("runs/tiny")                    # Orbax: WORKDIR, WORKDIR/checkpoints or .../<step>
    m = load_model("exports/tiny_hf")              # a Hugging Face ZAYA1 directory (ours or Zyphra's)
    m = load_model(path, mesh=mesh, dtype="bfloat16")   # params laid out on a mesh, bf16 compute
    m.cfg, m.variables, m.tokenizer, m.prefix_id

From an Orbax checkpoint only the params and balancing biases are read (no optimizer state) and
the model config is rebuilt from the training config saved with it. The tokenizer is the one
stored in the workdir (WORKDIR/tokenizer: the trainer copies the data's there at start-up, import_hf
the HF directory's), else, for a workdir without one, the training data's own as the saved config
names it (the byte tokenizer for the embedded corpus); an HF directory carries its tokenizer
(zaya_tokenizer.json from our export, or a transformers tokenizer.json + tokenizer_config.json).
`tokenizer_file` says which file was read (the CLIs print it).

`prefix_id` is the token a document is predicted from when it has no context of its own (an empty
multiple-choice context, the first token of a perplexity document, a generation prompt's start):
EOS for models we trained (the packer puts an EOS before every document, see
zaya_jax/data/pipeline.py), otherwise the tokenizer's BOS as lm-evaluation-harness does, else EOS.
prefix="none" asks for lm-evaluation-harness's default: no token before a request that has text of
its own (`prefix_every_request` False); a request without (an empty context, a document's first
token) still starts from `prefix_id`, lm-eval's `prefix_token_id`: the BOS, else the EOS.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from typing import Any

import jax
from jax.sharding import Mesh

from zaya_jax import config as config_lib
from zaya_jax.data.tokenizer import CONFIG_FILENAME, HF_FILENAME, ByteTokenizer, Tokenizer, load_tokenizer
from zaya_jax.model import ZayaConfig
from zaya_jax.runtime import cli
from zaya_jax.training.checkpoint import Checkpointer, checkpoint_workdir
from zaya_jax.training.train_state import abstract_train_state, variable_shardings

# What the --prefix flag of a CLI that loads a model (generate, evaluate) takes: `prefix` of load_model.
PREFIX_FLAG = cli.OneOf(
    "auto", "bos", "eos", "none", other=cli.Int(min=0), other_doc="a token id (an int >= 0)"
)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    cfg: ZayaConfig
    variables: dict[str, Any]  # {"params": ..., "balancing": ...}
    tokenizer: Tokenizer
    prefix_id: int
    source: str  # "orbax" | "hf"
    step: int | None = None  # the Orbax step restored
    prefix_every_request: bool = True  # False for prefix="none"
    tokenizer_file: str = ""  # the file the tokenizer was read from (tokenizer_line)
    # train.seq_len of an Orbax checkpoint's saved config; None for an HF directory or step 0
    # (import_hf's checkpoint, a run's start: no training at that length)
    trained_seq_len: int | None = None

    def default_window(self) -> tuple[int, str]:
        """(tokens per row, where that number comes from) when the user names none: the trained
        sequence length, else the model's max_position_embeddings."""
        if self.trained_seq_len is not None:
            return min(self.trained_seq_len, self.cfg.max_position_embeddings), "train.seq_len"
        return self.cfg.max_position_embeddings, "max_position_embeddings"


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def load_checkpoint_variables(path: str, mesh: Mesh | None = None):
    """(training ConfigDict, ZayaConfig, {"params", "balancing"}, step) of an Orbax checkpoint,
    restored straight into the mesh layout (or onto one device)."""
    workdir, step = checkpoint_workdir(path)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(
            f"{path!r} is neither a Hugging Face directory (no config.json) nor a training workdir "
            f"(no {os.path.join(workdir, 'checkpoints')})"
        )
    ck = Checkpointer(workdir, read_only=True)
    try:
        step = ck.latest_step() if step is None else step
        if step is None or step not in ck.all_steps():
            raise FileNotFoundError(
                f"no checkpoint {'' if step is None else f'for step {step} '}under "
                f"{os.path.join(workdir, 'checkpoints')} (have: {ck.all_steps()})"
            )
        c = config_lib.from_json(ck.restore_config(step))
        cfg = config_lib.model_config(c)
        # laid out as the model reads them (a train state may keep the params in ZeRO-1 shards)
        abstract = abstract_train_state(c, cfg, mesh).variables
        placed = variable_shardings(abstract, jax.tree.leaves(abstract)[0].sharding.mesh)
        struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        variables = ck.restore_params(step, jax.tree.map(struct, abstract, placed))
    finally:
        ck.close()
    return c, cfg, variables, step


TOKENIZER_DIR = "tokenizer"  # WORKDIR/tokenizer: the run's tokenizer (train or import_hf wrote it)


def tokenizer_file(spec: str) -> str:
    """The file `load_tokenizer(spec)` reads: a directory's zaya_tokenizer.json (else its
    tokenizer.json), a file itself, or 'built in' for the byte tokenizer."""
    if spec is None or str(spec).strip().lower() in ("", "byte", "bytes"):
        return "built in"
    spec = os.path.abspath(os.path.expanduser(str(spec)))
    if os.path.isdir(spec):
        ours = os.path.join(spec, CONFIG_FILENAME)
        return ours if os.path.isfile(ours) else os.path.join(spec, HF_FILENAME)
    return spec


def tokenizer_line(m: Pretrained) -> str:
    """'tokenizer byte: WORKDIR/tokenizer/zaya_tokenizer.json', the line a CLI prints on loading."""
    return f"tokenizer {m.tokenizer.name}: {m.tokenizer_file}"


def store_tokenizer(tok: Tokenizer, workdir: str) -> str:
    """Saves `tok` as WORKDIR/tokenizer (written beside it, then renamed into place, so the directory
    is whole or absent); one already there is kept (check_stored_tokenizer compares them first)."""
    dst = os.path.join(workdir, TOKENIZER_DIR)
    if os.path.isdir(dst):
        return dst
    tmp = os.path.join(workdir, f".{TOKENIZER_DIR}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)  # the umask's permissions, as the rest of the workdir
    try:
        tok.save(tmp)
        os.rename(tmp, dst)  # fails if another process put one there meanwhile: theirs is kept
    except OSError:
        if not os.path.isdir(dst):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def check_stored_tokenizer(tok: Tokenizer, workdir: str, data_key: str) -> None:
    """A workdir's stored tokenizer is the one the data (`data_key`, e.g. 'config.data.path=DIR') was
    prepared with: its checkpoints hold embeddings of those ids."""
    stored = os.path.join(workdir, TOKENIZER_DIR)
    if not os.path.isdir(stored):
        return
    have = load_tokenizer(stored)
    ids = lambda t: (t.name, t.vocab_size, t.pad_id, t.eos_id, t.bos_id)
    if ids(have) != ids(tok):
        raise cli.UserError(
            f"{stored} holds tokenizer {have.name}, but {data_key} was prepared with {tok.name}: "
            "this workdir's model reads the stored one's ids; train on data prepared with it, or "
            "start a new --workdir (--config.train.init_from to start from this run's weights)"
        )


def checkpoint_tokenizer(c, path: str, step: int | None = None) -> tuple[Tokenizer, str]:
    """(tokenizer, the file read) of the Orbax checkpoint at `path` (training ConfigDict `c`, saved
    with checkpoint `step`): WORKDIR/tokenizer, else (a workdir without one) the training data's."""
    workdir = checkpoint_workdir(path)[0]
    stored = os.path.join(workdir, TOKENIZER_DIR)
    if os.path.isdir(stored):
        return load_tokenizer(stored), tokenizer_file(stored)
    from zaya_jax.data.megatron import MegatronOptions
    from zaya_jax.data.mixture import parse_mixture
    from zaya_jax.data.pipeline import megatron_prefix, source_tokenizer

    key, source = "data.path", c.data.path
    if c.data.mixture:
        key, source = "data.mixture", parse_mixture(c.data.mixture)[0].path
    megatron = MegatronOptions.of(c.data)
    if not source or source == "embedded":
        return source_tokenizer(source, megatron), "built in (the embedded corpus's byte tokenizer)"
    try:
        tok = source_tokenizer(source, megatron)
        named = c.data.tokenizer if megatron_prefix(source) is not None else source
        return tok, tokenizer_file(named)
    except (OSError, ValueError) as e:
        where = "" if os.path.isabs(source) else f", read relative to {os.getcwd()}"
        saved = "" if step is None else f" saved with checkpoint {step}"
        raise cli.UserError(
            f"{workdir} has no {TOKENIZER_DIR}/, and the tokenizer of its training data ({key}={source}"
            f"{saved}{where}) cannot be read: {cli.one_line(e)}; pass --tokenizer byte|FILE|DIR"
        ) from None


def _hf_tokenizer(path: str, vocab_size: int) -> Tokenizer:
    if os.path.isfile(os.path.join(path, CONFIG_FILENAME)) or os.path.isfile(os.path.join(path, HF_FILENAME)):
        return load_tokenizer(path)
    raise FileNotFoundError(
        f"{path}: no tokenizer ({CONFIG_FILENAME} or {HF_FILENAME}) next to the weights "
        f"(vocab_size {vocab_size}); pass one explicitly (tokenizer='byte' or a tokenizer.json)"
    )


def load_model(
    path: str,
    *,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    tokenizer: str | None = None,
    prefix: str | int = "auto",
    **config_overrides,
) -> Pretrained:
    """Loads an Orbax training checkpoint or an HF directory (see the module docstring).

    dtype: compute dtype override ("float32", "bfloat16"); config_overrides set other compute fields
    of ZayaConfig (attention_impl, moe_impl, ...). tokenizer: overrides the stored tokenizer.
    prefix: "auto", "bos", "eos" or a token id (see `prefix_id` above).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    overrides = dict(config_overrides)
    if dtype is not None:
        overrides["dtype"] = dtype
    if is_hf_dir(path):
        from zaya_jax import hf

        cfg, variables = hf.load_pretrained(path, **overrides)
        if mesh is not None:
            variables = jax.device_put(variables, variable_shardings(variables, mesh))
        tok = load_tokenizer(tokenizer) if tokenizer else _hf_tokenizer(path, cfg.vocab_size)
        tok_file = tokenizer_file(tokenizer or path)
        # our export (zaya_tokenizer.json), or its byte tokenizer.json re-saved by transformers
        stored_byte = not tokenizer and isinstance(tok, ByteTokenizer)
        ours = os.path.isfile(os.path.join(path, CONFIG_FILENAME)) or stored_byte
        source, step, seq_len = "hf", None, None
    else:
        c, cfg, variables, step = load_checkpoint_variables(path, mesh)
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        if tokenizer:
            tok, tok_file = load_tokenizer(tokenizer), tokenizer_file(tokenizer)
        else:
            tok, tok_file = checkpoint_tokenizer(c, path, step)
        ours, source = True, "orbax"
        seq_len = int(c.train.seq_len) if step else None
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}: wrong tokenizer for {path}"
        )
    prefix_id = resolve_prefix(prefix, tok, ours)
    if not 0 <= prefix_id < cfg.vocab_size:
        raise ValueError(
            f"prefix={prefix!r}: token id {prefix_id} is outside the model's vocabulary ({cfg.vocab_size})"
        )
    every = prefix != "none"
    return Pretrained(
        cfg, variables, tok, prefix_id, source, step, every, tok_file, trained_seq_len=seq_len
    )


def resolve_prefix(prefix: str | int, tokenizer: Tokenizer, trained_by_us: bool) -> int:
    if isinstance(prefix, int) or (isinstance(prefix, str) and prefix.isdigit()):
        return int(prefix)
    if prefix == "none":  # lm-evaluation-harness's prefix_token_id
        return tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
    if prefix == "eos":
        return tokenizer.eos_id
    if prefix == "bos":
        if tokenizer.bos_id is None:
            raise ValueError(f"prefix 'bos': tokenizer {tokenizer.name} has no BOS token")
        return tokenizer.bos_id
    if prefix != "auto":
        raise ValueError(f"prefix={prefix!r}: expected 'auto', 'bos', 'eos', 'none' or a token id")
    if trained_by_us or tokenizer.bos_id is None:
        return tokenizer.eos_id
    return tokenizer.bos_id
