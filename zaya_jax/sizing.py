"""Sizing of a ZAYA1 run: parameter counts, FLOPs per token, memory per device, and the GEMM sizing
rules of the MI300X (SPEC §4). Also the MFU formula the trainer reports.

    python -m zaya_jax.sizing --config configs/zaya1_base.py[:phase] [--config.key=value ...]
        [--mesh data=8,fsdp=1,expert=1] [--num-devices 8] [--remat full|dots_saveable|none]
        [--micro-batch B] [--device-memory-gib 192] [--zero1=true] [--json PATH]

FLOPs count multiply-adds as 2. A training step is 3x the forward (backward = 2x forward); the
causal attention core sees on average S/2 keys per query (a sliding-window layer min(S, w) with the
window's ramp-up). Rematerialisation's recomputation is not counted (MFU measures useful work, as in
the PaLM paper's definition).

Memory per device (`memory_per_device`) follows the layout of zaya_jax/parallel/sharding.py:
  params, grads   param_dtype; the big matrices are split over `fsdp` on their model width, the
                  expert tensors over `expert`; small vectors are replicated.
  optimizer       Muon: one momentum buffer (optim.muon.mu_dtype, fp32) per Muon-routed matrix;
                  AdamW: two moments (fp32) for everything else (routing of zaya_jax.optim.chain).
                  Each leaf is laid out like its parameter and, with ZeRO-1, additionally split over
                  `data` along its largest free dimension that divides evenly.
  activations     a documented per-token estimate of what the backward pass keeps for one
                  microbatch (`activation_bytes`), for remat none / dots_saveable / full.

The sizing rules (`sizing_warnings`): matrix widths multiples of 64 (ideally 256), head_dim 128,
vocabulary a multiple of 64 (ideally 256), experts divisible by the expert axis, and expert GEMMs
with enough work: the paper measured that an MI300X GEMM needs ~200 GFLOP to reach peak throughput,
so a per-expert GEMM far below that (few tokens per expert per device) runs far from peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

import jax

from zaya_jax.model.config import ZayaConfig
from zaya_jax.parallel.context import config_context

# Dense bf16 peak per device, FLOP/s (vendor numbers, no sparsity).
PEAK_BF16_FLOPS = {
    "MI300X": 1307e12,
    "MI325X": 1307e12,
    "MI250X": 383e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}
# Dense fp32 matrix peak per device, FLOP/s. AMD: FP32 matrix cores. NVIDIA: TF32 tensor cores,
# which XLA uses for float32 dots at the default matmul precision.
PEAK_FP32_FLOPS = {
    "MI300X": 163.4e12,
    "MI325X": 163.4e12,
    "MI250X": 95.7e12,
    "H200": 494.7e12,
    "H100": 494.7e12,
    "A100": 156e12,
}
# SPEC §4: an MI300X GEMM needs roughly this much work to reach peak throughput.
GEMM_PEAK_WORK_FLOPS = 200e9
# A GEMM below this fraction of GEMM_PEAK_WORK_FLOPS is "far below" the rule and gets a warning.
GEMM_FAR_BELOW_FRACTION = 0.25
MI300X_MEMORY_GIB = 192.0
GIB = 2.0**30

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------- parameters
@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the (tied) embedding table
    active: int  # per token, without embedding: one routed expert per block

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def param_counts(cfg: ZayaConfig) -> ParamCounts:
    d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e, i, r = cfg.num_experts, cfg.moe_intermediate_size, cfg.router_hidden_size
    c = cfg.conv_channels
    attn = d * nq * hd + d * nkv * hd + d * nkv * hd + nq * hd * d + nkv  # q, k, v (two halves), o, temp
    attn += c * cfg.cca_time0 + c + c * hd * cfg.cca_time1 + c  # convs with biases
    if cfg.attention_bias:
        attn += nq * hd + nkv * hd + nkv * hd + d
    router = d * r + r + r + r + 2 * (r * r + r) + r * (e + 1)  # down(+b), EDA scale, norm, fc1/2, out
    expert = 3 * d * i
    norms_scales = 2 * d + 2 * 4 * d
    per_block_shared = attn + router + norms_scales
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    top = (
        embedding + head + 3 * d + (cfg.vocab_size if cfg.lm_head_bias else 0)
    )  # + final norm, input scale/bias
    n = cfg.num_hidden_layers
    total = top + n * (per_block_shared + e * expert)
    # Block 0 has no EDA scale in the released model; we keep one (it multiplies zeros).
    total -= r
    active = n * (per_block_shared + expert) - r
    return ParamCounts(total=total, embedding=embedding, active=active)


# ------------------------------------------------------------------------------------------ FLOPs
@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token, by part. Training = 3x forward (`training_total`)."""

    dense: float  # attention projections, CCA convs, router, norms/scales: 2 x non-expert active params
    attention_core: float  # QK^T and PV over the causal keys
    moe_active: float  # the one routed expert of every block (SwiGLU: gate, up, down)
    head: float  # the output projection onto the vocabulary

    @property
    def forward_total(self) -> float:
        return self.dense + self.attention_core + self.moe_active + self.head

    @property
    def training_total(self) -> float:
        return 3.0 * self.forward_total

    def as_dict(self, training: bool = False) -> dict[str, float]:
        k = 3.0 if training else 1.0
        return {
            "dense": k * self.dense,
            "attention_core": k * self.attention_core,
            "moe_active": k * self.moe_active,
            "head": k * self.head,
            "total": k * self.forward_total,
        }


def mean_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Average keys a causal query attends to: S/2 (the usual convention), or for a sliding window w
    < S the exact mean of min(i, w) over positions i = 1..S."""
    if not window or window >= seq_len:
        return seq_len / 2
    w, s = window, seq_len
    return (w * (w + 1) / 2 + (s - w) * w) / s


def flops_breakdown(cfg: ZayaConfig, seq_len: int) -> FlopsBreakdown:
    """Forward model FLOPs per token at sequence length `seq_len`, split by part."""
    nq, hd = cfg.num_attention_heads, cfg.head_dim
    n = cfg.num_hidden_layers
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe = 2.0 * n * expert * cfg.num_experts_per_tok
    dense = 2.0 * (param_counts(cfg).active - n * expert)
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    keys = sum(
        mean_keys_per_query(seq_len, cfg.sliding_window if t == "hybrid_sliding" else None)
        for t in cfg.resolved_layer_types
    )
    attention_core = 2 * 2 * nq * hd * keys  # QK^T and PV, per layer summed over the layers
    return FlopsBreakdown(dense=dense, attention_core=attention_core, moe_active=moe, head=head)


def flops_per_token(cfg: ZayaConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: matmuls of one routed expert per block, attention core, the head."""
    b = flops_breakdown(cfg, seq_len)
    return b.training_total if training else b.forward_total


def _peak_from_table(table: Mapping[str, float], device: jax.Device | None) -> float | None:
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "").upper().replace(" ", "")
    for name, peak in table.items():
        if name in kind:
            return peak
    return None


def peak_flops_per_device(device: jax.Device | None = None, dtype: str = "bfloat16") -> float | None:
    """Vendor dense peak of `device` (default: the first device) for `dtype` matmuls (float32: the
    fp32 table; bfloat16 / float16: the bf16 table), None when unknown (e.g. CPU)."""
    import jax.numpy as jnp

    table = PEAK_FP32_FLOPS if jnp.dtype(dtype).name == "float32" else PEAK_BF16_FLOPS
    return _peak_from_table(table, device)


def mfu(
    tokens_per_second: float, cfg: ZayaConfig, seq_len: int, num_devices: int, peak_per_device: float | None
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak. None if peak unknown."""
    if not peak_per_device:
        return None
    return tokens_per_second * flops_per_token(cfg, seq_len) / (num_devices * peak_per_device)


# ------------------------------------------------------------------------------------------- mesh
MESH_AXES = ("data", "fsdp", "expert", "context")


def parse_mesh(
    spec: str | Mapping[str, int] | None,
    num_devices: int | None = None,
    default: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """`"data=8,fsdp=1,expert=1"` (missing axes from `default`, else 1; one axis may be -1 = the
    devices the others leave, which needs `num_devices`) -> {"data": .., "fsdp": .., "expert": ..}."""
    mesh = {a: 1 for a in MESH_AXES}
    mesh.update({k: int(v) for k, v in (default or {}).items() if k in MESH_AXES})
    if isinstance(spec, str) and spec.strip():
        for part in spec.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in MESH_AXES:
                raise ValueError(f"--mesh {spec!r}: expected axis=size with axes {MESH_AXES}, got {part!r}")
            mesh[key] = int(value)
    elif isinstance(spec, Mapping):
        mesh.update({k: int(v) for k, v in spec.items()})
    free = [a for a in MESH_AXES if mesh[a] == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    if any(mesh[a] < 1 and mesh[a] != -1 for a in MESH_AXES):
        raise ValueError(f"mesh: sizes must be positive ints or -1, got {mesh}")
    if free:
        if not num_devices:
            raise ValueError("mesh: an axis is -1 but the number of devices is unknown")
        known = math.prod(mesh[a] for a in MESH_AXES if mesh[a] != -1)
        if num_devices % known:
            raise ValueError(f"mesh: {num_devices} devices are not divisible by the fixed axes {mesh}")
        mesh[free[0]] = num_devices // known
    return mesh


# ----------------------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device. `activations` is for the selected remat policy; the `activations_by_remat`
    dict has all three. `total` = params + grads + optimizer + activations."""

    mesh: dict[str, int]
    remat: str
    micro_batch: int  # sequences per device per microbatch
    seq_len: int
    params: float
    grads: float
    optimizer_muon: float  # Muon momentum buffers
    optimizer_adamw: float  # AdamW first and second moments
    activations: float
    activations_by_remat: dict[str, float]
    muon_params: int  # parameter counts (global) by optimizer
    adamw_params: int

    @property
    def optimizer(self) -> float:
        return self.optimizer_muon + self.optimizer_adamw

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(optimizer=self.optimizer, total=self.total)
        return d


def param_mesh_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Mesh axis (or None) of every dimension of the parameter at `path`, from the trainer's own
    sharding table (zaya_jax.parallel.sharding), so the estimate follows any change to the layout."""
    from zaya_jax.parallel import sharding  # the parallel package imports the model; keep sizing light

    return tuple(sharding.RULES.get(a) if a else None for a in sharding.logical_axes(path, ndim))


def _shard_elements(
    shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mapping[str, int], zero1: bool
) -> float:
    """Elements of one leaf on one device: sharded dims divided by their axis (ceil: padding); with
    ZeRO-1 the largest free dim divisible by `data` is also split over `data` (sharding.zero1_spec)."""
    dims = list(axes) + [None] * (len(shape) - len(axes))
    if zero1 and mesh["data"] > 1 and "data" not in dims:
        free = [i for i in range(len(shape)) if dims[i] is None and shape[i] % mesh["data"] == 0]
        if free:
            dims[max(free, key=lambda i: shape[i])] = "data"
    n = 1
    for size, axis in zip(shape, dims):
        n *= -(-size // mesh[axis]) if axis else size
    return float(n)


def param_leaves(cfg: ZayaConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """[(path, shape, optimizer label "muon"|"adamw"), ...] of the model's params (no allocation)."""
    from zaya_jax.model import init_variables
    from zaya_jax.optim.chain import describe_routing

    shapes = jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0)))["params"]
    return describe_routing(shapes)


def state_bytes_per_device(
    leaves: list[tuple[str, tuple[int, ...], str]],
    mesh: Mapping[str, int],
    *,
    param_bytes: int = 4,
    grad_bytes: int | None = None,
    muon_mu_bytes: int = 4,
    adam_moment_bytes: int = 4,
    zero1: bool = True,
) -> dict[str, float]:
    """Params / grads / optimizer-state bytes on one device for the leaves [(path, shape, label)].

    Muon leaves keep 1 momentum buffer, AdamW leaves 2 moments; scalar optimizer counters are ignored.
    """
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    out = {
        "params": 0.0,
        "grads": 0.0,
        "optimizer_muon": 0.0,
        "optimizer_adamw": 0.0,
        "muon_params": 0,
        "adamw_params": 0,
    }
    for path, shape, label in leaves:
        shape = tuple(int(s) for s in shape)
        axes = param_mesh_axes(path, len(shape))
        local = _shard_elements(shape, axes, mesh, zero1=False)
        local_opt = _shard_elements(shape, axes, mesh, zero1=zero1)
        out["params"] += local * param_bytes
        out["grads"] += local * grad_bytes
        if label == "muon":
            out["optimizer_muon"] += local_opt * muon_mu_bytes
            out["muon_params"] += math.prod(shape)
        else:
            out["optimizer_adamw"] += local_opt * 2 * adam_moment_bytes
            out["adamw_params"] += math.prod(shape)
    return out


REMAT_CHOICES = ("none", "dots_saveable", "full")


def activation_terms(cfg: ZayaConfig, seq_len: int) -> dict[str, float]:
    """Bytes per token that one block keeps for the backward pass without rematerialisation.

    Counted from the residuals `jax.ad_checkpoint.print_saved_residuals` lists for a ZayaBlock
    (compute dtype b bytes, fp32 f = 4 bytes; C = (Nq+Nkv)*hd conv channels, S keys):
      d_wide            14 fp32 [d]: residual stream, the (x+bias)*scale pairs, norm inputs/outputs,
                        expert outputs (unsorted, weighted); 3 compute-dtype [d]: normed inputs, o_proj
      cca_conv_proj     compute dtype: 4 x [C] (concat(q0,k0), conv input/outputs), mean-skip [Nq*hd],
                        k and v [Nkv*hd] each
      qk_norm_rope      fp32 q, k and tempered k, RoPE cos/sin, per-head norms
      attention_scores  the XLA path materialises [Nq, S] scores per token: fp32 logits, fp32 softmax,
                        probs in the compute dtype and the broadcast bool mask (2f + b + 1 per score)
      router            fp32: 13 x [R] (down, EDA sum, norm, fc1/fc2 and their GELUs) + logits [E+1]
      experts           fp32 5 x [I] (gate, up, silu and its inputs), product [I] in the compute dtype
    XLA's own working buffers of the backward pass come on top (on XLA:CPU the compiled temp size of a
    remat-free backward was ~1.4x this estimate).
    """
    d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    i, r, e = cfg.moe_intermediate_size, cfg.router_hidden_size, cfg.num_router_classes
    b, f = _DTYPE_BYTES[cfg.dtype], 4
    c = cfg.conv_channels
    return {
        "d_wide": (14 * f + 3 * b) * d,
        "cca_conv_proj": b * (4 * c + nq * hd + 2 * nkv * hd),
        "qk_norm_rope": f * (nq + 2 * nkv) * hd + f * 2 * cfg.rotary_dim + f * 4 * (nq + nkv),
        "attention_scores": nq * seq_len * (2 * f + b + 1),
        "router": f * (13 * r + e),
        "experts": f * 5 * i + b * i,
    }


def _dots_saved_per_token(cfg: ZayaConfig, seq_len: int) -> float:
    """Bytes per token per block that `dots_saveable` keeps besides the carry (print_saved_residuals):
    q0, k0, v halves and o_proj outputs (compute dtype), the grouped-conv einsums (fp32, one per tap),
    the fp32 attention logits [Nq, S] and PV output, the router matmuls (fp32), one fp32 [d]. The
    experts' ragged_dot outputs are not saved by the policy."""
    d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r, e = cfg.router_hidden_size, cfg.num_router_classes
    b, f = _DTYPE_BYTES[cfg.dtype], 4
    return (
        b * ((nq + 2 * nkv) * hd + d)
        + f * d
        + f * cfg.cca_time1 * cfg.conv_channels
        + f * nq * seq_len
        + f * nq * hd
        + f * (3 * r + e)
    )


def activation_bytes(
    cfg: ZayaConfig,
    *,
    seq_len: int,
    micro_batch: int,
    remat: str,
    loss_chunk: int = 512,
    expert_axis: int = 1,
    context: int = 1,
) -> float:
    """Estimated activation bytes per device for one microbatch of `micro_batch` sequences (with
    mesh.context = R > 1: S/R positions of each, and the block's keys and values all-gathered to S).

      none           L x (the `activation_terms` of a block) per token
      dots_saveable  L x (block carry + matmul outputs) per token, + one block's full activations
                     while it is recomputed in the backward pass
      full           L x block carry (h fp32 [d] + router state fp32 [R]) per token, + one block's
                     full activations while it is recomputed
    plus, when the compute dtype differs from param_dtype, the compute-dtype copies of the block
    weights (every block's for `none`, one block's otherwise; experts divided by `expert_axis`), and
    outside the blocks: the embedding output and final norm (fp32 [d] each, per token) and one loss
    chunk's logits (`micro_batch` x `loss_chunk` rows x V, fp32 logits, softmax and gradient).
    The per-token parts were checked against `print_saved_residuals` (within ~10%, above).
    """
    if remat not in REMAT_CHOICES:
        raise ValueError(f"remat={remat!r}; expected one of {REMAT_CHOICES}")
    tokens = micro_batch * seq_len // context
    n = cfg.num_hidden_layers
    block = sum(activation_terms(cfg, seq_len).values())  # attention still reads all S keys
    carry = 4 * (cfg.hidden_size + cfg.router_hidden_size)
    if remat == "none":
        per_token = n * block
    elif remat == "dots_saveable":
        per_token = n * (carry + _dots_saved_per_token(cfg, seq_len)) + block
    else:
        per_token = n * carry + block
    casts = 0.0
    if cfg.dtype != cfg.param_dtype:
        pc = param_counts(cfg)
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        per_layer = (pc.active / n - expert) + expert * cfg.num_experts / expert_axis
        casts = (n if remat == "none" else 1) * per_layer * _DTYPE_BYTES[cfg.dtype]
    outside = tokens * 3 * 4 * cfg.hidden_size
    loss = micro_batch * min(loss_chunk, seq_len // context) * cfg.vocab_size * 3 * 4
    # The gathered K/V: every block's kept without remat, the recomputed block's otherwise.
    gathered = (
        (n if remat == "none" else 1) * kv_all_gather_bytes(cfg, seq_len, micro_batch, 1)
        if context > 1
        else 0
    )
    return tokens * per_token + casts + outside + loss + gathered


def kv_all_gather_bytes(cfg: ZayaConfig, seq_len: int, micro_batch: int, context: int) -> float:
    """Bytes one device receives per block in the forward K/V all-gather over `context` ranks
    (k and v of the other ranks' positions, compute dtype); the backward's reduce-scatter of their
    gradients moves the same. With context = 1: the whole gathered K/V of `micro_batch` sequences."""
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * _DTYPE_BYTES[cfg.dtype]
    return micro_batch * seq_len * kv * ((context - 1) / context if context > 1 else 1)


def memory_per_device(
    cfg: ZayaConfig,
    *,
    seq_len: int,
    micro_batch: int,
    mesh: Mapping[str, int] | str | None = None,
    remat: str | None = None,
    zero1: bool = True,
    muon_mu_bytes: int = 4,
    adam_moment_bytes: int = 4,
    leaves: list[tuple[str, tuple[int, ...], str]] | None = None,
) -> MemoryEstimate:
    """Memory of one device training `cfg` on `mesh` with `micro_batch` sequences of `seq_len` tokens
    per device per microbatch (see the module docstring for the layout). `leaves` defaults to
    `param_leaves(cfg)`."""
    mesh = parse_mesh(mesh) if not isinstance(mesh, dict) else parse_mesh(None, default=mesh)
    remat = remat or cfg.remat
    leaves = param_leaves(cfg) if leaves is None else leaves
    state = state_bytes_per_device(
        leaves,
        mesh,
        param_bytes=_DTYPE_BYTES[cfg.param_dtype],
        muon_mu_bytes=muon_mu_bytes,
        adam_moment_bytes=adam_moment_bytes,
        zero1=zero1,
    )
    by_remat = {
        r: activation_bytes(
            cfg,
            seq_len=seq_len,
            micro_batch=micro_batch,
            remat=r,
            expert_axis=mesh["expert"],
            context=mesh["context"],
        )
        for r in REMAT_CHOICES
    }
    return MemoryEstimate(
        mesh=dict(mesh),
        remat=remat,
        micro_batch=micro_batch,
        seq_len=seq_len,
        params=state["params"],
        grads=state["grads"],
        optimizer_muon=state["optimizer_muon"],
        optimizer_adamw=state["optimizer_adamw"],
        activations=by_remat[remat],
        activations_by_remat=by_remat,
        muon_params=int(state["muon_params"]),
        adamw_params=int(state["adamw_params"]),
    )


def config_micro_batch(c: Any, devices: int) -> int:
    """Sequences per device per microbatch of training config `c` on `devices` devices (with
    mesh.context = R: per group of R devices, each holding S/R positions of them)."""
    return max(1, c.train.batch_size // c.train.grad_accum // (devices // config_context(c.mesh, devices)))


def config_memory_per_device(c: Any, cfg: ZayaConfig, mesh: Mapping[str, int]) -> MemoryEstimate:
    """`memory_per_device` of training config `c` (model `cfg`) on `mesh`: its micro-batch, remat,
    ZeRO-1 and Muon momentum dtype, as `python -m zaya_jax.sizing` reports them."""
    return memory_per_device(
        cfg,
        seq_len=c.train.seq_len,
        micro_batch=config_micro_batch(c, math.prod(mesh.values())),
        mesh=dict(mesh),
        remat=cfg.remat,
        zero1=c.mesh.zero1,
        muon_mu_bytes=_DTYPE_BYTES.get(c.optim.muon.mu_dtype, 4),
    )


# ------------------------------------------------------------------------------------ sizing rules
def gemm_shapes(
    cfg: ZayaConfig, tokens: int, expert_axis: int = 1, head_tokens: int | None = None
) -> list[tuple[str, int, int, int]]:
    """The forward GEMMs of one block and the head as (name, M, N, K) for `tokens` tokens per device.

    Experts see tokens * expert_axis / E rows each (top-1, uniform routing; the all-to-all brings the
    expert group's tokens to the device that holds the expert). The head sees `head_tokens` rows per
    call (the loss chunk; default all tokens)."""
    d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    i, r = cfg.moe_intermediate_size, cfg.router_hidden_size
    tpe = max(1, round(tokens * expert_axis / cfg.num_experts))
    return [
        ("q_proj", tokens, nq * hd, d),
        ("k_proj", tokens, nkv * hd, d),
        ("v_proj (each half)", tokens, nkv * hd // 2, d),
        ("o_proj", tokens, d, nq * hd),
        ("router down", tokens, r, d),
        ("router fc1/fc2", tokens, r, r),
        ("router out", tokens, cfg.num_router_classes, r),
        ("expert gate_up", tpe, 2 * i, d),
        ("expert down", tpe, d, i),
        ("lm head", head_tokens or tokens, cfg.vocab_size, d),
    ]


def sizing_warnings(
    cfg: ZayaConfig,
    *,
    tokens_per_device: int | None = None,
    mesh: Mapping[str, int] | None = None,
    gemm_peak_work: float = GEMM_PEAK_WORK_FLOPS,
    far_below: float = GEMM_FAR_BELOW_FRACTION,
) -> list[str]:
    """Human-readable warnings for dimensions that break the GEMM sizing rules (SPEC §4).

    "WARNING" lines break a rule (width not a multiple of 64, head_dim != 128, experts not divisible by
    the expert axis, expert GEMMs far below the ~200 GFLOP needed for peak); "note" lines are softer
    (a multiple of 64 but not of 256)."""
    mesh = dict(mesh or {"data": 1, "fsdp": 1, "expert": 1})
    out = []
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    widths = [
        ("hidden_size", cfg.hidden_size),
        ("query width num_attention_heads*head_dim", nq * hd),
        ("key width num_key_value_heads*head_dim", nkv * hd),
        ("value half-width num_key_value_heads*head_dim/2", nkv * hd // 2),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("router_hidden_size", cfg.router_hidden_size),
        ("vocab_size", cfg.vocab_size),
    ]
    for name, value in widths:
        if value % 64:
            out.append(
                f"WARNING {name}={value} is not a multiple of 64: GEMM tiles run partly empty "
                f"(pad to {-(-value // 64) * 64}, ideally {-(-value // 256) * 256})"
            )
        elif value % 256:
            out.append(f"note    {name}={value} is a multiple of 64 but not of 256 (ideal for MI300X GEMMs)")
    if hd != 128:
        out.append(f"WARNING head_dim={hd}: attention kernels are tuned for head_dim 128")
    e_ax = mesh.get("expert", 1)
    if cfg.num_experts % e_ax:
        out.append(f"WARNING num_experts={cfg.num_experts} is not divisible by the expert axis {e_ax}")
    if tokens_per_device:
        tpe = tokens_per_device * e_ax / cfg.num_experts
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        gate_up = 2 * tpe * d * 2 * i
        if gate_up < far_below * gemm_peak_work:
            need = gemm_peak_work / (2 * d * 2 * i)
            out.append(
                f"WARNING expert GEMMs are small: {tpe:,.0f} tokens per expert per device "
                f"({tokens_per_device:,} tokens x expert axis {e_ax} / {cfg.num_experts} experts) give "
                f"{gate_up / 1e9:.1f} GFLOP per expert gate_up GEMM, {gate_up / gemm_peak_work:.0%} of the "
                f"~{gemm_peak_work / 1e9:.0f} GFLOP an MI300X GEMM needs for peak (~{need:,.0f} tokens per "
                f"expert); raise the micro-batch or the expert axis"
            )
    return out


# --------------------------------------------------------------------------------------------- CLI
def _fmt_count(n: float) -> str:
    return f"{n / 1e9:.3f}B"


def _fmt_flops(x: float) -> str:
    return f"{x / 1e9:10.3f} GFLOP"


def _gib(x: float) -> str:
    return f"{x / GIB:10.2f}"


def report(
    cfg: ZayaConfig,
    *,
    seq_len: int,
    micro_batch: int,
    mesh: Mapping[str, int],
    remat: str,
    zero1: bool = True,
    device_memory_gib: float = MI300X_MEMORY_GIB,
    header: str = "",
    muon_mu_bytes: int = 4,
) -> tuple[str, dict[str, Any]]:
    """The sizing printout and the same numbers as a JSON-able dict."""
    pc = param_counts(cfg)
    fb = flops_breakdown(cfg, seq_len)
    mem = memory_per_device(
        cfg,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mesh=mesh,
        remat=remat,
        zero1=zero1,
        muon_mu_bytes=muon_mu_bytes,
    )
    devices = math.prod(mesh.values())
    tokens = micro_batch * seq_len // mesh["context"]
    warnings = sizing_warnings(cfg, tokens_per_device=tokens, mesh=mesh)
    if mem.total > device_memory_gib * GIB:
        warnings.append(
            f"WARNING estimated {mem.total / GIB:.1f} GiB per device exceeds the device's "
            f"{device_memory_gib:g} GiB: lower the micro-batch (raise train.grad_accum), "
            f"rematerialise, or shard more (fsdp / ZeRO-1 / expert)"
        )
    lines = []
    if header:
        lines.append(header)
    lines.append(
        f"mesh {' '.join(f'{a}={mesh[a]}' for a in MESH_AXES)} ({devices} devices), "
        f"micro-batch {micro_batch} sequences x {seq_len} tokens"
        + (f" / {mesh['context']} context ranks" if mesh["context"] > 1 else "")
        + f" = {tokens:,} tokens/device, "
        f"remat {remat}, ZeRO-1 {'on' if zero1 else 'off'}"
    )
    lines += [
        "",
        "Parameters",
        f"  total            {_fmt_count(pc.total):>9}  ({pc.total:,})",
        f"  embedding        {_fmt_count(pc.embedding):>9}  ({pc.embedding:,})",
        f"  non-embedding    {_fmt_count(pc.non_embedding):>9}  ({pc.non_embedding:,})",
        f"  active           {_fmt_count(pc.active):>9}  ({pc.active:,}; non-embedding, one routed "
        f"expert per block)",
        "",
        f"FLOPs per token (seq_len {seq_len})          forward          training (3x)",
    ]
    names = {
        "dense": "dense (attn proj, conv, router)",
        "attention_core": "attention core (QK^T, PV)",
        "moe_active": "MoE (one active expert)",
        "head": "head (lm head)",
        "total": "total",
    }
    fwd, trn = fb.as_dict(False), fb.as_dict(True)
    for key, name in names.items():
        lines.append(f"  {name:<34}{_fmt_flops(fwd[key])}  {_fmt_flops(trn[key])}")
    lines.append(
        f"  (6 x (active + head params) = {6 * (pc.active + cfg.vocab_size * cfg.hidden_size) / 1e9:.3f} "
        f"GFLOP: the attention core is the rest)"
    )
    lines += [
        "",
        f"Memory per device (GiB; {devices} devices)",
        f"  {'params (' + cfg.param_dtype + ')':<30}{_gib(mem.params)}",
        f"  {'grads (' + cfg.param_dtype + ')':<30}{_gib(mem.grads)}",
        f"  {'optimizer: Muon momentum':<30}{_gib(mem.optimizer_muon)}   ({mem.muon_params / 1e9:.3f}B params)",
        f"  {'optimizer: AdamW m, v':<30}{_gib(mem.optimizer_adamw)}   ({mem.adamw_params / 1e9:.3f}B params)",
        f"  {'activations (remat ' + remat + ')':<30}{_gib(mem.activations)}",
        f"  {'total':<30}{_gib(mem.total)}   (device: {device_memory_gib:g} GiB)",
        "  activations by remat policy: "
        + ", ".join(f"{r} {v / GIB:.2f}" for r, v in mem.activations_by_remat.items()),
    ]
    lines += [
        "",
        f"GEMMs per call at {tokens:,} tokens/device (forward; rule: ~{GEMM_PEAK_WORK_FLOPS / 1e9:.0f} "
        "GFLOP for peak on MI300X)",
        f"  {'gemm':<20}{'M':>10}{'N':>8}{'K':>7}{'GFLOP':>10}",
    ]
    gemms = gemm_shapes(cfg, tokens, mesh.get("expert", 1), head_tokens=micro_batch * min(512, seq_len))
    for name, m, n, k in gemms:
        lines.append(f"  {name:<20}{m:>10,}{n:>8,}{k:>7,}{2 * m * n * k / 1e9:>10.1f}")
    lines += ["", "Sizing rules" + (":" if warnings else ": all dimensions follow them")]
    lines += [f"  {w}" for w in warnings]
    data = {
        "params": {
            "total": pc.total,
            "embedding": pc.embedding,
            "non_embedding": pc.non_embedding,
            "active": pc.active,
        },
        "flops_per_token": {"seq_len": seq_len, "forward": fwd, "training": trn},
        "memory_per_device_bytes": mem.as_dict(),
        "gemms": [
            {"name": g[0], "m": g[1], "n": g[2], "k": g[3], "flops": 2 * g[1] * g[2] * g[3]} for g in gemms
        ],
        "warnings": warnings,
    }
    return "\n".join(lines), data


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Training config file (configs/<name>.py[:arg]).", lock_config=True
    )
    flags.DEFINE_string("mesh", None, "data=N,fsdp=N,expert=N (default: the config's mesh section).")
    flags.DEFINE_integer("num_devices", 8, "Devices that a -1 mesh axis fills (default one node of 8).")
    flags.DEFINE_enum("remat", None, list(REMAT_CHOICES), "Remat policy (default: config.model.remat).")
    flags.DEFINE_integer(
        "micro_batch",
        None,
        "Sequences per device per microbatch (default: train.batch_size / train.grad_accum / devices).",
    )
    flags.DEFINE_float("device_memory_gib", MI300X_MEMORY_GIB, "Device memory for the fits-check.")
    flags.DEFINE_bool("zero1", True, "Shard the optimizer state over the data axis (ZeRO-1).")
    flags.DEFINE_string("json", None, "Also write the numbers as JSON to this path.")


def main(argv) -> None:
    from absl import app, flags

    from zaya_jax import config as config_lib

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    f = flags.FLAGS
    if f.config is None:
        raise app.UsageError("--config is required")
    c = f.config
    cfg = config_lib.validate(c)
    default = {a: c.mesh[a] for a in MESH_AXES}
    mesh = parse_mesh(f.mesh, num_devices=f.num_devices, default=default)
    devices = math.prod(mesh.values())
    seq_len = c.train.seq_len
    micro_batch = f.micro_batch or config_micro_batch(c, devices)
    from ml_collections import config_flags

    header = (
        f"ZAYA1 sizing: {config_flags.get_config_filename(f['config'])}"
        f" (global batch {c.train.batch_size} x {seq_len} tokens, grad_accum {c.train.grad_accum})"
    )
    text, data = report(
        cfg,
        seq_len=seq_len,
        micro_batch=micro_batch,
        mesh=mesh,
        remat=f.remat or cfg.remat,
        zero1=f.zero1,
        device_memory_gib=f.device_memory_gib,
        header=header,
        muon_mu_bytes=_DTYPE_BYTES.get(c.optim.muon.mu_dtype, 4),
    )
    if c.train.batch_size % (c.train.grad_accum * devices) and not f.micro_batch:
        text += (
            f"\n  WARNING train.batch_size={c.train.batch_size} is not divisible by grad_accum x "
            f"devices = {c.train.grad_accum * devices}"
        )
    print(text)
    if f.json:
        with open(f.json, "w") as fh:
            json.dump(data, fh, indent=1)


def _normalise_argv(argv: list[str]) -> list[str]:
    """Accepts `--micro-batch 4` style spellings of our own flags (absl wants underscores)."""
    ours = ("--micro-batch", "--num-devices", "--device-memory-gib")
    out = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        out.append(name.replace("-", "_").replace("__", "--", 1) + sep + value if name in ours else arg)
    return out


if __name__ == "__main__":
    import sys

    from zaya_jax import cli

    cli.run_absl(main, _define_flags, argv=_normalise_argv(sys.argv))
