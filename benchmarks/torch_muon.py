"""Muon for transformers' ZayaForCausalLM in PyTorch: the torch side of the like-for-like Muon row of
`benchmarks/train_step.py`.

`torch.optim.Muon` takes 2-D parameters only, and transformers stores each block's experts as one
3-D tensor ([e, 2f, d] and [e, d, f]), so this mirrors our chain (zaya_jax/optim/chain.py) by hand:
the parameters our registry (zaya_jax/params.py) routes to Muon get Nesterov momentum, the same
quintic Newton-Schulz iteration (batched over leading axes, the Gram matrix on the short side, as
zaya_jax.kernels.newton_schulz.orthogonalize), the consistent-RMS scale and decoupled weight decay;
the rest get `torch.optim.AdamW`. The learning rate is constant (`optim.lr` times each group's
multiplier) and there is no clipping: it exists to time the same work, not to train.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

# Nothing of zaya_jax (which imports jax) at import: the torch sides of benchmarks/train_step.py run
# this in a process without jax (benchmarks/isolated.py); the parent names the Muon tensors.


def muon_tensor_names(cfg: Any, ndims: dict[str, int]) -> set[str]:
    """The transformers tensor names (of those in `ndims`: name -> ndim) whose parameter our
    optimizer chain puts on Muon. Ours have one leading axis per stacked index (l, for blocks)."""
    from zaya_jax.hf.names import native_map
    from zaya_jax.params import MUON, optimizer_rule

    return {
        t.hf
        for t in native_map(cfg)
        if t.path[0] == "params"
        and t.hf in ndims
        and optimizer_rule("/".join(t.path[1:]), ndims[t.hf] + len(t.index)).label == MUON
    }


def orthogonalize(x, coeffs: tuple[float, float, float], steps: int, eps: float):
    """Newton-Schulz on each [m, n] slice of x [..., m, n] (torch; the Gram matrix on the short side)."""
    import torch

    a, b, c = coeffs
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        g = x @ x.mT
        x = a * x + (b * g + c * (g @ g)) @ x
    return x.mT if tall else x


def model_muon_names(model: Any, cfg: Any) -> set[str]:
    """muon_tensor_names of a transformers model's parameters (a model on torch's meta device will do)."""
    return muon_tensor_names(cfg, {n: p.ndim for n, p in model.named_parameters()})


class TorchMuonAdamW:
    """Muon on `muon_names` (model_muon_names: the registry's Muon parameters), AdamW on the others,
    with the settings of `optim` (the config's optim section); `step` / `zero_grad` like a torch
    optimizer."""

    def __init__(self, model: Any, optim: ml_collections.ConfigDict, muon_names: set[str]):
        import torch

        named = dict(model.named_parameters())
        if not muon_names or not muon_names <= set(named):
            raise ValueError(f"Muon tensors {sorted(set(muon_names) - set(named))} are not the model's")
        self.muon = [named[n] for n in sorted(muon_names)]
        rest = [p for n, p in named.items() if n not in muon_names]
        a, m = optim.adamw, optim.muon
        self.adamw = torch.optim.AdamW(
            rest, lr=optim.lr * a.lr_multiplier, betas=(a.b1, a.b2), eps=a.eps, weight_decay=a.weight_decay
        )
        self.momentum = [torch.zeros_like(p) for p in self.muon]
        self.lr, self.m = optim.lr * m.lr_multiplier, m
        self.params = list(named.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        m = self.m
        self.adamw.step()
        with torch.no_grad():
            for p, mu in zip(self.muon, self.momentum):
                mu.lerp_(p.grad, 1 - m.beta)  # mu <- beta mu + (1 - beta) g
                u = p.grad.lerp(mu, m.beta) if m.nesterov else mu
                o = orthogonalize(u.float(), tuple(m.ns_coeffs), m.ns_steps, m.eps)
                scale = m.consistent_rms * math.sqrt(max(p.shape[-2:])) if m.consistent_rms else 1.0
                p.mul_(1 - self.lr * m.weight_decay).add_(o.to(p.dtype), alpha=-self.lr * scale)
