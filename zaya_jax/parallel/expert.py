"""Expert parallelism: tokens travel to the device that owns their expert and back (all-to-all).

Inside `shard_map` over the whole mesh each device buckets its tokens by owner rank, exchanges them
over the "expert" axis, runs its local experts (the single-device `local_moe` dispatch) and sends
the results back. Dropless (default): a main exchange of ceil(f T / n) slots per destination and a
spill round, run only when a bucket overflows; with `capacity_factor` tokens past capacity are
dropped. The design, the choice of spill and the bytes moved: docs/design/expert-exchange.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.context import CONTEXT, context_manual
from zaya_jax.parallel.mesh import MESH_AXES

BATCH = MESH_AXES  # tokens are split over every axis
DEFAULT_EXCHANGE_FACTOR = 1.5
# What the exchange received, by name (jax.ad_checkpoint.checkpoint_name): every remat policy saves
# them (zaya_jax/model/transformer.py), so a remat'd block's backward reuses them instead of
# replaying the forward all-to-alls. RECEIVED: the tokens and expert ids a device received [n, C, .];
# RETURNED: the expert outputs back on the tokens' device, fp32 [T, d]; OVERFLOW: the spill flag.
RECEIVED, RETURNED, OVERFLOW = (
    "expert_exchange_received",
    "expert_exchange_returned",
    "expert_exchange_overflow",
)
EXCHANGE_NAMES = (RECEIVED, RETURNED, OVERFLOW)


def capacity(tokens: int, ranks: int, capacity_factor: float | None) -> int:
    """Slots per destination rank: T for None, else ceil(f T / n) rounded up to 8 (at most T)."""
    if capacity_factor is None:
        return tokens
    c = math.ceil(capacity_factor * tokens / ranks)
    return min(tokens, -(-c // 8) * 8)


def remat_saved_bytes(
    tokens: int, ranks: int, hidden: int, experts: int, itemsize: int, factor: float, dropless: bool = True
) -> int:
    """Bytes per device that one remat'd MoE block keeps of its exchange (EXCHANGE_NAMES) with
    `factor` x T/n slots per peer: the tokens received [n, C, d] (compute dtype) and their expert
    ids [n, C], the expert outputs returned, fp32 [T, d], and the dropless exchange's int32 overflow
    flag. The spill round keeps nothing (the backward replays a spill that ran). 0 without an
    exchange (n = 1)."""
    if ranks == 1:
        return 0
    cap = capacity(tokens, ranks, factor)
    id_bytes = 1 if experts // ranks < 127 else 4  # _exchange's id dtype
    flag = 4 if dropless and cap < tokens else 0
    return ranks * cap * (hidden * itemsize + id_bytes) + tokens * hidden * 4 + flag


def _bucket(expert_m: jax.Array, num_experts: int, ranks: int) -> tuple[jax.Array, jax.Array]:
    """(rank [T] (ranks for skip), slot [T]: the token's position within its rank's bucket)."""
    per_rank = num_experts // ranks
    rank = jnp.where(expert_m < num_experts, expert_m // per_rank, ranks)
    order = jnp.argsort(rank, stable=True)
    sizes = jnp.bincount(rank, length=ranks + 1)
    starts = jnp.cumsum(sizes) - sizes
    slot_sorted = jnp.arange(rank.shape[0]) - starts[rank[order]]
    slot = jnp.zeros_like(slot_sorted).at[order].set(slot_sorted)
    return rank, slot


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _combine(out_ncd: jax.Array, ct_dtype) -> jax.Array:
    """The expert outputs [n, C, d] (fp32) back to their senders. The backward sends their cotangent
    in `ct_dtype` (the compute dtype): every local dispatch consumes it so (zaya_jax/model/moe.py,
    `cotangent_as`), so the gradient exchange moves half the bytes for the same values."""
    return jax.lax.all_to_all(out_ncd, "expert", 0, 0)


def _combine_fwd(out_ncd, ct_dtype):
    return _combine(out_ncd, ct_dtype), None


def _combine_bwd(ct_dtype, _, ct_ncd):
    return (jax.lax.all_to_all(ct_ncd.astype(ct_dtype), "expert", 0, 0).astype(ct_ncd.dtype),)


_combine.defvjp(_combine_fwd, _combine_bwd)


def _exchange(x_md, rank_m, slot_m, send_m, local_m, n, cap, gate_up, down, act, local_moe, saved=True):
    """One round: tokens with `send_m` go to slot `slot_m` (< cap) of rank `rank_m`'s bucket [n, cap,
    d], run on that rank's expert `local_m` and come back. fp32 [T, d], zero for tokens not sent.
    `saved`: name what it received (EXCHANGE_NAMES) for remat to keep."""
    d, per_rank = x_md.shape[1], gate_up.shape[0]  # gate_up holds this device's E/n experts
    name = checkpoint_name if saved else lambda v, _: v
    # Ids fit a byte for any realistic E/n; `per_rank` marks an empty slot (the skip class locally).
    id_dtype = jnp.int8 if per_rank < 127 else jnp.int32
    dest = jnp.where(send_m, rank_m, n)  # row n is out of range: mode="drop" sends nothing
    slot = jnp.where(send_m, slot_m, 0)
    send_x = jnp.zeros((n, cap, d), x_md.dtype).at[dest, slot].set(x_md, mode="drop")
    send_id = jnp.full((n, cap), per_rank, id_dtype).at[dest, slot].set(local_m.astype(id_dtype), mode="drop")
    recv_x = name(jax.lax.all_to_all(send_x, "expert", 0, 0), RECEIVED)
    recv_id = name(jax.lax.all_to_all(send_id, "expert", 0, 0), RECEIVED).astype(jnp.int32)
    out = local_moe(recv_x.reshape(n * cap, d), recv_id.reshape(-1), gate_up, down, act)
    back = _combine(out.reshape(n, cap, d), x_md.dtype)
    return name(jnp.where(send_m[:, None], back[jnp.minimum(rank_m, n - 1), slot], 0.0), RETURNED)


def _dropless_exchange(x_md, expert_m, num_experts, n, cap, gate_up, down, act, local_moe):
    """The main round with `cap` slots per destination, plus the spill round (T - cap slots) under
    a cond when any bucket of the expert group overflowed -> (fp32 [T, d], int32 1 if the spill
    round ran, else 0: the same on the group's n devices). Drops nothing."""
    t = x_md.shape[0]
    rank, slot = _bucket(expert_m, num_experts, n)
    local = expert_m % (num_experts // n)
    routed = rank < n
    main = routed & (slot < cap)
    y = _exchange(x_md, rank, slot, main, local, n, cap, gate_up, down, act, local_moe)
    if cap >= t:
        return y, jnp.zeros((), jnp.int32)
    spill = routed & ~main
    overflow = checkpoint_name(jax.lax.pmax(jnp.any(spill).astype(jnp.int32), "expert"), OVERFLOW)

    # Unnamed: remat saving a cond's residuals keeps every branch's (the untaken one's as zeros), so
    # naming these would cost their memory on every step; the backward replays a spill that ran.
    def spill_round(x, g, dn):
        return _exchange(x, rank, slot - cap, spill, local, n, t - cap, g, dn, act, local_moe, saved=False)

    no_spill = lambda x, g, dn: jnp.zeros(x.shape, jnp.float32)
    return y + jax.lax.cond(overflow > 0, spill_round, no_spill, x_md, gate_up, down), overflow


def expert_parallel_moe(
    x_md: jax.Array,
    expert_m: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    act: Callable,
    local_moe: Callable,
    mesh: Mesh,
    capacity_factor: float | None = None,
    exchange_factor: float = DEFAULT_EXCHANGE_FACTOR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Global tokens [T, d] (split over every mesh axis) and experts [E, ...] (split over "expert")
    -> (y [T, d] fp32, dropped-token count, spilled). `local_moe(x, ids, gate_up, down, act)` is
    the single-device dispatch (sparse or dense) applied to each device's received tokens.
    `capacity_factor` None is dropless (main exchange of `exchange_factor` x T/n slots per peer plus
    the spill); a number caps every bucket at that factor and drops the rest.
    spilled: int32 [devices] (split over every axis, like the tokens), 1 on each device whose
    expert group ran the spill round, else 0; no collective gathers it (a sum over it / n counts
    the groups that spilled)."""
    no_spill = jnp.zeros((mesh.size,), jnp.int32)
    if mesh.size == 1 and capacity_factor is None:
        # One device exchanges nothing. Without shard_map its transpose adds no all-reduce of the
        # expert weight gradients over that one device: XLA:CPU would copy all of them each step.
        return local_moe(x_md, expert_m, gate_up_edf, down_efd, act), jnp.zeros((), jnp.int32), no_spill
    num_experts = gate_up_edf.shape[0]
    n = mesh.shape["expert"]

    def per_device(x, expert, gate_up, down):
        t, zero = x.shape[0], jnp.zeros((), jnp.int32)
        if capacity_factor is None:
            if n == 1:
                return local_moe(x, expert, gate_up, down, act), zero, zero[None]
            cap = capacity(t, n, exchange_factor)
            y, spilled = _dropless_exchange(x, expert, num_experts, n, cap, gate_up, down, act, local_moe)
            return y, zero, spilled[None]
        cap = capacity(t, n, capacity_factor)
        rank, slot = _bucket(expert, num_experts, n)
        kept = (rank < n) & (slot < cap)
        if n == 1:
            y = local_moe(x, jnp.where(kept, expert, num_experts), gate_up, down, act)
        else:
            local = expert % (num_experts // n)
            y = _exchange(x, rank, slot, kept, local, n, cap, gate_up, down, act, local_moe)
        return y, jax.lax.psum(jnp.sum((rank < n) & ~kept), axes), zero[None]

    # A manual context axis (the per-rank loop) holds each rank's tokens already; its sums are
    # taken with the loop's (zaya_jax/parallel/zero1.py).
    axes = tuple(a for a in BATCH if a != CONTEXT or not context_manual(mesh))
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axes, None), P(axes), P("expert", None, None), P("expert", None, None)),
        out_specs=(P(axes, None), P(), P(axes)),
        check_vma=False,
    )(x_md, expert_m, gate_up_edf, down_efd)
