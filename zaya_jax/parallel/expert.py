"""Expert parallelism: tokens travel to the device that owns their expert and back (all-to-all).

Inside `shard_map` over the whole mesh, each device holds T tokens (its slice of the batch) and
E/n experts (n = size of the "expert" axis; device r owns experts [r*E/n, (r+1)*E/n)):

  1. bucket the T tokens by owner rank into a send buffer [n, C, d] (C slots per destination;
     skip-class tokens go nowhere);
  2. all_to_all over "expert": device r receives [n, C, d], the tokens every peer sent it;
  3. run its local experts on them (the same `local_moe` dispatch as the single-device path:
     tiled, ragged_dot or Pallas per `moe_impl`);
  4. all_to_all the results back into the senders' slots and un-bucket.

Dropless (the default): fixed capacity with spill. The main exchange has C = ceil(f T / n) slots
per destination, rounded up to 8 (f = `exchange_factor`, config `moe_exchange_capacity_factor`,
default 1.5): with balanced top-1 routing a peer needs T/n slots, so this moves ~f x T x d per
all-to-all instead of n x T x d. A token whose bucket is full (slot >= C) takes the spill exchange,
the same four steps with T - C slots per destination (a bucket never holds more than T tokens, so
the two rounds together always fit: nothing is dropped). The spill runs under `lax.cond` on an
overflow flag reduced (max) over the "expert" axis, the devices that exchange with each other; in
the common case no bucket overflows and the spill costs that one scalar all-reduce. Its backward
is the same `cond` on the saved flag, so the gradient exchange is spill-free too.

Why this spill and not another (issue 17):
  - `jax.lax.ragged_all_to_all` (exact sizes) has no XLA:CPU lowering (jax 0.10.2), and on GPU
    it measured slow in marin-community/marin #7012 / #8077 (XLA's one-shot transfer ran one
    thread block per peer), after which marin #7780 took fixed capacity with spill.
  - A cond that re-runs the whole exchange at C = T on overflow would pay n x T x d then and throw
    the main exchange away; the spill round only sends the overflowing tokens and the main round's
    work is kept (T - C slots instead of T).
  - Computing overflow tokens locally with all-gathered expert weights moves E/n x 3 d I weights
    per block, far more than the tokens (ZAYA1: 2048 x 3 x 2048 weights per expert vs. 2048 values
    per token).
Bytes per MoE block of the compiled train step (dispatch + combine, forward + backward; read by
benchmarks/collectives.py `all_to_all_bytes`, asserted in tests/test_expert_exchange.py): at
data=2 x expert=4 with the tiny test model in fp32 (64 tokens per device) the C = T exchange moved
4.0x the ideal 4 x T x d x itemsize (n x); the main path now moves 1.5x (C = 24 of 64 slots) plus
one byte per slot of int8 expert ids. configs/zaya1_base.py:phase1 at data=2 x expert=4: 12.0x
before, 4.5x now (remat "full" repeats the forward exchange, and XLA:CPU moves bf16 all-to-alls
as fp32; benchmarks/README.md "expert exchange"). The combine returns fp32 expert outputs (as the
single-device path does), so in bf16 it moves twice the dispatch bytes.

With `capacity_factor` f (the dropping mode), C = ceil(f * T / n) rounded up to a multiple of 8 and
there is no spill: tokens past a bucket's capacity get a zero expert output (the residual carries
them) and are counted in the returned `dropped` (summed over the whole mesh).
With n = 1 no all-to-all happens: the dispatch just stays local to each device (a global sort
would otherwise gather the batch).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zaya_jax.parallel.mesh import MESH_AXES

BATCH = MESH_AXES  # tokens are split over every axis
DEFAULT_EXCHANGE_FACTOR = 1.5


def capacity(tokens: int, ranks: int, capacity_factor: float | None) -> int:
    """Slots per destination rank: T for None, else ceil(f T / n) rounded up to 8 (at most T)."""
    if capacity_factor is None:
        return tokens
    c = math.ceil(capacity_factor * tokens / ranks)
    return min(tokens, -(-c // 8) * 8)


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


def _exchange(x_md, rank_m, slot_m, send_m, local_m, n, cap, gate_up, down, act, local_moe):
    """One round: tokens with `send_m` go to slot `slot_m` (< cap) of rank `rank_m`'s bucket [n, cap,
    d], run on that rank's expert `local_m` and come back. fp32 [T, d], zero for tokens not sent."""
    d, per_rank = x_md.shape[1], gate_up.shape[0]  # gate_up holds this device's E/n experts
    # Ids fit a byte for any realistic E/n; `per_rank` marks an empty slot (the skip class locally).
    id_dtype = jnp.int8 if per_rank < 127 else jnp.int32
    dest = jnp.where(send_m, rank_m, n)  # row n is out of range: mode="drop" sends nothing
    slot = jnp.where(send_m, slot_m, 0)
    send_x = jnp.zeros((n, cap, d), x_md.dtype).at[dest, slot].set(x_md, mode="drop")
    send_id = jnp.full((n, cap), per_rank, id_dtype).at[dest, slot].set(local_m.astype(id_dtype), mode="drop")
    recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0)
    recv_id = jax.lax.all_to_all(send_id, "expert", 0, 0).astype(jnp.int32)
    out = local_moe(recv_x.reshape(n * cap, d), recv_id.reshape(-1), gate_up, down, act)
    back = jax.lax.all_to_all(out.reshape(n, cap, d), "expert", 0, 0)
    return jnp.where(send_m[:, None], back[jnp.minimum(rank_m, n - 1), slot], 0.0)


def _dropless_exchange(x_md, expert_m, num_experts, n, cap, gate_up, down, act, local_moe):
    """The main round with `cap` slots per destination, plus the spill round (T - cap slots) under
    a cond when any bucket of the expert group overflowed. fp32 [T, d]; drops nothing."""
    t = x_md.shape[0]
    rank, slot = _bucket(expert_m, num_experts, n)
    local = expert_m % (num_experts // n)
    routed = rank < n
    main = routed & (slot < cap)
    y = _exchange(x_md, rank, slot, main, local, n, cap, gate_up, down, act, local_moe)
    if cap >= t:
        return y
    spill = routed & ~main
    overflow = jax.lax.pmax(jnp.any(spill).astype(jnp.int32), "expert") > 0

    def spill_round(x, g, dn):
        return _exchange(x, rank, slot - cap, spill, local, n, t - cap, g, dn, act, local_moe)

    no_spill = lambda x, g, dn: jnp.zeros(x.shape, jnp.float32)
    return y + jax.lax.cond(overflow, spill_round, no_spill, x_md, gate_up, down)


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
) -> tuple[jax.Array, jax.Array]:
    """Global tokens [T, d] (split over every mesh axis) and experts [E, ...] (split over "expert")
    -> (y [T, d] fp32, dropped-token count). `local_moe(x, ids, gate_up, down, act)` is the
    single-device dispatch (sparse or dense) applied to each device's received tokens.
    `capacity_factor` None is dropless (main exchange of `exchange_factor` x T/n slots per peer plus
    the spill); a number caps every bucket at that factor and drops the rest."""
    if mesh.size == 1 and capacity_factor is None:
        # One device exchanges nothing. Without shard_map its transpose adds no all-reduce of the
        # expert weight gradients over that one device: XLA:CPU would copy all of them each step.
        return local_moe(x_md, expert_m, gate_up_edf, down_efd, act), jnp.zeros((), jnp.int32)
    num_experts = gate_up_edf.shape[0]
    n = mesh.shape["expert"]

    def per_device(x, expert, gate_up, down):
        t = x.shape[0]
        if capacity_factor is None:
            if n == 1:
                return local_moe(x, expert, gate_up, down, act), jnp.zeros((), jnp.int32)
            cap = capacity(t, n, exchange_factor)
            y = _dropless_exchange(x, expert, num_experts, n, cap, gate_up, down, act, local_moe)
            return y, jnp.zeros((), jnp.int32)
        cap = capacity(t, n, capacity_factor)
        rank, slot = _bucket(expert, num_experts, n)
        kept = (rank < n) & (slot < cap)
        if n == 1:
            y = local_moe(x, jnp.where(kept, expert, num_experts), gate_up, down, act)
        else:
            local = expert % (num_experts // n)
            y = _exchange(x, rank, slot, kept, local, n, cap, gate_up, down, act, local_moe)
        return y, jax.lax.psum(jnp.sum((rank < n) & ~kept), MESH_AXES)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(BATCH, None), P(BATCH), P("expert", None, None), P("expert", None, None)),
        out_specs=(P(BATCH, None), P()),
        check_vma=False,
    )(x_md, expert_m, gate_up_edf, down_efd)
