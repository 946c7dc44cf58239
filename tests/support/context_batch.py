"""The context-parallel tests' model and a batch that tries the masks: padding, packed documents."""

import numpy as np

from zaya_jax.model import ZayaConfig

# Block 1 has a sliding window (8) shorter than a context rank's chunk: its mask is on global positions.
CFG = ZayaConfig.tiny(
    hidden_size=64,
    num_hidden_layers=2,
    num_experts=8,
    moe_intermediate_size=32,
    vocab_size=128,
    layer_types=("hybrid", "hybrid_sliding"),
    sliding_window=8,
)
B, S = 8, 32


def padded_batch():
    """Left- and right-padded rows and packed documents (segment ids), next-token targets."""
    r = np.random.default_rng(3)
    ids = r.integers(3, CFG.vocab_size, size=(B, S + 1)).astype(np.int32)
    mask = np.ones((B, S), np.int32)
    mask[1, :11] = 0  # padding that crosses the first context boundary (S/4 = 8)
    mask[3, 13:] = 0
    segments = np.zeros((B, S), np.int32)
    segments[2, 9:] = 1
    segments[5, 16:] = 1  # a document starting exactly at a rank boundary
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "attention_mask": mask, "segment_ids": segments}
