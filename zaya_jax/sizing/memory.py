"""Memory per device of a ZAYA1 training run (`memory_per_device`), following the layout of
zaya_jax/parallel/sharding.py:

  params, grads   param_dtype; the big matrices are split over `fsdp` on their model width, the
                  expert tensors over `expert`; small vectors are replicated. Gradients are summed
                  per data rank over the microbatches (zaya_jax/parallel/zero1.py): with
                  train.grad_reduce "step", reduced once after the loop, so with grad_accum > 1 two
                  whole buffers of them are live, the sum so far and the microbatch's own (the
                  backward pass assembles a microbatch's layer gradients into a fresh stack before
                  it is added); with "microbatch" each microbatch's are reduce-scattered first and
                  the sum is the rank's ZeRO-1 shard: one whole buffer + that shard (about 1/n).
  optimizer       Muon: one momentum buffer (optim.muon.mu_dtype, fp32) per Muon-routed matrix;
                  AdamW: two moments (fp32) for everything else (routing of the parameter registry).
                  Each leaf is laid out like its parameter and, with ZeRO-1, additionally split over
                  `data` along its largest free dimension that divides evenly (sharding.zero1_spec).
  activations     a documented per-token estimate of what the backward pass keeps for one
                  microbatch (`activation_bytes`), for remat none / matmuls / dots_saveable / full.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from zaya_jax.kernels import attention_choice, pick_blocks
from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.loss import LOSS_CHUNK_TOKENS, chunk_positions
from zaya_jax.parallel.context import config_context
from zaya_jax.parallel.expert import remat_saved_bytes
from zaya_jax.parallel.mesh import parse_mesh_spec, resolve_mesh_sizes
from zaya_jax.parallel.sharding import mesh_axes, zero1_spec
from zaya_jax.parallel.zero1 import reduces_per_microbatch, shards_master
from zaya_jax.sizing.counts import param_counts, param_leaves

MI300X_MEMORY_GIB = 192.0
GIB = 2.0**30

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_mesh(
    spec: str | Mapping[str, int] | None,
    num_devices: int | None = None,
    default: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """`"data=8,fsdp=1,expert=1"` (missing axes from `default`, else 1; one axis may be -1 = the
    devices the others leave, which needs `num_devices`) -> {axis: size} (zaya_jax.parallel.mesh)."""
    return resolve_mesh_sizes(parse_mesh_spec(spec, default=default or {}), num_devices)


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
    grad_buffers: int = 1  # whole gradient buffers in `grads`: 2 when the step sums microbatches whole
    largest_leaf: float = 0.0  # bytes of the largest parameter on the device (its gathered update)
    zero1: bool = True
    grad_shard: float = 0.0  # the gradients' ZeRO-1 shard on the device (what the update reads)
    sharded_sum: bool = False  # the microbatches' sum is that shard (grad_reduce "microbatch"; in `grads`)

    @property
    def update_temporaries(self) -> float:
        """What the optimizer update holds where the compiler does not write the new state over the
        old one (XLA:CPU, inside the skip guard's lax.cond: zaya_jax/training/train_state.updated_state): the
        new parameters and optimizer state, the largest parameter's all-gathered update and the
        reduced gradient shards (the gradients over the data size; all of them without ZeRO-1)."""
        return self.params + self.optimizer + self.largest_leaf + self.grad_shard

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
    layout (zaya_jax.parallel.sharding over the parameter registry), so the estimate follows any
    change to it; ValueError for a parameter of ndim >= 2 that the registry does not list."""
    return mesh_axes(path, ndim)


def _shard_elements(
    shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mapping[str, int], zero1: bool
) -> float:
    """Elements of one leaf on one device: sharded dims divided by their axis (ceil: padding); with
    ZeRO-1 also the `data` split the trainer adds (sharding.zero1_spec)."""
    dims = tuple(zero1_spec(axes, shape, mesh)) if zero1 else tuple(axes) + (None,) * (len(shape) - len(axes))
    n = 1
    for size, axis in zip(shape, dims):
        split = math.prod(mesh[a] for a in (axis if isinstance(axis, tuple) else (axis,))) if axis else 1
        n *= -(-size // split)
    return float(n)


def state_bytes_per_device(
    leaves: list[tuple[str, tuple[int, ...], str]],
    mesh: Mapping[str, int],
    *,
    param_bytes: int = 4,
    grad_bytes: int | None = None,
    muon_mu_bytes: int = 4,
    adam_moment_bytes: int = 4,
    zero1: bool = True,
    master_sharded: bool = False,
) -> dict[str, float]:
    """Params / grads / optimizer-state bytes on one device for the leaves [(path, shape, label)];
    grad_shard: the gradients' ZeRO-1 shard (laid out like the optimizer state). `master_sharded`:
    the params are fp32 master weights in the ZeRO-1 shard (zero1.shards_master), laid out like
    the optimizer state too.

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
        "largest_leaf": 0.0,
        "grad_shard": 0.0,
    }
    for path, shape, label in leaves:
        shape = tuple(int(s) for s in shape)
        axes = param_mesh_axes(path, len(shape))
        local = _shard_elements(shape, axes, mesh, zero1=False)
        local_opt = _shard_elements(shape, axes, mesh, zero1=zero1)
        out["params"] += (local_opt if master_sharded else local) * param_bytes
        out["grads"] += local * grad_bytes
        out["grad_shard"] += local_opt * grad_bytes
        out["largest_leaf"] = max(out["largest_leaf"], local * param_bytes)
        if label == "muon":
            out["optimizer_muon"] += local_opt * muon_mu_bytes
            out["muon_params"] += math.prod(shape)
        else:
            out["optimizer_adamw"] += local_opt * 2 * adam_moment_bytes
            out["adamw_params"] += math.prod(shape)
    return out


REMAT_CHOICES = ("none", "matmuls", "dots_saveable", "full")  # least recompute first


def activation_terms(cfg: ZayaConfig, seq_len: int, attention: str = "xla") -> dict[str, float]:
    """Bytes per token that one block keeps for the backward pass without rematerialisation, with
    `attention` the resolved model.attention_impl ("xla", "blockwise" or "pallas").

    Counted from the residuals `jax.ad_checkpoint.print_saved_residuals` lists for a ZayaBlock
    (compute dtype b bytes, fp32 f = 4 bytes; C = (Nq+Nkv)*hd conv channels, S keys):
      d_wide            14 fp32 [d]: residual stream, the (x+bias)*scale pairs, norm inputs/outputs,
                        expert outputs (unsorted, weighted); 3 compute-dtype [d]: normed inputs, o_proj
      cca_conv_proj     compute dtype: 4 x [C] (concat(q0,k0), conv input/outputs), mean-skip [Nq*hd],
                        k and v [Nkv*hd] each
      qk_norm_rope      fp32 q, k and tempered k, RoPE cos/sin, per-head norms
      attention_scores  the XLA path materialises [Nq, S] scores per token: fp32 logits, fp32 softmax,
                        probs in the compute dtype and the broadcast bool mask (2f + b + 1 per score);
                        the flash kernels keep the fp32 log-sum-exp [Nq] and recompute the scores
                        block by block: blockwise holds one [Nq, block_q, block_k] tile of them per
                        sequence (here spread over its S tokens), Pallas keeps them on chip
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
        "attention_scores": _attention_bytes(cfg, seq_len, attention),
        "router": f * (13 * r + e),
        "experts": f * 5 * i + b * i,
    }


def _attention_bytes(cfg: ZayaConfig, seq_len: int, attention: str) -> float:
    """The attention_scores term of `activation_terms` (bytes per token)."""
    nq, score = cfg.num_attention_heads, 2 * 4 + _DTYPE_BYTES[cfg.dtype] + 1
    if attention == "xla":
        return nq * seq_len * score
    lse = 4 * nq
    if attention == "pallas":
        return lse
    blocks = pick_blocks("blockwise_attention", {"seq_q": seq_len, "seq_k": seq_len}, cfg.compute_dtype)
    return lse + nq * min(blocks["block_q"], seq_len) * min(blocks["block_k"], seq_len) * score / seq_len


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


def _kernels_saved_per_token(cfg: ZayaConfig) -> float:
    """Bytes per token per block that `matmuls` keeps besides `dots_saveable`'s: flash attention's
    output (compute dtype [Nq*hd]) and log-sum-exp (fp32 [Nq]), the grouped matmuls' fp32 outputs
    ([2I] and [d])."""
    nq, hd, b = cfg.num_attention_heads, cfg.head_dim, _DTYPE_BYTES[cfg.dtype]
    return b * nq * hd + 4 * nq + 4 * (2 * cfg.moe_intermediate_size + cfg.hidden_size)


def activation_bytes(
    cfg: ZayaConfig,
    *,
    seq_len: int,
    micro_batch: int,
    remat: str,
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS,
    expert_axis: int = 1,
    context: int = 1,
    attention: str = "xla",
) -> float:
    """Estimated activation bytes per device for one microbatch of `micro_batch` sequences (with
    mesh.context = R > 1: S/R positions of each, and the block's keys and values all-gathered to S).

      none           L x (the `activation_terms` of a block) per token
      dots_saveable  L x (block carry + matmul outputs) per token, + one block's full activations
                     while it is recomputed in the backward pass
      matmuls        as dots_saveable, + L x the kernels' saved outputs (`_kernels_saved_per_token`)
      full           L x block carry (h fp32 [d] + router state fp32 [R]) per token, + one block's
                     full activations while it is recomputed
    and, with remat and `expert_axis` n > 1, L x what each block's expert exchange received (its
    tokens and ids, f x T/n slots per peer, and the returned fp32 expert outputs [T, d]:
    zaya_jax/parallel/expert.py `remat_saved_bytes`), which the backward reuses;
    plus, when the compute dtype differs from param_dtype, the compute-dtype copies of the block
    weights (every block's for `none`, one block's otherwise; experts divided by `expert_axis`), and
    outside the blocks: the embedding output and final norm (fp32 [d] each, per token) and one loss
    chunk's logits (`loss_chunk_tokens` of the microbatch's tokens x V, fp32 logits, softmax and
    gradient: zaya_jax/model/loss.py `chunk_positions`).
    The per-token parts were checked against `print_saved_residuals` (within ~10%, above).
    """
    if remat not in REMAT_CHOICES:
        raise ValueError(f"remat={remat!r}; expected one of {REMAT_CHOICES}")
    tokens = micro_batch * seq_len // context
    n = cfg.num_hidden_layers
    block = sum(activation_terms(cfg, seq_len, attention).values())  # attention reads all S keys
    carry = 4 * (cfg.hidden_size + cfg.router_hidden_size)
    if remat == "none":
        per_token = n * block
    elif remat == "dots_saveable":
        per_token = n * (carry + _dots_saved_per_token(cfg, seq_len)) + block
    elif remat == "matmuls":
        per_token = n * (carry + _dots_saved_per_token(cfg, seq_len) + _kernels_saved_per_token(cfg)) + block
    else:
        per_token = n * carry + block
    exchange = 0.0
    if remat != "none":
        dropless = cfg.moe_capacity_factor is None
        factor = cfg.moe_exchange_capacity_factor if dropless else cfg.moe_capacity_factor
        args = (
            tokens,
            expert_axis,
            cfg.hidden_size,
            cfg.num_experts,
            _DTYPE_BYTES[cfg.dtype],
            factor,
            dropless,
        )
        exchange = n * remat_saved_bytes(*args)
    casts = 0.0
    if cfg.dtype != cfg.param_dtype:
        pc = param_counts(cfg)
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        per_layer = (pc.active / n - expert) + expert * cfg.num_experts / expert_axis
        casts = (n if remat == "none" else 1) * per_layer * _DTYPE_BYTES[cfg.dtype]
    outside = tokens * 3 * 4 * cfg.hidden_size
    loss = micro_batch * min(chunk_positions(micro_batch, loss_chunk_tokens), seq_len // context) * cfg.vocab_size * 3 * 4
    # The gathered K/V: every block's kept without remat, the recomputed block's otherwise.
    gathered = 0.0
    if context > 1:
        gathered = (n if remat == "none" else 1) * kv_all_gather_bytes(cfg, seq_len, micro_batch, 1)
    return tokens * per_token + exchange + casts + outside + loss + gathered


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
    accumulate: bool = False,
    grad_reduce: str = "step",
    attention: str = "xla",
) -> MemoryEstimate:
    """Memory of one device training `cfg` on `mesh` with `micro_batch` sequences of `seq_len` tokens
    per device per microbatch (see the module docstring for the layout). `leaves` defaults to
    `param_leaves(cfg)`. `accumulate`: the step sums several microbatches (train.grad_accum > 1):
    two whole gradient buffers, or with `grad_reduce` "microbatch" (where the loop runs per data
    rank: zero1.reduces_per_microbatch) one and the rank's shard of the sum. `attention`: the
    resolved model.attention_impl (kernels.attention_choice), which sets the scores' memory."""
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
        master_sharded=shards_master(cfg.param_dtype, cfg.dtype, zero1),
    )
    by_remat = {
        r: activation_bytes(
            cfg,
            seq_len=seq_len,
            micro_batch=micro_batch,
            remat=r,
            expert_axis=mesh["expert"],
            context=mesh["context"],
            attention=attention,
        )
        for r in REMAT_CHOICES
    }
    sharded_sum = accumulate and reduces_per_microbatch(grad_reduce, mesh)
    grad_buffers = 2 if accumulate and not sharded_sum else 1
    return MemoryEstimate(
        mesh=dict(mesh),
        remat=remat,
        micro_batch=micro_batch,
        seq_len=seq_len,
        params=state["params"],
        grads=state["grads"] * grad_buffers + (state["grad_shard"] if sharded_sum else 0.0),
        optimizer_muon=state["optimizer_muon"],
        optimizer_adamw=state["optimizer_adamw"],
        activations=by_remat[remat],
        activations_by_remat=by_remat,
        muon_params=int(state["muon_params"]),
        adamw_params=int(state["adamw_params"]),
        grad_buffers=grad_buffers,
        largest_leaf=state["largest_leaf"],
        zero1=zero1,
        grad_shard=state["grad_shard"],
        sharded_sum=sharded_sum,
    )


def config_micro_batch(c: Any, devices: int) -> int:
    """Sequences per device per microbatch of training config `c` on `devices` devices (with
    mesh.context = R: per group of R devices, each holding S/R positions of them)."""
    return max(1, c.train.batch_size // c.train.grad_accum // (devices // config_context(c.mesh, devices)))


def config_memory_per_device(
    c: Any, cfg: ZayaConfig, mesh: Mapping[str, int], platform: str
) -> MemoryEstimate:
    """`memory_per_device` of training config `c` (model `cfg`) on `mesh` of `platform` devices: its
    micro-batch, remat, ZeRO-1, gradient reduction, Muon momentum dtype and attention as resolved
    there, as `python -m zaya_jax.sizing` reports them."""
    return memory_per_device(
        cfg,
        seq_len=c.train.seq_len,
        micro_batch=config_micro_batch(c, math.prod(mesh.values())),
        mesh=dict(mesh),
        remat=cfg.remat,
        zero1=c.mesh.zero1,
        muon_mu_bytes=_DTYPE_BYTES.get(c.optim.muon.mu_dtype, 4),
        accumulate=c.train.grad_accum > 1,
        grad_reduce=c.train.grad_reduce,
        attention=attention_choice(cfg.attention_impl, platform, c.train.seq_len),
    )
