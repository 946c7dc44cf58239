"""A ~1.1B-total / ~0.2B-active ZAYA1 for architecture ablations (same recipe, 1/2 width, 16 blocks)."""

from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig


def get_config():
    c = base_config()
    set_model(
        c,
        ZayaConfig.zaya1_base(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=16,
            moe_intermediate_size=1024,
            router_hidden_size=256,
            rope_theta=10_000.0,
            dtype="bfloat16",
            remat="full",
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
    )
    c.train.seq_len = 4096
    c.train.batch_size = 256
    c.train.steps = 20_000
    c.optim.lr = 2e-3
    c.optim.warmup_steps = 1000
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 1000
    c.eval.batches = 50
    c.eval.batch_size = 64
    return c
