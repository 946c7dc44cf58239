"""Cached decoding (zaya_jax.generate) against the full forward pass and transformers' generate."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from support.hf_reference import Case, random_hf_model

from zaya_jax import hf
from zaya_jax.generate import (
    _generate_loop,
    decode_step,
    generate,
    init_cache,
    left_pad,
    prefill,
    prompt_bucket,
    sample,
)
from zaya_jax.model import ZayaForCausalLM

CASE = Case(
    seed=5,
    layers=2,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    t0=2,
    t1=3,
    experts=3,
    theta=1e4,
    batch=2,
    seq=10,
    padded=False,
)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    ref = random_hf_model(CASE, layer_types=["hybrid_sliding", "hybrid"], sliding_window=4)
    path = tmp_path_factory.mktemp("gen_ckpt")
    ref.save_pretrained(path)
    cfg, variables = hf.load_pretrained(str(path))
    return ref, cfg, variables


def test_cached_logits_match_full_forward(hf_pair):
    _, cfg, variables = hf_pair
    b, s, prefix = 2, 10, 4
    ids = jnp.asarray(np.random.default_rng(0).integers(3, CASE.vocab, size=(b, s)), jnp.int32)
    full = ZayaForCausalLM(cfg).apply(variables, ids).logits
    cache = init_cache(cfg, b, s + 2)
    last, cache = prefill(cfg, variables, ids[:, :prefix], jnp.ones((b, prefix), jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, prefix - 1]), atol=1e-5, rtol=0)
    for t in range(prefix, s):
        pos = jnp.full((b,), t, jnp.int32)
        logits, cache = decode_step(cfg, variables, ids[:, t], pos, jnp.asarray(t, jnp.int32), cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, t]), atol=1e-5, rtol=0)


def hf_greedy(ref, prompts, n):
    s = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), s), np.int64)
    mask = np.zeros((len(prompts), s), np.int64)
    for i, p in enumerate(prompts):
        ids[i, s - len(p) :] = p
        mask[i, s - len(p) :] = 1
    with torch.no_grad():
        out = ref.generate(
            torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[:, s:].numpy().tolist()


def test_greedy_matches_transformers_single(hf_pair):
    ref, cfg, variables = hf_pair
    prompt = [5, 17, 42, 8, 33, 60, 11]
    got = generate(cfg, variables, [prompt], max_new_tokens=8)
    assert got == hf_greedy(ref, [prompt], 8)


def test_greedy_matches_transformers_left_padded_batch(hf_pair):
    ref, cfg, variables = hf_pair
    prompts = [[5, 17, 42, 8, 33, 60, 11], [9, 70, 3]]
    got = generate(cfg, variables, prompts, max_new_tokens=8)
    assert got == hf_greedy(ref, prompts, 8)
    # left padding does not change a prompt's continuation
    assert got[1] == generate(cfg, variables, [prompts[1]], max_new_tokens=8)[0]


def test_top_p_sampling_runs(hf_pair):
    _, cfg, variables = hf_pair
    a = generate(cfg, variables, [[5, 6, 7]], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)
    b = generate(cfg, variables, [[5, 6, 7]], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)
    assert a == b and len(a[0]) == 4 and all(0 <= t < CASE.vocab for t in a[0])


def test_top_p_keeps_the_smallest_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    tiny_p = {int(sample(logits, k, 1.0, 1e-6)[0]) for k in keys}
    assert tiny_p == {0}  # the top token always survives
    nucleus = {int(sample(logits, k, 1.0, 0.75)[0]) for k in keys}
    assert nucleus == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_cli_from_orbax_and_hf_checkpoints_agree(tmp_path, capsys):
    from support.eval_models import orbax_from_hf, save_byte_hf_model

    from zaya_jax.data.tokenizer import ByteTokenizer
    from zaya_jax.generate import main

    save_byte_hf_model(str(tmp_path / "hf"))
    ckpt = orbax_from_hf(str(tmp_path / "hf"), str(tmp_path / "run"))
    args = ["--prompt", "Call me", "--max-new-tokens", "6"]
    from_hf = main(["--checkpoint", str(tmp_path / "hf"), *args])
    from_orbax = main(["--checkpoint", ckpt, *args])
    assert from_hf == from_orbax and capsys.readouterr().out.count("Call me") == 2
    tok = ByteTokenizer()
    cfg, variables = hf.load_pretrained(str(tmp_path / "hf"))
    new = generate(cfg, variables, [[tok.eos_id, *tok.encode("Call me")]], 6, eos_id=tok.eos_id)[0]
    assert from_hf == ["Call me" + tok.decode(new)]

    # several prompts, batched two at a time: each as it is alone; --out has one row a prompt
    (tmp_path / "prompts.txt").write_text("It is a way\n\nShort.\n")
    out = tmp_path / "o" / "completions.jsonl"
    many = main(
        ["--checkpoint", str(tmp_path / "hf"), *args, "--prompts-file", str(tmp_path / "prompts.txt"),
         "--batch-size", "2", "--out", str(out)]
    )  # fmt: skip
    alone = [main(["--checkpoint", str(tmp_path / "hf"), "--prompt", p, "--max-new-tokens", "6"])[0]
             for p in ("It is a way", "Short.")]  # fmt: skip
    assert many == from_hf + alone
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Call me", "It is a way", "Short."]
    assert [r["prompt"] + r["completion"] for r in rows] == many
    assert all(1 <= len(r["tokens"]) <= 6 and r["eos"] == (r["tokens"][-1] == tok.eos_id) for r in rows)
    from zaya_jax.runtime import cli

    with pytest.raises(SystemExit):  # as `python -m zaya_jax.generate` runs main
        cli.run(main, ["--checkpoint", str(tmp_path / "hf")])
    assert "error: no prompt: pass --prompt" in capsys.readouterr().err


def test_left_pad_right_aligns_prompts():
    ids, mask = left_pad([[7, 8], [9]])
    assert ids.tolist() == [[7, 8], [0, 9]] and mask.tolist() == [[1, 1], [0, 1]]
    ids, mask = left_pad([[7, 8], [9]], width=4, pad_id=5)
    assert ids.tolist() == [[5, 5, 7, 8], [5, 5, 5, 9]] and mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert ids.dtype == mask.dtype == np.int32


def test_prompt_buckets_share_one_program_and_change_no_token(hf_pair):
    _, cfg, variables = hf_pair
    assert [prompt_bucket(n) for n in (1, 3, 16, 17, 100)] == [16, 16, 16, 32, 128]
    short, long = [5, 17, 42], [9, 70, 3, 8, 33, 60, 11, 12, 13]  # 3 and 9 tokens: one bucket (16)
    before = _generate_loop._cache_size()
    bucketed = [generate(cfg, variables, [p], max_new_tokens=5)[0] for p in (short, long)]
    assert _generate_loop._cache_size() == before + 1  # one compilation for both lengths
    exact = [generate(cfg, variables, [p], max_new_tokens=5, bucket=False)[0] for p in (short, long)]
    assert bucketed == exact


def test_eos_stops_each_row_on_its_own(hf_pair):
    _, cfg, variables = hf_pair
    prompts = [[5, 17, 42, 8], [9, 70, 3]]
    free = generate(cfg, variables, prompts, max_new_tokens=8)
    eos = free[0][2]
    got = generate(cfg, variables, prompts, max_new_tokens=8, eos_id=eos)
    assert len(got[0]) <= 3  # row 0 stops at its first eos
    for row_free, row in zip(free, got):
        assert row == (row_free[: row_free.index(eos) + 1] if eos in row_free else row_free)
    with pytest.raises(ValueError, match="at least one token"):
        generate(cfg, variables, [[1], []], max_new_tokens=2)


def test_a_stop_callback_ends_rows_and_changes_no_token(hf_pair):
    """Decoding in chunks between stop checks gives the one-program tokens, sampled ones whatever
    the chunk (the key is split once per token either way); a stopped row ends at the check that
    stopped it."""
    _, cfg, variables = hf_pair
    prompts = [[5, 17, 42, 8], [9, 70, 3]]
    free = generate(cfg, variables, prompts, max_new_tokens=20)
    never = lambda row, tokens: False
    assert generate(cfg, variables, prompts, 20, stop=never, stop_every=6) == free
    row0_at_7 = lambda row, tokens: row == 0 and len(tokens) >= 7  # checked after 3, 6, 9, ... tokens
    assert generate(cfg, variables, prompts, 20, stop=row0_at_7, stop_every=3) == [free[0][:9], free[1]]
    sampled = [generate(cfg, variables, prompts, 20, 0.9, seed=3, stop=never, stop_every=k) for k in (4, 20)]
    assert sampled[0] == sampled[1] != free


@pytest.mark.slow
def test_rows_over_a_mesh_give_the_one_device_tokens(hf_pair):
    from zaya_jax.evaluate import parse_mesh
    from zaya_jax.hf.pretrained import variable_shardings

    _, cfg, variables = hf_pair
    mesh = parse_mesh("data=2,fsdp=4")  # rows over 8 devices, the model's width over 4
    sharded = jax.device_put(variables, variable_shardings(variables, mesh))
    prompts = [[5 + i, 17, 42, 8][: 1 + i % 4] for i in range(8)]
    stop = lambda row, tokens: row % 2 == 1 and len(tokens) >= 4
    one_device = generate(cfg, variables, prompts, 10, stop=stop, stop_every=4)
    assert [len(t) for t in one_device] == [10, 4] * 4
    assert generate(cfg, sharded, prompts, 10, mesh=mesh, stop=stop, stop_every=4) == one_device
    with pytest.raises(ValueError, match="do not split over the mesh's 8 batch rows"):
        generate(cfg, sharded, prompts[:6], 10, mesh=mesh)
