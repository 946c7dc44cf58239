"""load_model (zaya_jax/hf/pretrained.py): Orbax and HF sources, tokenizer and prefix rules, errors."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from support.eval_models import BYTE_CASE, orbax_from_hf, save_byte_hf_model

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.hf.pretrained import load_model, resolve_prefix
from zaya_jax.parallel.mesh import make_mesh


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pretrained")
    save_byte_hf_model(str(d / "hf"))
    ckpt = orbax_from_hf(str(d / "hf"), str(d / "run"))
    return d, ckpt


def test_orbax_and_hf_give_the_same_model(dirs):
    d, ckpt = dirs
    a, b = load_model(str(d / "hf")), load_model(str(d / "run"))  # workdir = its latest step
    assert (a.source, b.source, b.step) == ("hf", "orbax", 0)
    assert a.cfg == b.cfg and a.tokenizer.name == b.tokenizer.name == "byte"
    assert a.prefix_id == b.prefix_id == ByteTokenizer().eos_id  # both trained by us: EOS boundary
    for x, y in zip(jax.tree.leaves(a.variables), jax.tree.leaves(b.variables)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bf16 = load_model(ckpt, dtype="bfloat16")
    assert bf16.cfg.dtype == "bfloat16" and bf16.cfg.param_dtype == a.cfg.param_dtype


def test_restore_onto_a_mesh_lays_out_experts(dirs):
    _, ckpt = dirs
    m = load_model(ckpt, mesh=make_mesh(data=2, expert=4))
    gate_up = m.variables["params"]["layers"]["mlp"]["experts"]["gate_up_proj"]
    assert gate_up.sharding.spec[1] == "expert" and len(gate_up.addressable_shards) == 8


def test_plain_hf_tokenizer_dir_uses_bos(dirs, tmp_path):
    _d, _ = dirs
    tok = ByteTokenizer()
    assert resolve_prefix("auto", tok, trained_by_us=False) == tok.bos_id
    assert resolve_prefix("auto", tok, trained_by_us=True) == tok.eos_id
    assert resolve_prefix("bos", tok, True) == 2 and resolve_prefix("7", tok, True) == 7
    with pytest.raises(ValueError, match="expected 'auto'"):
        resolve_prefix("first", tok, True)
    assert resolve_prefix("none", tok, True) == tok.bos_id  # lm-eval's prefix_token_id: BOS, else EOS


def test_hf_dir_with_only_transformers_tokenizer_files(dirs, tmp_path):
    """Our export re-saved by transformers (no zaya_tokenizer.json) reads back as the byte tokenizer."""
    from zaya_jax.data.tokenizer import save_for_transformers

    d, _ = dirs
    hf = tmp_path / "hf"
    shutil.copytree(d / "hf", hf, ignore=shutil.ignore_patterns("zaya_tokenizer.json"))
    save_for_transformers(ByteTokenizer(), hf)
    m = load_model(str(hf))
    assert isinstance(m.tokenizer, ByteTokenizer) and m.prefix_id == 1 and m.prefix_every_request
    m = load_model(str(hf), prefix="none")
    assert m.prefix_id == 2 and not m.prefix_every_request


def test_errors_name_the_problem(dirs, tmp_path):
    d, _ = dirs
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face directory"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(d / "run" / "checkpoints" / "7"))
    bare = tmp_path / "bare"
    shutil.copytree(d / "hf", bare)
    (bare / "zaya_tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_model(str(bare))
    assert load_model(str(bare), tokenizer="byte").prefix_id == ByteTokenizer().bos_id  # not ours: BOS
    small = tmp_path / "small_vocab"
    save_byte_hf_model(str(small), dataclasses.replace(BYTE_CASE, vocab=97))
    with pytest.raises(ValueError, match="259 tokens but the model's vocab_size is 97"):
        load_model(str(small))
