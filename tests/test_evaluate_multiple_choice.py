"""Multiple-choice scoring (zaya_jax/evaluate/multiple_choice.py): a task whose answers follow in
closed form from a hand-built model, lm-eval's tokenisation rules, and the task-file checks."""

import json
import math

import jax
import numpy as np
import pytest

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.evaluate.multiple_choice import Example, choice_requests, encode_pair, load_task, score_task
from zaya_jax.evaluate.scoring import Scorer
from zaya_jax.model import ZayaConfig, init_variables

V, D, A = 259, 272, 2.0  # byte vocab, width, logit of the successor token


def successor_model():
    """Every block's output is scaled to zero, so logits depend on the current token only: the
    untied head gives logit A to token cur+1 and 0 to every other token."""
    cfg = ZayaConfig.tiny(vocab_size=V, hidden_size=D, tie_word_embeddings=False, num_hidden_layers=2)
    variables = jax.jit(init_variables, static_argnums=0)(cfg, jax.random.key(0))  # one program
    p = jax.tree.map(np.array, variables["params"])  # writable copies
    p["embed_tokens"]["embedding"] = np.eye(V, D, dtype=np.float32)
    for res in ("post_attention_residual_scale", "post_mlp_residual_scale"):
        p["layers"][res]["hidden_states_scale"][:] = 0.0
    norm_gain = 1.0 / math.sqrt(1.0 / D + cfg.rms_norm_eps)  # RMSNorm of a one-hot vector
    head = np.zeros((V, D), np.float32)
    head[np.arange(1, V), np.arange(V - 1)] = A / norm_gain
    p["lm_head"]["kernel"] = head
    return cfg, {"params": jax.tree.map(jax.numpy.asarray, p), "balancing": variables["balancing"]}


HI = A - math.log(math.exp(A) + V - 1)  # log p(successor)
LO = -math.log(math.exp(A) + V - 1)  # log p(any other token)


def closed_form_loglik(prev: int, tokens: list[int]) -> float:
    total = 0.0
    for t in tokens:
        total += HI if t == prev + 1 else LO
        prev = t
    return total


TASK = [  # delimiter "": the choice directly continues the context
    Example("abc", ("dxyz", "defg"), 1),  # 3 / 4 successors: right by both metrics
    Example("abc", ("x", "defgh"), 1),  # LO > 5 HI: the short wrong choice wins acc, not acc_norm
    Example("", ("xz", "ab"), 1),  # empty context: predicted from the prefix token
    Example("mn", ("o", "opqrz"), 0),
]


def test_hand_made_task_has_the_computable_answers():
    cfg, variables = successor_model()
    tok = ByteTokenizer()
    scorer = Scorer(cfg, batch_size=4, max_len=16, min_bucket=8)
    metrics, samples = score_task(scorer, variables, tok, TASK, tok.eos_id, delimiter="")
    for e, s in zip(TASK, samples):
        context = [tok.eos_id, *tok.encode(e.context)]
        want = [closed_form_loglik(context[-1], tok.encode(c)) for c in e.choices]
        np.testing.assert_allclose(s["loglikelihoods"], want, rtol=1e-5)
        assert s["num_tokens"] == [len(c) for c in e.choices]
    assert [s["pred"] for s in samples] == [1, 0, 1, 0]
    assert [s["pred_norm"] for s in samples] == [1, 1, 1, 0]
    assert samples[0]["is_greedy"] == [False, True]
    assert metrics["acc"] == 0.75 and metrics["acc_norm"] == 1.0 and metrics["examples"] == 4
    np.testing.assert_allclose(metrics["acc_stderr"], np.std([1, 0, 1, 1], ddof=1) / 2)
    assert metrics["acc_norm_stderr"] == 0.0


def test_encode_pair_moves_trailing_spaces_like_lm_eval():
    tok = ByteTokenizer()
    ctx, cont = encode_pair(tok, "One two ", " three")
    assert tok.decode(ctx) == "One two" and tok.decode(cont) == "  three"
    ctx, cont = encode_pair(tok, "", "x")
    assert ctx == [] and tok.decode(cont) == "x"


def test_long_context_is_cut_from_the_left():
    tok = ByteTokenizer()
    (r,) = choice_requests(Example("0123456789" * 3, ("abc",), 0), tok, tok.eos_id, max_len=8)[:1]
    assert len(r.inputs) == 8 and tok.decode(r.targets) == "6789 abc" and r.score_from == 4
    (short,) = choice_requests(Example("hi", ("yo",), 0), tok, tok.eos_id, max_len=8)[:1]
    assert short.inputs.tolist() == [tok.eos_id, *tok.encode("hi yo")[:-1]] and short.score_from == 2
    with pytest.raises(ValueError, match="more than max_len=8"):
        choice_requests(Example("hi", ("a" * 9, "b"), 0), tok, tok.eos_id, max_len=8)


def test_prefix_only_without_context_when_not_every_request():
    """--prefix none (lm-eval's default): a context is read as is; an empty one starts at the prefix."""
    tok = ByteTokenizer()
    (r,) = choice_requests(Example("hi", ("yo",), 0), tok, tok.bos_id, 8, prefix_every_request=False)[:1]
    assert r.inputs.tolist() == tok.encode("hi yo")[:-1] and r.score_from == 1
    (r,) = choice_requests(Example("", ("yo",), 0), tok, tok.bos_id, 8, prefix_every_request=False)[:1]
    assert r.inputs.tolist() == [tok.bos_id, *tok.encode(" yo")[:-1]] and r.score_from == 0


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"context": "a", "choices": ["x", "y"]}', r"missing field\(s\) \['answer'\]"),
        ('{"context": 3, "choices": ["x", "y"], "answer": 0}', "'context' must be a string"),
        ('{"context": "a", "choices": ["x"], "answer": 0}', "at least 2 non-empty strings"),
        ('{"context": "a", "choices": ["x", ""], "answer": 0}', "at least 2 non-empty strings"),
        ('{"context": "a", "choices": ["x", "y"], "answer": 2}', "index into the 2 choices"),
        ('{"context": "a", "choices": ["x", "y"], "answer": true}', "index into the 2 choices"),
    ],
)
def test_bad_task_rows_are_named_by_file_and_line(tmp_path, line, match):
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps({"context": "ok", "choices": ["a", "b"], "answer": 0}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"task.jsonl:3: .*{match}"):
        load_task(path)


def test_task_file_limit_and_missing(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"context": str(i), "choices": ["a", "b"], "answer": 1}) + "\n" for i in range(5))
    )
    assert [e.context for e in load_task(path, limit=2)] == ["0", "1"]
    with pytest.raises(FileNotFoundError, match="not found"):
        load_task(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        load_task(tmp_path / "empty.jsonl")
