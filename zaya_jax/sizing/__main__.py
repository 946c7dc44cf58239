"""`python -m zaya_jax.sizing --config configs/<name>.py [...]`: the sizing report of a training
config (flags in zaya_jax/sizing/__init__.py)."""

from __future__ import annotations

import json
import math

from zaya_jax.kernels import attention_choice
from zaya_jax.parallel.mesh import MESH_AXES
from zaya_jax.sizing.memory import (
    _DTYPE_BYTES,
    MI300X_MEMORY_GIB,
    REMAT_CHOICES,
    config_micro_batch,
    parse_mesh,
)
from zaya_jax.sizing.report import report


def _define_flags(fv=None):
    """The CLI's flags, on absl's FLAGS (or the FlagValues `fv`); numeric ones declare their range."""
    from absl import flags
    from ml_collections import config_flags

    from zaya_jax.parallel.mesh import MESH_SPEC_FLAG
    from zaya_jax.runtime import cli

    fv = flags.FLAGS if fv is None else fv
    config_flags.DEFINE_config_file(
        "config", None, "Training config file (configs/<name>.py[:arg]).", lock_config=True, flag_values=fv
    )
    cli.define_flag(
        "mesh", None, "data=N,fsdp=N,expert=N (default: the config's mesh section).", MESH_SPEC_FLAG, fv
    )
    cli.define_flag(
        "num_devices", 8, "Devices that a -1 mesh axis fills (default one node of 8).", cli.Int(min=1), fv
    )
    flags.DEFINE_enum(
        "remat", None, list(REMAT_CHOICES), "Remat policy (default: config.model.remat).", flag_values=fv
    )
    cli.define_flag(
        "micro_batch",
        None,
        "Sequences per device per microbatch (default: train.batch_size / train.grad_accum / devices).",
        cli.Int(min=1),
        fv,
    )
    cli.define_flag(
        "device_memory_gib",
        MI300X_MEMORY_GIB,
        "Device memory for the fits-check.",
        cli.Float(min=0, min_open=True),
        fv,
    )
    flags.DEFINE_enum(
        "platform",
        "rocm",
        ["cpu", "cuda", "rocm"],
        "The devices' platform, which resolves model.attention_impl='auto' (default MI300X's).",
        flag_values=fv,
    )
    flags.DEFINE_bool("zero1", True, "Shard the optimizer state over the data axis (ZeRO-1).", flag_values=fv)
    flags.DEFINE_string("json", None, "Also write the numbers as JSON to this path.", flag_values=fv)


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
        step_tokens=c.train.batch_size * seq_len,
        ns_steps=c.optim.muon.ns_steps,
        accumulate=c.train.batch_size > micro_batch * devices // mesh["context"],
        grad_reduce=c.train.grad_reduce,
        attention=attention_choice(cfg.attention_impl, f.platform, seq_len),
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

    from zaya_jax.runtime import cli

    cli.run_absl(main, _define_flags, argv=_normalise_argv(sys.argv))
