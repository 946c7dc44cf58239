"""The ZAYA1 decoder (docs/model.md §2): embedding, L scanned blocks (CCA + MoE), final norm, tied head.

  h = (embed[ids] + input_hidden_states_bias) * input_hidden_states_scale        fp32 [B, S, d]
  per block:  h = ResScale1(CCA(RMSNorm(h)), h);  h = ResScale2(MoE(RMSNorm(h)), h)
  logits = RMSNorm(h) @ embed^T                                                  fp32 [B, S, V]

Blocks are one `nn.scan`, so every per-block parameter has a leading [L] axis (`layers/...`): one
compiled block whatever the depth. `model.scan_layers` may fully unroll that scan (same parameters,
same values; see `resolve_scan_layers`). The router state (EDA) rides in the scan carry next to h.
Block 0 has a `router_states_scale` too (the scan needs uniform blocks); its incoming state is zero,
so it is exactly HF's EDA-less first router. It gets zero gradient and is not exported.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.scipy.special import entr
from jax.sharding import Mesh

from zaya_jax.kernels.flash_attention import FLASH_LSE, FLASH_OUT
from zaya_jax.kernels.grouped_matmul import GMM_OUT
from zaya_jax.model.cca import CCAttention, KVContext, LayerCache
from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.moe import ZayaExperts
from zaya_jax.model.norm import RMSNorm
from zaya_jax.model.residual import ResidualScaling
from zaya_jax.model.router import BALANCING, ZayaRouter
from zaya_jax.parallel.context import CONTEXT, CONTIGUOUS, context_manual, flatten_tokens, unflatten_tokens
from zaya_jax.parallel.expert import EXCHANGE_NAMES
from zaya_jax.parallel.mesh import mesh_platform


@flax.struct.dataclass
class ZayaOutput:
    """logits: fp32 [B, S, V] (None with return_logits=False); hidden: final-normed fp32 [B, S, d];
    expert_counts: tokens per class per block, padding excluded, fp32 [L, E+1] (class E = skip);
    router_probs: fp32 [L, B, S, E+1]; dropped_tokens: tokens per block that lost their expert to an
    expert-parallel capacity limit, int32 [L] (0 when dropless); router_entropy: the sum over the
    tokens counted in expert_counts of the entropy (nats) of the router's distribution over the E+1
    classes, fp32 [L] (divide by the tokens for a mean; routing telemetry,
    zaya_jax/training/routing_telemetry.py); exchange_spills: int32 [L, devices] (split over the devices;
    [L, 1] without a mesh), 1 where the device's expert group ran the exchange's spill round in that
    block (zaya_jax/parallel/expert.py)."""

    logits: jax.Array | None
    hidden: jax.Array
    expert_counts: jax.Array
    router_probs: jax.Array
    dropped_tokens: jax.Array
    router_entropy: jax.Array
    exchange_spills: jax.Array
    cache: Any = None  # the updated KVCache when called with one (decoding)


class KVCache(NamedTuple):
    """Decoding cache. layers: LayerCache with a leading [L] axis (k, v [L,B,T,Nkv,hd], conv
    [L,B,P,C], v_delayed [L,B,Nkv*hd/2]); kv_pos [B,T] int32 key positions; kv_mask [B,T] bool
    (False = padding or not yet written)."""

    layers: LayerCache
    kv_pos: jax.Array
    kv_mask: jax.Array


def init_cache(cfg: ZayaConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens (default: compute dtype)."""
    dt = cfg.compute_dtype if dtype is None else dtype
    L, nkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    layers = LayerCache(
        k=jnp.zeros((L, batch, max_len, nkv, hd), dt),
        v=jnp.zeros((L, batch, max_len, nkv, hd), dt),
        conv=jnp.zeros((L, batch, cfg.conv_state_len, cfg.conv_channels), dt),
        v_delayed=jnp.zeros((L, batch, nkv * hd // 2), dt),
    )
    return KVCache(layers, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch, max_len), bool))


class SparseMoeBlock(nn.Module):
    """Router + experts: x [B, S, d], router state [B, S, R] -> (y fp32 [B, S, d], routing, dropped,
    spilled) (ZayaExperts)."""

    cfg: ZayaConfig
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x_bsd, prev_router_state):
        routing = ZayaRouter(self.cfg, name="gate")(x_bsd, prev_router_state)
        tokens = lambda x: flatten_tokens(x, self.mesh)  # [B, S, ...] -> [B*S, ...], no data moved
        y, dropped, spilled = ZayaExperts(self.cfg, self.mesh, name="experts")(
            tokens(x_bsd), tokens(routing.expert_bs), tokens(routing.weight_bs)
        )
        y = unflatten_tokens(y, x_bsd.shape[0], self.mesh)
        if self.cfg.skip_expert_output == "weighted_input":
            skip = self.cfg.num_experts
            w_skip = jnp.where(routing.expert_bs == skip, routing.probs_bse[..., skip], 0.0)
            y = y + w_skip[..., None] * x_bsd.astype(jnp.float32)
        return y, routing, dropped, spilled


class ZayaBlock(nn.Module):
    """One decoder block; the scan body. carry = (h fp32 [B,S,d], router state fp32 [B,S,R])."""

    cfg: ZayaConfig
    mesh: Mesh | None = None
    context_layout: str = CONTIGUOUS

    @nn.compact
    def __call__(self, carry, layer_xs, positions_bs, padding_mask_bs, segment_ids_bs, kv_shared=None):
        cfg = self.cfg
        h, router_state = carry
        rope_theta, sliding_window, layer_cache = layer_xs
        kv_ctx = None if layer_cache is None else KVContext(layer_cache, *kv_shared)
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype, name=name)

        a, new_layer_cache = CCAttention(cfg, self.mesh, self.context_layout, name="self_attn")(
            norm("input_layernorm")(h),
            positions_bs=positions_bs,
            padding_mask_bs=padding_mask_bs,
            rope_theta=rope_theta,
            sliding_window=sliding_window,
            segment_ids_bs=segment_ids_bs,
            kv_cache=kv_ctx,
        )
        if kv_ctx is None:
            new_layer_cache = None
        h = ResidualScaling(cfg.params_dtype, name="post_attention_residual_scale")(a, h)

        y, routing, dropped, spilled = SparseMoeBlock(cfg, self.mesh, name="mlp")(
            norm("post_attention_layernorm")(h), router_state
        )
        h = ResidualScaling(cfg.params_dtype, name="post_mlp_residual_scale")(y, h)

        token_weight = (
            jnp.ones(routing.expert_bs.shape, jnp.float32)
            if padding_mask_bs is None
            else padding_mask_bs.astype(jnp.float32)
        )
        # A masked sum, not a scatter-add: XLA all-gathers a scatter's updates split over the context
        # axis, and a sum of 0/1 weights is exact in any order (below 2^24 tokens).
        classes = jnp.arange(cfg.num_router_classes, dtype=routing.expert_bs.dtype)
        hit = routing.expert_bs[..., None] == classes
        counts = jnp.sum(jnp.where(hit, token_weight[..., None], 0.0), axis=tuple(range(hit.ndim - 1)))
        # A scalar per block, not the [B, S] entropies: only this sum leaves the scan (telemetry).
        # stop_gradient: no tangent of entr at p = 0 (-log 0) can reach the gradients as 0 * inf.
        entropy = jnp.sum(jnp.sum(entr(jax.lax.stop_gradient(routing.probs_bse)), axis=-1) * token_weight)
        per_block = (counts, routing.probs_bse, dropped, entropy, spilled, new_layer_cache)
        return (h, routing.next_state_bsr), per_block


# "auto" unrolls up to this many blocks: compile time grows linearly with the unrolled depth.
MAX_AUTO_UNROLLED_LAYERS = 8


def resolve_scan_layers(scan_layers: str, num_layers: int, platform: str) -> str:
    """ "scan" or "unroll" for a config's `scan_layers` on devices of `platform` (the mesh's,
    zaya_jax.parallel.mesh.mesh_platform); "auto" -> "unroll" on CPU for at most
    MAX_AUTO_UNROLLED_LAYERS blocks, else "scan".

    Why unroll on CPU: a rolled scan runs as an XLA while loop whose per-layer outputs (the [l, ...]
    gradient stacks, saved activations, router outputs) are zero-filled buffers written one
    dynamic-update-slice per iteration; on XLA:CPU those fills and copies were ~29% of the tiny
    config's step. Unrolled, every layer's slice is static and the stacks are one concatenation.
    The price is compile time (about 2x for the 4-block tiny config), hence a per-config choice
    (ZayaConfig's default is "scan"; configs/tiny.py and mid.py set "auto"). Not measured on
    GPU/TPU, where the deep configs also need the scan's constant compile time.
    """
    if scan_layers != "auto":
        return scan_layers
    return "unroll" if platform == "cpu" and num_layers <= MAX_AUTO_UNROLLED_LAYERS else "scan"


# Every policy saves what the expert exchange received (parallel/expert.py EXCHANGE_NAMES): the
# backward reuses it instead of replaying the forward all-to-alls (4 exchanges per MoE block, not 6).
# "matmuls" also keeps our kernels' matmul outputs, which dots_saveable cannot see (a Pallas call is
# no dot): flash attention's output and log-sum-exp, the grouped expert matmuls' outputs.
_SAVE_EXCHANGE = jax.checkpoint_policies.save_only_these_names(*EXCHANGE_NAMES)
_SAVE_KERNELS = jax.checkpoint_policies.save_only_these_names(*EXCHANGE_NAMES, FLASH_OUT, FLASH_LSE, GMM_OUT)
_DOTS = jax.checkpoint_policies.dots_saveable
REMAT_POLICIES = {
    "matmuls": jax.checkpoint_policies.save_from_both_policies(_DOTS, _SAVE_KERNELS),
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(_DOTS, _SAVE_EXCHANGE),
    "full": _SAVE_EXCHANGE,
}


class ZayaForCausalLM(nn.Module):
    """ids [B, S] int -> ZayaOutput. Variables: {"params": ..., "balancing": ...} (see router.py).

    With a `mesh` the MoE dispatch runs per device inside shard_map (expert parallel over the mesh's
    "expert" axis); inputs are then expected to be batch-sharded (zaya_jax.parallel.sharding).
    """

    cfg: ZayaConfig
    mesh: Mesh | None = None
    # mesh.context_layout (zaya_jax/parallel/context.py): with "zigzag" the caller passes inputs in
    # its storage order (`to_layout`) with explicit positions.
    context_layout: str = CONTIGUOUS
    # Applied to each block's variables inside the layer scan ({"params": ..., and the collections
    # named by its `collections`, sliced like the params}; it may add its `outputs` collections,
    # which the scan stacks): the train step's first microbatch gathers each block's weights in its
    # forward, its last reduce-scatters each block's gradients in its backward
    # (zaya_jax/parallel/overlap.py BlockGather, BlockReduce).
    block_hook: Any = None

    def setup(self):
        cfg = self.cfg
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            param_dtype=cfg.params_dtype,
            embedding_init=nn.initializers.normal(cfg.initializer_range),
        )
        self.input_hidden_states_scale = self.param(
            "input_hidden_states_scale", nn.initializers.ones, (cfg.hidden_size,), cfg.params_dtype
        )
        self.input_hidden_states_bias = self.param(
            "input_hidden_states_bias", nn.initializers.zeros, (cfg.hidden_size,), cfg.params_dtype
        )
        block = ZayaBlock
        if cfg.remat != "none":
            block = nn.remat(ZayaBlock, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
        hook = self.block_hook
        hooked = () if hook is None else (*hook.collections, *hook.outputs)
        if hooked:
            # The hook's `outputs` collections go out of the scan stacked; nothing else is written.
            keep = lambda variables: {k: variables[k] for k in hook.outputs if k in variables}
            mutable = bool(hook.outputs)
            block = nn.map_variables(block, ("params", *hooked), trans_in_fn=hook, trans_out_fn=keep, mutable=mutable)
        platform = mesh_platform(self.mesh)
        unroll = resolve_scan_layers(cfg.scan_layers, cfg.num_hidden_layers, platform) == "unroll"
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0, BALANCING: 0, **{name: 0 for name in hooked}},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_hidden_layers,
            # Full unroll keeps the scan's variable layout ([l, ...] stacks, same names and init
            # RNG splits), so checkpoints, HF conversion and sharding do not see the difference.
            unroll=cfg.num_hidden_layers if unroll else 1,
        )(cfg, self.mesh, self.context_layout)
        self.norm = RMSNorm(cfg.rms_norm_eps, jnp.float32, cfg.params_dtype)
        self.lm_head = LMHead(cfg)

    def per_layer_inputs(self) -> tuple[jax.Array, jax.Array]:
        """(rope theta [L] fp32, sliding window [L] int32, 0 = full causal) from the layer types."""
        cfg = self.cfg
        sliding = [t == "hybrid_sliding" for t in cfg.resolved_layer_types]
        theta = jnp.array([cfg.sliding_rope_theta if s else cfg.rope_theta for s in sliding], jnp.float32)
        window = jnp.array([cfg.sliding_window if s else 0 for s in sliding], jnp.int32)
        return theta, window

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        return_logits: bool = True,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
    ) -> ZayaOutput:
        """input_ids [B, S]; attention_mask [B, S] (1 = token, 0 = padding); positions [B, S] default
        arange(S) (as transformers, padding does not shift positions); segment_ids [B, S] restrict
        attention to tokens of the same packed document.

        Decoding: with `cache` (init_cache) the S new tokens are written at cache slots
        cache_index..cache_index+S-1 and attend over the cache; positions default to
        cache_index + arange(S); the output carries the updated cache. No segment ids there."""
        cfg = self.cfg
        b, s = input_ids.shape
        if positions is None:
            start = 0 if cache is None else jnp.asarray(cache_index, jnp.int32)
            if context_manual(self.mesh):  # this rank's chunk (a zigzag batch carries its positions)
                start = jax.lax.axis_index(CONTEXT) * s
            positions = jnp.broadcast_to(start + jnp.arange(s, dtype=jnp.int32), (b, s))
        kv_shared, layer_caches = None, None
        if cache is not None:
            idx = jnp.asarray(cache_index, jnp.int32)
            zero = jnp.zeros((), jnp.int32)
            new_mask = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
            kv_pos = jax.lax.dynamic_update_slice(cache.kv_pos, positions.astype(jnp.int32), (zero, idx))
            kv_mask = jax.lax.dynamic_update_slice(cache.kv_mask, new_mask, (zero, idx))
            kv_shared = (idx, kv_pos, kv_mask)
            layer_caches = cache.layers
        x = self.embed_tokens(input_ids).astype(jnp.float32)
        h = (x + self.input_hidden_states_bias.astype(jnp.float32)) * self.input_hidden_states_scale.astype(
            jnp.float32
        )
        carry = (h, jnp.zeros((b, s, cfg.router_hidden_size), jnp.float32))
        (h, _), (counts, probs, dropped, entropy, spilled, new_layers) = self.layers(
            carry, (*self.per_layer_inputs(), layer_caches), positions, attention_mask, segment_ids, kv_shared
        )
        new_cache = None if cache is None else KVCache(new_layers, kv_shared[1], kv_shared[2])
        hidden = self.norm(h)
        logits = self.lm_head(hidden, self.embed_tokens.embedding) if return_logits else None
        return ZayaOutput(
            logits=logits,
            hidden=hidden,
            expert_counts=counts,
            router_probs=probs,
            dropped_tokens=dropped,
            router_entropy=entropy,
            exchange_spills=spilled,
            cache=new_cache,
        )

    def logits_from_hidden(self, hidden_bsd: jax.Array) -> jax.Array:
        """The head alone, for chunked losses: final-normed hidden [..., d] -> fp32 logits [..., V]."""
        return self.lm_head(hidden_bsd, self.embed_tokens.embedding)


class LMHead(nn.Module):
    """hidden [..., d] -> fp32 logits [..., V]; tied to the embedding [V, d] unless configured not."""

    cfg: ZayaConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, embedding_vd: jax.Array) -> jax.Array:
        cfg = self.cfg
        dt = cfg.compute_dtype
        if cfg.tie_word_embeddings:
            w_vd = embedding_vd
        else:
            w_vd = self.param(
                "kernel",
                nn.initializers.normal(cfg.initializer_range),
                (cfg.vocab_size, cfg.hidden_size),
                cfg.params_dtype,
            )
        logits = jnp.einsum(
            "...d,vd->...v", hidden.astype(dt), w_vd.astype(dt), preferred_element_type=jnp.float32
        )
        if cfg.lm_head_bias:
            logits = logits + self.param(
                "bias", nn.initializers.zeros, (cfg.vocab_size,), cfg.params_dtype
            ).astype(jnp.float32)
        return logits


def init_variables(cfg: ZayaConfig, rng: jax.Array, batch: int = 1, seq: int = 8) -> dict[str, Any]:
    """Random-init variables {"params", "balancing"} for `cfg` (shapes do not depend on batch/seq)."""
    ids = jnp.zeros((batch, seq), jnp.int32)
    return ZayaForCausalLM(cfg).init(rng, ids)
