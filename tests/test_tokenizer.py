"""Tests for zaya_jax.data.tokenizer: byte tokenizer, HF tokenizer.json wrapper, load_tokenizer/save."""

import json

import pytest
from support.tokenizers import TEXTS, build_hf_tokenizer
from tokenizers import Tokenizer

from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    text = "Call me Ishmael — naïve café, 日本語, emoji 🐋\n\ttabs"
    ids = tok.encode(text)
    assert ids == [b + 3 for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok.encode("") == []
    assert tok.encode_batch(["a", "é"]) == [[ord("a") + 3], [0xC3 + 3, 0xA9 + 3]]


def test_byte_special_ids():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size, tok.name) == (0, 1, 2, 259, "byte")
    ids = tok.encode("hi")
    assert min(ids) >= 3 and max(tok.encode("\xff")) < tok.vocab_size
    # Specials are skipped when decoding; invalid UTF-8 is replaced rather than raising.
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode([0xFF + 3]) == "\ufffd"


def test_hf_tokenizer_from_built_json(tmp_path):
    path = build_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size()
    ids = tok.encode("the cat sat on the log")
    assert len(ids) == 6 and tok.eos_id not in ids  # no specials added
    assert tok.decode(ids + [tok.eos_id]) == "the cat sat on the log"
    assert tok.encode_batch(["a dog", "the cat"]) == [tok.encode("a dog"), tok.encode("the cat")]
    assert tok.name.startswith("hf-")


def test_hf_special_overrides_and_missing_specials(tmp_path):
    path = build_hf_tokenizer(tmp_path / "tokenizer.json", specials=("<|endoftext|>", "<unk>"))
    tok = HFTokenizer(path)
    assert tok.eos_id == 0 and tok.pad_id == tok.eos_id and tok.bos_id is None  # pad falls back to eos
    assert HFTokenizer(path, eos="<unk>").eos_id == 1
    assert HFTokenizer(path, pad=1).pad_id == 1
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(path, bos="<nope>")

    no_eos = build_hf_tokenizer(tmp_path / "noeos.json", specials=("<unk>",))
    with pytest.raises(ValueError, match=r"noeos\.json.*no recognised EOS"):
        HFTokenizer(no_eos)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        HFTokenizer(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "garbage.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="garbage.json"):
        load_tokenizer(str(bad))
    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokenizer(tmp_path)  # a directory without a saved tokenizer


def test_load_tokenizer_specs_and_save_round_trip(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)

    ByteTokenizer().save(tmp_path / "byte_dir")
    assert json.loads((tmp_path / "byte_dir" / "zaya_tokenizer.json").read_text())["type"] == "byte"
    assert isinstance(load_tokenizer(tmp_path / "byte_dir"), ByteTokenizer)

    path = build_hf_tokenizer(tmp_path / "tokenizer.json", specials=("<|endoftext|>", "<unk>"))
    hf = HFTokenizer(path, pad="<unk>")
    assert isinstance(load_tokenizer(str(path)), HFTokenizer)
    hf.save(tmp_path / "hf_dir")
    reloaded = load_tokenizer(tmp_path / "hf_dir")
    assert isinstance(reloaded, HFTokenizer)
    assert (reloaded.name, reloaded.pad_id, reloaded.eos_id) == (hf.name, 1, 0)  # override survived
    assert reloaded.encode("a cat") == hf.encode("a cat")


def random_unicode(rng, n):
    """Text from every plane: ASCII, Latin, CJK, emoji, combining marks, controls; no surrogates."""
    ranges = [(0x20, 0x7E), (0x0, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
              (0xE000, 0xF8FF), (0x10000, 0x10FFFF)]  # fmt: skip
    out = []
    for _ in range(n):
        lo, hi = ranges[rng.integers(len(ranges))]
        out.append(chr(int(rng.integers(lo, hi + 1))))
    return "".join(out)


def test_byte_tokenizer_in_transformers_auto_tokenizer(tmp_path):
    import numpy as np
    from transformers import AutoTokenizer

    from zaya_jax.data.tokenizer import save_for_transformers

    # config.json of model_type zaya: tokenizer_config.json's class must win over the Gemma default
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "zaya"}))
    assert save_for_transformers(ByteTokenizer(), tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ByteTokenizer()
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, len(hf)) == (0, 1, 2, 259)
    rng = np.random.default_rng(0)
    texts = [random_unicode(rng, int(rng.integers(0, 200))) for _ in range(50)]
    texts += ["", " leading and trailing ", "literal </s> <s> <pad> stay bytes", "a\r\n\tb\x00c"]
    for text in texts:
        ids = ours.encode(text)
        assert hf(text).input_ids == ids  # add_special_tokens=True adds nothing: the documented choice
        assert hf(text, add_special_tokens=False).input_ids == ids
        assert hf.decode(ids) == text == ours.decode(ids)
    # any byte string, valid UTF-8 or not (truncated sequences, lone continuation bytes, 0xFF)
    for _ in range(200):
        ids = [int(b) + 3 for b in rng.integers(0, 256, int(rng.integers(1, 12)))]
        ids.insert(int(rng.integers(len(ids) + 1)), int(rng.integers(0, 3)))  # a special token, skipped
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids
    # lm-eval's add_bos_token=True: BOS first
    bos_first = AutoTokenizer.from_pretrained(str(tmp_path), add_bos_token=True)
    assert bos_first("hi").input_ids == [2, *ours.encode("hi")]
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # read back without zaya_tokenizer.json


def test_hf_tokenizer_in_transformers_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from zaya_jax.data.tokenizer import save_for_transformers

    src = build_hf_tokenizer(tmp_path / "src.json", specials=("<|endoftext|>", "<unk>", "<s>"))
    ours = HFTokenizer(src, pad="<unk>")
    out = tmp_path / "out"
    save_for_transformers(ours, out)
    assert (out / "tokenizer.json").read_bytes() == src.read_bytes()  # copied as is
    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (ours.pad_id, ours.eos_id, ours.bos_id)
    for text in TEXTS + ["the unknown word", "cat<|endoftext|>dog"]:
        assert hf(text, add_special_tokens=False).input_ids == ours.encode(text)
    back = load_tokenizer(out)  # special tokens from tokenizer_config.json
    assert (back.name, back.pad_id, back.eos_id, back.bos_id) == (ours.name, 1, 0, 2)
