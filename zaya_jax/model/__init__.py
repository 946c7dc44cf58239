"""The ZAYA1 model in Flax: `ZayaForCausalLM(cfg).apply(variables, input_ids, attention_mask)`."""

from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.router import BALANCING, init_balancing_biases
from zaya_jax.model.transformer import ZayaForCausalLM, ZayaOutput, init_variables

__all__ = [
    "BALANCING",
    "ZayaConfig",
    "ZayaForCausalLM",
    "ZayaOutput",
    "init_balancing_biases",
    "init_variables",
]
