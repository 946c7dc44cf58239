"""Mid-size ZAYA1 (~80M total / ~9M active params: 6 blocks, d = 512, 16 experts of I = 512, ZAYA1's
d = I shape) on the embedded corpus with the byte tokenizer. The second size of
benchmarks/train_step.py (tiny is the first); trains on a CPU, slowly.

  python -m zaya_jax.train --config configs/mid.py --workdir workdirs/mid
  python -m benchmarks.train_step --config configs/mid.py
"""

from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig


def get_config():
    c = base_config()
    set_model(
        c,
        ZayaConfig.tiny(
            vocab_size=320,  # 259 byte-tokenizer ids, padded to a multiple of 64
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=16,
            moe_intermediate_size=512,
            router_hidden_size=64,
            rope_theta=10_000.0,
            max_position_embeddings=4096,
        ),
    )
    c.model.scan_layers = "auto"  # unrolled blocks on CPU, as configs/tiny.py
    c.train.steps = 2000
    c.train.batch_size = 8
    c.train.seq_len = 256
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 100
    c.optim.decay_fraction = 0.2
    c.balancing.lr = 1e-2  # as configs/tiny.py: a short run needs a faster bias controller
    c.checkpoint.every_steps = 500
    c.eval.every_steps = 500
    c.eval.batches = 4
    c.eval.batch_size = 8
    c.logging.every_steps = 20
    return c
