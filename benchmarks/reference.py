"""The transformers side of the side-by-side benchmarks: one random model held by both frameworks.

    cfg = tiny_config(parse_overrides(["num_hidden_layers=4"]))
    ref = reference_pair(cfg, seed=0, torch_device="auto", threads=0)
    ref.model          # transformers' ZayaForCausalLM (eval), every weight random
    ref.variables      # the same fp32 weights for zaya_jax, read back from the saved HF directory
    ref.device_info    # torch device / versions / threads, for the JSON report

`randomize_weights`: parameters HF initialises to constants
(residual scales and biases, CCA temperatures, norm weights, balancing biases) are drawn at random
too, so a term that one side drops shows in the comparison instead of multiplying by 1 or adding 0.
torch and transformers are imported inside the functions: `--skip-torch` runs never import them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from zaya_jax.runtime import cli


def _cuda_device(text: str) -> str:
    if not re.fullmatch(r"cuda:\d+", text):
        raise ValueError("expected cuda:N")
    return text


TORCH_DEVICE_FLAG = cli.OneOf(
    "auto", "cpu", "cuda", other=cli.Parsed(_cuda_device, "cuda:N", invalid=("cuda:x",)), other_doc="cuda:N"
)


def add_torch_args(p: argparse.ArgumentParser, threads_default: str = "usable cores") -> None:
    """The flags every benchmark with a transformers side takes; `threads_default` says what
    --threads 0 means there."""
    p.add_argument("--skip-torch", action="store_true", help="only our sides (no torch import)")
    p.add_argument(
        "--torch-device",
        type=TORCH_DEVICE_FLAG,
        default="auto",
        help="auto (cuda if available, else cpu) | cpu | cuda[:N]",
    )
    p.add_argument(
        "--threads",
        type=cli.Int(min=0),
        default=0,
        help=f"torch.set_num_threads (0, the default: {threads_default})",
    )
    p.add_argument("--seed", type=cli.Int(min=0), default=0)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--set KEY=VALUE: the tiny model's overrides (parse_overrides)."""
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="ZayaConfig.tiny override, repeatable: --set num_hidden_layers=4 --set hidden_size=128",
    )


def model_report(cfg, overrides: Sequence[str] | None) -> dict[str, Any]:
    """The model part of a report's "config" section: the overrides, parameter counts, every field."""
    from zaya_jax.sizing import param_counts

    counts = param_counts(cfg)
    return {
        "overrides": list(overrides or []),
        "params_total": counts.total,
        "params_active": counts.active,
        "model": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
    }


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """--set KEY=VALUE for ZayaConfig.tiny; values parsed as Python literals, else kept as strings."""
    from zaya_jax.model import ZayaConfig

    fields = {f.name for f in dataclasses.fields(ZayaConfig)}
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key not in fields:
            raise KeyError(f"--set {key}: not a ZayaConfig field")
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    return out


def overrides_or_exit(items: Sequence[str] | None) -> dict[str, Any]:
    """parse_overrides, or exit with a one-line error naming the bad --set (before any work)."""
    try:
        return parse_overrides(items or [])
    except (KeyError, ValueError) as e:
        sys.exit(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}")


def tiny_config(overrides: dict[str, Any]):
    from zaya_jax.model import ZayaConfig

    # initializer_range 0.2 (as tests/support/hf_reference.py): peaked logits and decisive routing, a sharper
    # agreement check than the near-uniform predictions of the 0.02 default
    return ZayaConfig.tiny(**{"vocab_size": 259, "dtype": "float32", "initializer_range": 0.2, **overrides})


def hf_config(cfg):
    """transformers' ZayaConfig for our config (fp32; precision is handled by the torch side)."""
    from transformers import ZayaConfig as HFZayaConfig

    from zaya_jax.hf.config import to_native

    params = inspect.signature(HFZayaConfig.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    d = {
        k: v for k, v in to_native(cfg, "float32").items() if k != "model_type" and (takes_any or k in params)
    }
    return HFZayaConfig(**d)


def randomize_weights(model, seed: int):
    """Draws every constant-initialised parameter and the balancing biases at random (in place)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("scale", "bias", "temp", "norm")):
                base = 1.0 if ("scale" in name or "norm" in name or "temp" in name) else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("balancing_biases"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def resolve_torch_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


@dataclasses.dataclass
class ReferencePair:
    model: Any  # transformers ZayaForCausalLM, eval mode, on `device_info["torch_device"]`
    variables: dict[str, Any]  # zaya_jax {"params", "balancing"}, the same weights
    device_info: dict[str, Any]


def reference_pair(cfg, seed: int, torch_device_name: str = "auto", threads: int = 0) -> ReferencePair:
    """A random transformers model for `cfg` and the same weights loaded by zaya_jax.hf."""
    import torch
    import transformers
    from transformers import ZayaForCausalLM as HFZayaForCausalLM

    from zaya_jax.hf import load_pretrained
    from zaya_jax.hf.config import to_native

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    device = resolve_torch_device(torch_device_name)
    print(f"building the random transformers model on {device}...", file=sys.stderr, flush=True)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = randomize_weights(HFZayaForCausalLM(hf_config(cfg)).eval(), seed)
    with tempfile.TemporaryDirectory(prefix="zaya_bench_") as hf_dir:
        model.save_pretrained(hf_dir)  # fp32 safetensors
        loaded_cfg, variables = load_pretrained(hf_dir)
    # config.json round trip: the same architecture (our compute-only fields stay cfg's)
    if to_native(loaded_cfg, "float32") != to_native(cfg, "float32"):
        raise RuntimeError(f"config changed through the HF directory: {cfg} -> {loaded_cfg}")
    info = {
        "torch_device": device,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "torch_attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    return ReferencePair(model.to(device), variables, info)


def weights(cfg, args: argparse.Namespace) -> tuple[dict[str, Any], ReferencePair | None]:
    """Our variables and the transformers model holding the same weights (add_torch_args' flags);
    with --skip-torch, random variables of ours and no reference (torch is not imported)."""
    if args.skip_torch:
        import jax

        from zaya_jax.model import init_variables

        return init_variables(cfg, jax.random.key(args.seed)), None
    ref = reference_pair(cfg, args.seed, args.torch_device, args.threads)
    return ref.variables, ref
