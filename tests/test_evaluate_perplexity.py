"""Rolling-window perplexity (zaya_jax/evaluate/perplexity.py)."""

import math

import jax
import numpy as np
import pytest

from zaya_jax.data.prepare import prepare_dataset
from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.evaluate.perplexity import (
    perplexity,
    rolling_windows,
    text_document,
    text_documents,
    token_documents,
)
from zaya_jax.evaluate.scoring import Scorer
from zaya_jax.model import ZayaConfig, ZayaForCausalLM, init_variables


def test_rolling_windows_lm_eval_example():
    # lm-eval's get_rolling_token_windows(range(10), prefix=-1, max_seq_len=4, context_len=1)
    got = [(r.inputs.tolist(), r.targets[r.score_from :].tolist()) for r in rolling_windows(range(10), -1, 4)]
    assert got == [
        ([-1, 0, 1, 2], [0, 1, 2, 3]),
        ([3, 4, 5, 6], [4, 5, 6, 7]),
        ([5, 6, 7, 8], [8, 9]),
    ]


@pytest.mark.parametrize(
    "n, max_len, stride", [(1, 4, None), (9, 4, None), (23, 8, 3), (8, 8, 1), (30, 5, 5)]
)
def test_rolling_windows_predict_every_token_once_with_maximal_context(n, max_len, stride):
    tokens = np.arange(100, 100 + n)
    seq = np.concatenate([[7], tokens])
    predicted = []
    for r in rolling_windows(tokens, 7, max_len, stride):
        assert 1 <= len(r.inputs) <= max_len
        lo = int(np.flatnonzero(seq == r.inputs[0])[0])
        np.testing.assert_array_equal(r.inputs, seq[lo : lo + len(r.inputs)])
        np.testing.assert_array_equal(r.targets, seq[lo + 1 : lo + 1 + len(r.inputs)])
        predicted += r.targets[r.score_from :].tolist()
        assert len(r.targets) - r.score_from <= (stride or max_len)  # at most `stride` new predictions
        assert lo == 0 or len(r.inputs) == max_len  # as much context as fits
    assert predicted == tokens.tolist()
    with pytest.raises(ValueError, match="stride"):
        rolling_windows(tokens, 7, max_len, max_len + 1)


@pytest.fixture(scope="module")
def model():
    cfg = ZayaConfig.tiny(vocab_size=259, num_hidden_layers=2)
    return cfg, jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(4))  # one program


def test_one_window_equals_the_full_forward_and_metrics_follow(model):
    cfg, variables = model
    tok = ByteTokenizer()
    doc = text_document("hello world, hello moon", tok)
    res = perplexity(Scorer(cfg, batch_size=2, max_len=32, min_bucket=8), variables, [doc], tok.eos_id)
    seq = np.concatenate([[tok.eos_id], doc.tokens])
    logits = jax.jit(lambda v, x: ZayaForCausalLM(cfg).apply(v, x).logits)(variables, seq[None, :-1])[0]
    nll = -float(np.asarray(jax.nn.log_softmax(logits))[np.arange(len(seq) - 1), seq[1:]].sum())
    assert res["tokens"] == res["bytes"] == len(doc.tokens) == 23 and res["words"] == 4
    np.testing.assert_allclose(res["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(res["perplexity"], math.exp(nll / 23), rtol=1e-5)
    np.testing.assert_allclose(res["bits_per_byte"], nll / 23 / math.log(2), rtol=1e-5)
    np.testing.assert_allclose(res["word_perplexity"], math.exp(nll / 4), rtol=1e-5)


def test_windows_sum_to_the_document_and_stride_adds_context(model):
    cfg, variables = model
    tok = ByteTokenizer()
    docs = [text_document("a quick brown fox jumps over the lazy dog " * 2, tok), text_document("hi", tok)]
    scorer = Scorer(cfg, batch_size=4, max_len=16, min_bucket=8)
    disjoint = perplexity(scorer, variables, docs, tok.eos_id)
    overlapping = perplexity(scorer, variables, docs, tok.eos_id, stride=4)
    assert disjoint["tokens"] == overlapping["tokens"] == 86
    assert disjoint["windows"] == 6 + 1 and overlapping["windows"] == 21 + 1
    assert overlapping["nll"] != disjoint["nll"]
    # with max_len covering the document both are the same single pass
    wide = Scorer(cfg, batch_size=4, max_len=128, min_bucket=8)
    np.testing.assert_allclose(
        perplexity(wide, variables, docs, tok.eos_id)["nll"],
        perplexity(wide, variables, docs, tok.eos_id, stride=7)["nll"],
        rtol=1e-5,
    )


def test_text_file_and_its_prepared_shards_agree(model, tmp_path):
    cfg, variables = model
    tok = ByteTokenizer()
    text = tmp_path / "corpus.txt"
    text.write_text("First document here.\n\nSecond one, a little longer.\n\nThird.\n")
    prepare_dataset([text], tmp_path / "prepared", eval_fraction=0.0, doc_separator="blank-line")
    scorer = Scorer(cfg, batch_size=2, max_len=16, min_bucket=8)
    from_text = perplexity(scorer, variables, text_documents(text, tok, separator="blank-line"), tok.eos_id)
    from_shards = perplexity(
        scorer, variables, token_documents(str(tmp_path / "prepared"), "train", tok), tok.eos_id
    )
    for key in ("documents", "tokens", "bytes", "words"):
        assert from_text[key] == from_shards[key]
    np.testing.assert_allclose(from_text["nll"], from_shards["nll"], rtol=1e-6)
    assert from_text["documents"] == 3


def test_bad_inputs(model, tmp_path):
    cfg, variables = model
    scorer = Scorer(cfg, batch_size=2, max_len=16, min_bucket=8)
    with pytest.raises(ValueError, match="no non-empty documents"):
        perplexity(scorer, variables, [text_document("", ByteTokenizer())], 1)
    with pytest.raises(FileNotFoundError, match="not found"):
        text_documents(tmp_path / "missing.txt", ByteTokenizer())
