"""The torch side of `benchmarks/train_step.py`: transformers' ZayaForCausalLM, forward with labels +
backward + `torch.optim.AdamW`, or with `muon_names` our optimizer chain's Muon / AdamW split
(benchmarks/torch_muon.py), or with `sgd` plain `torch.optim.SGD` (the model's own cost).

Nothing here imports jax: the side runs in a process of its own that holds what a torch user's
process holds (benchmarks/isolated.py), so its peak RSS is torch's. The parent gives it plain inputs:
transformers' config (`benchmarks.reference.hf_config`), the config's optim section and the Muon
tensor names (`torch_muon.model_muon_names`, from our registry).
"""

from __future__ import annotations

import time
from typing import Any

import ml_collections
import numpy as np

TORCH, TORCH_MUON, TORCH_SGD = "torch", "torch_muon", "torch_sgd"


def side_name(muon: bool, sgd: bool) -> str:
    """The row a torch side reports: torch_sgd, torch_muon (our Muon / AdamW split) or torch (AdamW)."""
    return TORCH_SGD if sgd else TORCH_MUON if muon else TORCH


class TorchSide:
    """One torch training step on a fixed batch `ids` [B, S], `grad_accum` microbatches."""

    JAX_FREE = True  # benchmarks.isolated starts it in a process that imports no jax

    def __init__(
        self,
        hf_config: Any,
        optim: ml_collections.ConfigDict,
        ids: np.ndarray,
        seed: int,
        device: str,
        dtype: str,
        precision: str,
        threads: int,
        grad_accum: int,
        muon_names: set[str] | None = None,
        sgd: bool = False,
    ):
        import torch
        from transformers import ZayaForCausalLM as HFZayaForCausalLM

        self.name = side_name(muon_names is not None, sgd)
        self.torch = torch
        if threads:  # 0: torch's own default, as a user's script runs
            torch.set_num_threads(threads)
        self.threads, self.devices = torch.get_num_threads(), 1
        torch.manual_seed(seed)
        self.device = torch.device(device)
        t0 = time.perf_counter()
        model = HFZayaForCausalLM(hf_config).to(self.device)
        bf16 = dtype == "bfloat16"
        if bf16 and precision == "pure":
            model = model.to(torch.bfloat16)
        model.train()
        self.model = model
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)
        self.autocast = bf16 and precision == "autocast"
        self.precision = (
            "float32"
            if not bf16
            else "fp32 params + torch.autocast(bfloat16)"
            if self.autocast
            else "pure bfloat16 params"
        )
        self.opt = _optimizer(model, optim, muon_names, sgd)
        self.grad_accum = grad_accum
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        self.init_s = time.perf_counter() - t0
        self.compile_s = None
        self._loss = None

    def _step(self) -> None:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in self.ids.chunk(self.grad_accum, dim=0):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                out = self.model(input_ids=mb, labels=mb, use_cache=False)
            loss = out.loss / self.grad_accum
            loss.backward()
            total = total + loss.detach()
        self.opt.step()
        self._loss = total

    def run(self, n: int) -> None:
        for _ in range(n):
            self._step()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def loss(self) -> float | None:
        return None if self._loss is None else float(self._loss)


def _optimizer(model: Any, optim: ml_collections.ConfigDict, muon_names: set[str] | None, sgd: bool) -> Any:
    """The side's update: plain SGD at optim.lr, our Muon / AdamW split, or AdamW on everything."""
    import torch

    from benchmarks.torch_muon import TorchMuonAdamW

    if sgd:
        return torch.optim.SGD(model.parameters(), lr=optim.lr)
    if muon_names is not None:
        return TorchMuonAdamW(model, optim, muon_names)
    a = optim.adamw
    return torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=(a.b1, a.b2), eps=a.eps, weight_decay=a.weight_decay
    )
