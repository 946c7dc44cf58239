"""ZayaConfig validation (zaya_jax/model/config.py): bad values give a ValueError naming the field."""

import pytest

from zaya_jax.model import ZayaConfig


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "divisible by num_key_value_heads"),
        (dict(head_dim=15), "head_dim=15 must be even"),
        (dict(num_experts_per_tok=2), "top_k must be 1"),
        (dict(hidden_size=0), "hidden_size must be a positive int"),
        (dict(dtype="float8"), "dtype='float8'"),
        (dict(moe_impl="loop"), "moe_impl='loop'"),
        (dict(layer_types=("hybrid",)), "layer_types has 1 entries"),
        (dict(layer_types=("hybrid_sliding", "hybrid")), "sliding_window must be a positive int"),
        (dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
        (dict(rope_theta=-1.0), "rope_theta must be > 0"),
    ],
)
def test_bad_values_raise_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        ZayaConfig.tiny(**changes)


def test_released_sizes_and_round_trip():
    cfg = ZayaConfig.zaya1_base()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.vocab_size) == (2048, 40, 16, 262272)
    assert cfg.rotary_dim == 64 and cfg.conv_state_len == 2 and cfg.num_router_classes == 17
    assert ZayaConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        ZayaConfig.from_dict({**cfg.to_dict(), "hiden_size": 3})
