"""The ZAYA1 model configuration: one frozen dataclass, validated on construction.

Field names follow `transformers.ZayaConfig` where a field exists there, so that `hf.py` can map the
two one-to-one; fields that only concern how we compute (dtypes, dispatch, rematerialisation) are
ours. The released sizes are `ZayaConfig.zaya1_base()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

LAYER_TYPES = ("hybrid", "hybrid_sliding")
MOE_IMPLS = ("auto", "tiled", "ragged_dot", "pallas", "dense")
ATTENTION_IMPLS = ("xla", "pallas", "blockwise", "auto")
REMAT_POLICIES = ("none", "full", "dots_saveable", "matmuls")
SCAN_LAYERS = ("auto", "scan", "unroll")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
DTYPES = ("float32", "bfloat16", "float16")
SKIP_EXPERT_OUTPUTS = ("zero", "weighted_input")


@dataclasses.dataclass(frozen=True)
class ZayaConfig:
    """Sizes and numerics of a ZAYA1 model. See docs/model.md §1-2."""

    vocab_size: int = 262272
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    cca_time0: int = 2
    cca_time1: int = 2
    num_experts: int = 16
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 2048
    router_hidden_size: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    # RoPE: one theta per layer type; the rotary part is the first `partial_rotary_factor` of each head.
    rope_theta: float = 5_000_000.0
    sliding_rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.5
    layer_types: tuple[str, ...] | None = None  # None = every block "hybrid" (full causal attention)
    sliding_window: int | None = None
    attention_bias: bool = False
    lm_head_bias: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    max_position_embeddings: int = 131072
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 106
    # How we compute (not part of the HF config).
    dtype: str = "float32"  # matmul compute dtype; softmax, norms, router and residual stream stay fp32
    param_dtype: str = "float32"
    # Kernels: "auto" = Pallas (Triton) on GPU, XLA elsewhere; "pallas" off GPU runs interpreted.
    # "GPU" / "CPU" are the devices the step is compiled for (the mesh's), not the process'.
    # moe_impl: "auto" = "tiled" (the plain-XLA tiled grouped matmul) on CPU and "pallas" (the Triton
    # grouped matmul) on GPU, where XLA expands ragged_dot into dense matmuls (docs/conventions.md,
    # "Experts on a GPU"), "ragged_dot" on TPU; "dense" runs every expert on every token: a test
    # reference only (zaya_jax/model/moe.py).
    moe_impl: str = "auto"
    # Expert parallelism: None = dropless; f = each device sends at most ceil(f * T / n) tokens to
    # each expert-axis peer, dropping (and counting) the rest (zaya_jax/parallel/expert.py).
    moe_capacity_factor: float | None = None
    # Dropless only: the main exchange sends ceil(f * T / n) slots to each peer; tokens past that
    # take a spill exchange, run only when some bucket overflowed (zaya_jax/parallel/expert.py).
    moe_exchange_capacity_factor: float = 1.5
    # "xla" | "pallas" (flash attention) | "blockwise" (plain-XLA flash, kernels/blockwise_attention.py)
    # | "auto" (kernels.attention_choice: Pallas on GPUs, else blockwise from 1024 keys on and the
    # dense XLA softmax, transformers' own, below: a long sequence never builds [S, S] scores)
    attention_impl: str = "auto"
    # Rematerialisation of the blocks: "none"; "full" keeps each block's input carry and recomputes
    # the rest in the backward; "dots_saveable" also keeps XLA's matmul outputs; "matmuls" also
    # keeps our kernels' (flash attention's output, the grouped expert matmuls'), so only
    # elementwise work is recomputed. All keep what the expert exchange received
    # (zaya_jax/parallel/expert.py), so the backward does not replay it.
    remat: str = "none"
    # How the blocks run: "scan" = one lax.scan over the [l, ...] parameter stacks (one compiled block
    # whatever the depth), "unroll" = the same scan fully unrolled (straight-line blocks: no stacked
    # loop buffers to zero-fill and copy: a faster CPU step for a longer compile, docs/performance.md),
    # "auto" = unroll on CPU up to 8 blocks, scan otherwise (zaya_jax/model/transformer.py; the CPU
    # configs tiny.py and mid.py set it). Parameters are [l, ...] either way.
    scan_layers: str = "scan"
    # What a token routed to the skip class gets: 0 in transformers' native ZAYA, p_skip * x in the
    # legacy ZAYA1-base code (set when importing a legacy checkpoint; not exportable to native HF).
    skip_expert_output: str = "zero"

    def __post_init__(self):
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "cca_time0",
            "cca_time1",
            "num_experts",
            "moe_intermediate_size",
            "router_hidden_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ZayaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ZayaConfig.num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ZayaConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if (self.num_key_value_heads * self.head_dim) % 2:
            raise ValueError(
                "ZayaConfig: num_key_value_heads * head_dim must be even (the value is half "
                "current-token, half previous-token projections)"
            )
        if self.num_experts_per_tok != 1:
            raise ValueError(
                f"ZayaConfig.num_experts_per_tok={self.num_experts_per_tok}: ZAYA1 routes "
                "each token to exactly one expert (top_k must be 1)"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"ZayaConfig.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]"
            )
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"ZayaConfig: rotary dim int(head_dim * partial_rotary_factor)={self.rotary_dim} "
                "must be a positive even number"
            )
        for name in ("rope_theta", "sliding_rope_theta", "rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ZayaConfig.{name} must be > 0, got {getattr(self, name)!r}")
        self._validate_layer_types()
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"ZayaConfig.moe_capacity_factor={self.moe_capacity_factor} must be > 0 or None")
        if not self.moe_exchange_capacity_factor > 0:
            raise ValueError(
                f"ZayaConfig.moe_exchange_capacity_factor={self.moe_exchange_capacity_factor} must be > 0"
            )
        self._validate_choices()

    def _validate_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"ZayaConfig.layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"ZayaConfig.layer_types: unknown {bad}; expected one of {LAYER_TYPES}")
        if "hybrid_sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(
                "ZayaConfig.sliding_window must be a positive int when layer_types contains 'hybrid_sliding'"
            )

    def _validate_choices(self) -> None:
        """Every enumerated field holds one of its allowed values."""
        for name, allowed in (
            ("hidden_act", HIDDEN_ACTS),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
            ("moe_impl", MOE_IMPLS),
            ("attention_impl", ATTENTION_IMPLS),
            ("remat", REMAT_POLICIES),
            ("scan_layers", SCAN_LAYERS),
            ("skip_expert_output", SKIP_EXPERT_OUTPUTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ZayaConfig.{name}={getattr(self, name)!r}; expected one of {allowed}")

    # ---------------------------------------------------------------- derived sizes
    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_channels(self) -> int:
        """Channels of the CCA convolution: all query heads, then all key heads."""
        return (self.num_attention_heads + self.num_key_value_heads) * self.head_dim

    @property
    def conv_state_len(self) -> int:
        """Left context the two causal convolutions need: (t0 - 1) + (t1 - 1)."""
        return (self.cca_time0 - 1) + (self.cca_time1 - 1)

    @property
    def num_router_classes(self) -> int:
        """Routed experts plus the "skip" class (index num_experts)."""
        return self.num_experts + 1

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or ("hybrid",) * self.num_hidden_layers

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> ZayaConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["layer_types"] is not None:
            d["layer_types"] = list(d["layer_types"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ZayaConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ZayaConfig: unknown fields {unknown}")
        return cls(**d)

    # ---------------------------------------------------------------- presets
    @classmethod
    def zaya1_base(cls, **overrides) -> ZayaConfig:
        """The released ZAYA1-base / ZAYA1-8B sizes (docs/model.md §1); RoPE theta of pretraining phase 1."""
        return cls(**{"rope_theta": 10_000.0, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> ZayaConfig:
        """A few-hundred-K-parameter model for CPU tests and the embedded-corpus demo."""
        base = dict(
            vocab_size=320,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            moe_intermediate_size=64,
            router_hidden_size=32,
            rope_theta=10_000.0,
            max_position_embeddings=4096,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        )
        base.update(overrides)
        return cls(**base)
