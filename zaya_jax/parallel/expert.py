"""Expert parallelism: tokens travel to the device that owns their expert and back (all-to-all).

Inside `shard_map` over the whole mesh, each device holds T tokens (its slice of the batch) and
E/n experts (n = size of the "expert" axis; device r owns experts [r*E/n, (r+1)*E/n)):

  1. bucket the T tokens by owner rank into a send buffer [n, C, d] (C slots per destination;
     skip-class tokens go nowhere);
  2. all_to_all over "expert": device r receives [n, C, d], the tokens every peer sent it;
  3. run its local experts on them (the same `local_moe` dispatch as the single-device path:
     tiled, ragged_dot or Pallas per `moe_impl`);
  4. all_to_all the results back into the senders' slots and un-bucket.

Dropless by default: C = T, so even if every token of a device picks one rank nothing is dropped
(the price is n x T x d buffer traffic). With `capacity_factor` f, C = ceil(f * T / n) rounded up to
a multiple of 8; tokens past a bucket's capacity get a zero expert output (the residual carries
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


def capacity(tokens: int, ranks: int, capacity_factor: float | None) -> int:
    """Slots per destination rank: T for dropless, else ceil(f T / n) rounded up to 8 (at most T)."""
    if capacity_factor is None:
        return tokens
    c = math.ceil(capacity_factor * tokens / ranks)
    return min(tokens, -(-c // 8) * 8)


def _bucket(
    expert_t: jax.Array, num_experts: int, ranks: int, cap: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rank [T] (ranks for skip), slot [T] within the rank's bucket, kept [T] bool)."""
    per_rank = num_experts // ranks
    rank = jnp.where(expert_t < num_experts, expert_t // per_rank, ranks)
    order = jnp.argsort(rank, stable=True)
    sizes = jnp.bincount(rank, length=ranks + 1)
    starts = jnp.cumsum(sizes) - sizes
    slot_sorted = jnp.arange(rank.shape[0]) - starts[rank[order]]
    slot = jnp.zeros_like(slot_sorted).at[order].set(slot_sorted)
    kept = (rank < ranks) & (slot < cap)
    return rank, slot, kept


def expert_parallel_moe(
    x_td: jax.Array,
    expert_t: jax.Array,
    gate_up_edf: jax.Array,
    down_efd: jax.Array,
    act: Callable,
    local_moe: Callable,
    mesh: Mesh,
    capacity_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Global tokens [T, d] (split over every mesh axis) and experts [E, ...] (split over "expert")
    -> (y [T, d] fp32, dropped-token count). `local_moe(x, ids, gate_up, down, act)` is the
    single-device dispatch (sparse or dense) applied to each device's received tokens."""
    num_experts = gate_up_edf.shape[0]
    n = mesh.shape["expert"]

    def per_device(x, expert, gate_up, down):
        t, d = x.shape
        cap = capacity(t, n, capacity_factor)
        rank, slot, kept = _bucket(expert, num_experts, n, cap)
        if n == 1:
            y = local_moe(x, jnp.where(kept, expert, num_experts), gate_up, down, act)
        else:
            local_id = jnp.where(kept, expert % (num_experts // n), num_experts // n)
            send_x = jnp.zeros((n, cap, d), x.dtype).at[rank, slot].set(x, mode="drop")
            send_id = (
                jnp.full((n, cap), num_experts // n, jnp.int32).at[rank, slot].set(local_id, mode="drop")
            )
            recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0)
            recv_id = jax.lax.all_to_all(send_id, "expert", 0, 0)
            out = local_moe(recv_x.reshape(n * cap, d), recv_id.reshape(-1), gate_up, down, act)
            back = jax.lax.all_to_all(out.reshape(n, cap, d), "expert", 0, 0)
            y = jnp.where(kept[:, None], back[jnp.minimum(rank, n - 1), jnp.minimum(slot, cap - 1)], 0.0)
        dropped = jnp.sum((expert < num_experts) & ~kept)
        return y, jax.lax.psum(dropped, MESH_AXES)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(BATCH, None), P(BATCH), P("expert", None, None), P("expert", None, None)),
        out_specs=(P(BATCH, None), P()),
        check_vma=False,
    )(x_td, expert_t, gate_up_edf, down_efd)
