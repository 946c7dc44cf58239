"""Tokenizers: a dependency-free byte tokenizer and a wrapper for HF `tokenizer.json` files.

Both expose the same small interface (`Tokenizer` protocol below), which is all the
data pipeline and the sampling code need:

    encode(text) -> list[int]            no special tokens are added
    encode_batch(texts) -> list[list[int]]
    decode(ids) -> str                   special tokens are skipped
    token_text(id) -> str                one token as transformers' decode(id) writes it (`</s>`)
    pad_id / eos_id / bos_id / vocab_size / name
    save(directory)                      records the tokenizer next to a prepared dataset

`load_tokenizer(spec)` turns a config string into a tokenizer:
    None or "byte"                       -> ByteTokenizer
    path/to/tokenizer.json               -> HFTokenizer
    a directory written by `.save()`     -> whichever tokenizer was saved there
    a transformers tokenizer directory   -> the same (tokenizer.json + tokenizer_config.json)

`save_for_transformers(tok, directory)` writes what `AutoTokenizer.from_pretrained` reads, with
the ids `encode` gives: the byte tokenizer as a byte-level `tokenizer.json` (specials <pad> 0,
</s> 1, <s> 2, byte b -> b + 3), an HF tokenizer's own `tokenizer.json` as is, and a
`tokenizer_config.json` naming the special tokens. `add_special_tokens=True` adds what the
tokenizer.json's post-processor says: nothing for the byte tokenizer, as our `encode`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# File written by `save()` describing the tokenizer (type + special ids).
CONFIG_FILENAME = "zaya_tokenizer.json"
HF_FILENAME = "tokenizer.json"
HF_CONFIG_FILENAME = "tokenizer_config.json"
# transformers' fast tokenizer over any tokenizer.json; without it AutoTokenizer would pick the
# class registered for model_type "zaya" (a Gemma tokenizer) and ignore our vocabulary.
HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
BYTE_SPECIAL_TOKENS = ("<pad>", "</s>", "<s>")  # ids 0, 1, 2: pad, eos, bos

# Special tokens looked up (in this order) when an HF tokenizer.json does not say which is which.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[EOS]", "<EOS>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "<BOS>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<PAD>")


@runtime_checkable
class Tokenizer(Protocol):
    """Interface shared by all tokenizers in this package."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def token_text(self, token_id: int) -> str: ...
    def save(self, directory: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer with ByT5-style ids: pad=0, eos=1, bos=2, byte b -> b + 3."""

    _OFFSET = 3

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return 256 + self._OFFSET

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def bos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        # numpy keeps this fast enough to tokenize the embedded corpus (~1.5 MB) in well under a second.
        return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self._OFFSET).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) - self._OFFSET for i in ids if self._OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token's text as transformers' `decode(token_id)` writes it: specials by name (`</s>`)."""
        if 0 <= token_id < self._OFFSET:
            return BYTE_SPECIAL_TOKENS[token_id]
        return self.decode([token_id])

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "type": "byte",
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
        }
        (directory / CONFIG_FILENAME).write_text(json.dumps(config, indent=2) + "\n")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def byte_level_tokenizer_json() -> str:
    """ByteTokenizer as a `tokenizers` tokenizer.json: identical ids and decoding.

    A byte-level BPE without merges: each byte is one token (the GPT-2 byte -> character alphabet
    names them), id byte + 3. The decoder maps them back to bytes and decodes them as UTF-8 with
    replacement characters, as `ByteTokenizer.decode`.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as _HFTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable characters, one per byte
    byte_char = {b: c for b, c in enumerate(_gpt2_byte_chars())}
    assert set(byte_char.values()) == set(alphabet)
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
    vocab.update({byte_char[b]: b + ByteTokenizer._OFFSET for b in range(256)})
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIAL_TOKENS])
    return tok.to_str(pretty=True)


def _gpt2_byte_chars() -> list[str]:
    """The byte -> printable character table of GPT-2's byte-level BPE (index = byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


class HFTokenizer:
    """A `tokenizers` library tokenizer loaded from a `tokenizer.json` file.

    eos/bos/pad are found among common special-token spellings (`</s>`, `<|endoftext|>`, `<pad>`,
    ...) unless given explicitly, either as an id or as a token string. A tokenizer without an
    EOS token is rejected (documents are separated by EOS when packed). Without a pad token, EOS
    doubles as padding; padded positions are always masked out of the loss anyway.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        eos: int | str | None = None,
        bos: int | str | None = None,
        pad: int | str | None = None,
    ):
        from tokenizers import Tokenizer as _HFTokenizer  # deferred: only needed for this class

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            raw = self.path.read_bytes()
            self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust error alone does not say which file was bad
            raise ValueError(f"cannot read tokenizer file {self.path}: {e}") from e
        self._digest = hashlib.sha256(raw).hexdigest()[:12]

        eos_id = self._resolve(eos, _EOS_CANDIDATES, "eos")
        if eos_id is None:
            raise ValueError(
                f"tokenizer {self.path} has no recognised EOS token (looked for {', '.join(_EOS_CANDIDATES)}); "
                "pass eos=<id or token> explicitly"
            )
        self._eos_id = eos_id
        self._bos_id = self._resolve(bos, _BOS_CANDIDATES, "bos")
        pad_id = self._resolve(pad, _PAD_CANDIDATES, "pad")
        self._pad_id = eos_id if pad_id is None else pad_id

    def _resolve(self, override: int | str | None, candidates: Sequence[str], what: str) -> int | None:
        """Id of the special token `what`: the override if given, else the first known candidate."""
        if isinstance(override, int):
            if not 0 <= override < self.vocab_size:
                raise ValueError(
                    f"{what} id {override} out of range for tokenizer {self.path} "
                    f"(vocab_size={self.vocab_size})"
                )
            return override
        if isinstance(override, str):
            tid = self._tok.token_to_id(override)
            if tid is None:
                raise ValueError(f"{what} token {override!r} is not in the vocabulary of {self.path}")
            return tid
        for token in candidates:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
        return None

    @property
    def name(self) -> str:
        # Content hash, so two datasets made with the same tokenizer file can be recognised as compatible.
        return f"hf-{self._digest}"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch runs in parallel inside the Rust library.
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text as transformers' `decode(token_id)` writes it: specials by name."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, directory / HF_FILENAME)
        # The special ids are recorded too, so overrides given at construction survive a reload.
        config = {
            "type": "hf",
            "file": HF_FILENAME,
            "name": self.name,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
        }
        (directory / CONFIG_FILENAME).write_text(json.dumps(config, indent=2) + "\n")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def save_for_transformers(tok: Tokenizer, directory: str | os.PathLike) -> list[str]:
    """Writes tokenizer.json + tokenizer_config.json for `AutoTokenizer.from_pretrained(directory)`
    (see the module docstring); returns the file names written."""
    from tokenizers import Tokenizer as _HFTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, ByteTokenizer):
        (directory / HF_FILENAME).write_text(byte_level_tokenizer_json())
    elif isinstance(tok, HFTokenizer):
        if tok.path.resolve() != (directory / HF_FILENAME).resolve():
            shutil.copyfile(tok.path, directory / HF_FILENAME)
    else:
        raise TypeError(f"save_for_transformers: no transformers form for tokenizer {tok!r}")
    hf = _HFTokenizer.from_file(str(directory / HF_FILENAME))
    config = {
        "tokenizer_class": HF_TOKENIZER_CLASS,
        "pad_token": hf.id_to_token(tok.pad_id),
        "eos_token": hf.id_to_token(tok.eos_id),
        "bos_token": None if tok.bos_id is None else hf.id_to_token(tok.bos_id),
        "clean_up_tokenization_spaces": False,
    }
    if isinstance(tok, ByteTokenizer):
        # "</s>" typed in a text is five bytes to ByteTokenizer.encode, not the EOS token
        config["split_special_tokens"] = True
    (directory / HF_CONFIG_FILENAME).write_text(json.dumps(config, indent=2) + "\n")
    return [HF_FILENAME, HF_CONFIG_FILENAME]


def _load_transformers_dir(directory: Path) -> Tokenizer:
    """A directory holding tokenizer.json (and maybe tokenizer_config.json naming the specials):
    the byte tokenizer if it is ours byte for byte, else an HFTokenizer with those specials."""
    path = directory / HF_FILENAME
    try:
        if json.loads(path.read_text()) == json.loads(byte_level_tokenizer_json()):
            return ByteTokenizer()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read tokenizer file {path}: {e}") from e
    specials = {}
    config_path = directory / HF_CONFIG_FILENAME
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:
            raise ValueError(f"cannot read {config_path}: {e}") from e
        for key in ("eos", "bos", "pad"):
            token = config.get(f"{key}_token")
            if isinstance(token, dict):  # an AddedToken written by transformers
                token = token.get("content")
            if isinstance(token, str):
                specials[key] = token
    return HFTokenizer(path, **specials)


def _load_config(config_path: Path) -> Tokenizer:
    """Rebuilds a tokenizer from the `zaya_tokenizer.json` written by `save()`."""
    try:
        config = json.loads(config_path.read_text())
        kind = config["type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read tokenizer config {config_path}: {e}") from e
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return HFTokenizer(
            config_path.parent / config.get("file", HF_FILENAME),
            eos=config.get("eos_id"),
            bos=config.get("bos_id"),
            pad=config.get("pad_id"),
        )
    raise ValueError(f"unknown tokenizer type {kind!r} in {config_path}")


def load_tokenizer(spec: str | os.PathLike | None) -> Tokenizer:
    """None/"byte" -> ByteTokenizer; a tokenizer.json -> HFTokenizer; a dir written by `save()` -> that one."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "byte", "bytes")):
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / CONFIG_FILENAME).is_file():
            return _load_config(path / CONFIG_FILENAME)
        if (path / HF_FILENAME).is_file():
            return _load_transformers_dir(path)
        raise FileNotFoundError(f"directory {path} contains neither {CONFIG_FILENAME} nor {HF_FILENAME}")
    if path.is_file():
        if path.name == CONFIG_FILENAME:
            return _load_config(path)
        return HFTokenizer(path)
    raise FileNotFoundError(
        f"tokenizer {str(spec)!r} not found: expected 'byte', a tokenizer.json file, "
        "or a directory written by Tokenizer.save()"
    )
