"""The tiny train step on a mesh of the 8 simulated CPU devices, built as the trainer builds it (ZeRO-1,
distributed Muon, the balancing biases), and its steps run from one initial state on the same
batches whatever the mesh."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from support.xla_env import FAST_COMPILE
from zaya_jax import config as config_lib
from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.parallel.sharding import batch_sharding
from zaya_jax.training.train_state import TrainProgram, train_program

# 8 layers: the data axis (8 or 4) divides the layer stacks, so every rank owns whole matrices.
CFG = ZayaConfig.tiny(num_hidden_layers=8, vocab_size=128, moe_intermediate_size=32)


def step_config(
    mesh: dict[str, int],
    grad_accum: int,
    grad_reduce: str = "step",
    cfg: ZayaConfig = CFG,
    steps: int = 0,
    overlap: str = "auto",
):
    c = base_config()
    set_model(c, cfg)
    c.train.seq_len, c.train.batch_size, c.train.grad_accum = 32, 8 * grad_accum, grad_accum
    c.train.grad_reduce, c.train.overlap_grad_reduce = grad_reduce, overlap
    c.optim.schedule, c.optim.warmup_steps = "constant", 0  # the first step moves the params
    # AdamW's eps 1e-6 instead of 1e-8: an embedding entry whose gradient sums to ~1e-8 (its
    # tokens' contributions cancel) moves by lr * g / (|g| + eps), and fp32 rounding of that sum
    # differs with the reduction order by a few percent, so its update differed between one device
    # and data=8 by 1.2e-5 (lr 1e-3) on an Intel box: rounding amplified, not a reduction wrong.
    c.optim.adamw.eps = 1e-6
    if steps:
        c.train.steps = steps
    for axis, size in mesh.items():
        c.mesh[axis] = size
    return c


class Step(NamedTuple):
    """A compiled train step and what it was built from."""

    compiled: Any  # jax.stages.Compiled
    program: TrainProgram
    c: Any  # the config
    cfg: ZayaConfig  # the validated model config
    model: ZayaConfig  # the model config it was built from (the initial state's key)

    @property
    def mesh(self):
        return self.program.mesh

    @property
    def state(self):  # the abstract train state it was compiled for
        return self.program.abstract_state()


@functools.cache
def step_program(mesh: tuple[tuple[str, int], ...], grad_accum: int, grad_reduce: str, cfg: ZayaConfig, steps: int):
    """(config, validated model config, train_program) of the tiny train step on as many devices as
    the mesh has: the train step as the trainer builds it (traced, nothing compiled)."""
    c = step_config(dict(mesh), grad_accum, grad_reduce, cfg, steps)
    devices = jax.devices()[: math.prod(size for _, size in mesh)]
    cfg = config_lib.validate(c, "cpu")
    return c, cfg, train_program(c, cfg, mesh_from_config(c, devices=devices))


@functools.cache
def initial_state_on_host(cfg: ZayaConfig):
    """The config's initial train state (train_program's create(), the same seed and values whatever
    the mesh), created once on one device and kept on the host: each mesh's run starts from it laid
    out by its own shardings, so no mesh compiles its own initializer."""
    _, _, program = step_program((("data", 1),), 1, "step", cfg, 0)
    return jax.device_get(jax.jit(program.create).lower().compile(FAST_COMPILE)())


def run_steps(step: Step, steps: int):
    """(losses, grad norms, final state) of `steps` steps of the compiled train step from the
    config's initial state, on the same random batches whatever the mesh."""
    c, cfg, program = step.c, step.cfg, step.program
    host = initial_state_on_host(step.model)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(host) == shapes(program.abstract_state())
    state = jax.device_put(host, program.shardings)
    rng = np.random.default_rng(0)
    losses, norms = [], []
    for _ in range(steps):
        ids = rng.integers(3, cfg.vocab_size, size=(c.train.batch_size, c.train.seq_len + 1))
        batch = {
            "input_ids": ids[:, :-1].astype(np.int32),
            "targets": ids[:, 1:].astype(np.int32),
            "loss_mask": (rng.random((c.train.batch_size, c.train.seq_len)) > 0.2).astype(np.float32),
        }
        batch = jax.device_put(batch, batch_sharding(program.mesh))
        state, metrics = step.compiled(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, state


# Two layers: the layer stacks divide among neither the data ranks nor distributed Muon's owners, so
# each matrix stack is padded and moved (zaya_jax/parallel/zero1.py, owned_orthogonalize).
MESH_CFG = ZayaConfig.tiny(num_hidden_layers=2, vocab_size=128, moe_intermediate_size=32)
MESH_STEPS = 3


DATA4_EXPERT2, DATA4_FSDP2 = (4, 1, 2, 1), (4, 2, 1, 1)  # (data, fsdp, expert, context)
