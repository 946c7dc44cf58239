"""Tiny ZAYA1 (~2.5M params) on the embedded corpus with the byte tokenizer: trains on 2 CPU cores
in a few minutes to well under 2.5 nats/byte held-out.

  python -m zaya_jax.train --config configs/tiny.py --workdir workdirs/tiny
"""

from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig


def get_config():
    c = base_config()
    set_model(
        c,
        ZayaConfig.tiny(
            vocab_size=320,  # 259 byte-tokenizer ids, padded to a multiple of 64
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            moe_intermediate_size=128,
            # ZAYA1's router width: a narrower router's per-token spread at initialisation (three
            # layers of gain 0.02 * sqrt(width)) is drowned by the bias controller's steps of about
            # balancing.lr, and one expert takes every token until the router learns (docs/model.md §2.2.6).
            router_hidden_size=256,
            rope_theta=10_000.0,
            max_position_embeddings=4096,
        ),
    )
    # Unrolled blocks on CPU (model.scan_layers): faster steps, a longer compile.
    c.model.scan_layers = "auto"
    c.train.steps = 300
    c.train.batch_size = 16
    c.train.seq_len = 128
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 50
    c.optim.decay_fraction = 0.3
    # A 300-step run needs a faster bias controller than ZAYA1's 1e-3 over ~10^5 steps: the router
    # learns at the model's lr and would otherwise collapse onto a few experts before the biases move.
    c.balancing.lr = 1e-2
    c.checkpoint.every_steps = 200
    c.eval.every_steps = 100
    c.eval.batches = 0
    c.eval.batch_size = 32
    c.logging.every_steps = 20
    return c
