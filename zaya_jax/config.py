"""The one training configuration schema (ml_collections), validated once at start-up.

`configs/<name>.py` files call `base_config()` and change what they need; the command line
overrides any key (`--config.train.steps=100`). Every key and its meaning: docs/reference/config.md.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from zaya_jax.data.ramp import parse_batch_ramp
from zaya_jax.data.tasks import parse_data_spec
from zaya_jax.model.config import ZayaConfig
from zaya_jax.optim.balancing import BalancingConfig
from zaya_jax.optim.balancing import from_config as balancing_from_config
from zaya_jax.optim.chain import default_optim_config
from zaya_jax.optim.schedules import DECAY_SHAPES, SCHEDULE_NAMES
from zaya_jax.parallel.context import CONTIGUOUS, LAYOUTS
from zaya_jax.parallel.mesh import DEFAULT_SIZES, MESH_AXES, check_mesh_sizes
from zaya_jax.parallel.overlap import OVERLAP_GRAD_REDUCE, OVERLAP_PARAM_GATHER
from zaya_jax.parallel.zero1 import GRAD_REDUCE, GRAD_REDUCE_DTYPES
from zaya_jax.runtime import cli

Section = ml_collections.ConfigDict


def base_config() -> ml_collections.ConfigDict:
    """Every key with its default; config files override, nothing adds keys."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = Section(_model_fields(ZayaConfig.tiny()))
    c.data = Section(
        {
            "path": config_dict.placeholder(str),
            "mixture": config_dict.placeholder(str),
            "tokenizer": config_dict.placeholder(str),
            "eval_fraction": 0.01,
            "split_seed": 0,
            "num_threads": 2,
            "prefetch": 4,
            "allow_path_change": False,
        }
    )
    c.train = Section(
        {
            "steps": 1000,
            "batch_size": 16,
            "seq_len": 256,
            "grad_accum": 1,
            "grad_reduce": "step",
            "grad_reduce_dtype": "float32",
            # Each block's gradients reduce-scattered in the last microbatch's backward, hidden
            # behind the blocks still to run: "auto" = on GPU meshes.
            "overlap_grad_reduce": "auto",
            # Each block's weights gathered in the first microbatch's forward: "auto" = on GPU
            # meshes without fsdp or expert parallelism.
            "overlap_param_gather": "auto",
            "init_from": config_dict.placeholder(str),
            "allow_schedule_change": False,
            "batch_ramp": config_dict.placeholder(str),
            "sync_every_step": False,
            "reuse_host_memory": True,
            "lean_cpu_compile": True,
        }
    )
    c.optim = default_optim_config()
    c.balancing = _balancing_section()
    c.mesh = _mesh_section()
    c.checkpoint = Section(
        {"every_steps": 500, "keep": 3, "keep_period": 0, "every_minutes": 0.0, "allow_fresh_start": False}
    )
    c.fault = _fault_section()
    c.eval = Section(
        {
            "every_steps": 200,
            "batches": 0,
            "batch_size": 16,
            "tasks": (),
            "task_limit": 0,
            "task_max_len": 0,
            "harness_tasks": (),
            "harness_include_path": config_dict.placeholder(str),
        }
    )
    c.logging = Section({"every_steps": 10, "tensorboard": True, "console": True, "dead_expert_window": 100})
    return c


def _balancing_section() -> ml_collections.ConfigDict:
    """`enabled` plus one key per BalancingConfig field, with its default (so every field can be
    set from a config or the command line)."""
    section = Section({"enabled": True})
    hints = typing.get_type_hints(BalancingConfig)
    for f in dataclasses.fields(BalancingConfig):
        if f.default is None:  # typed placeholder: `float | None` -> float
            typ = next(t for t in typing.get_args(hints[f.name]) if t is not type(None))
            section[f.name] = config_dict.placeholder(typ)
        else:
            section[f.name] = f.default
    return section


def _mesh_section() -> ml_collections.ConfigDict:
    section = Section({a: DEFAULT_SIZES.get(a, 1) for a in MESH_AXES})
    section.zero1 = True  # optimizer state split over the data axis
    section.context_layout = CONTIGUOUS
    return section


def _fault_section() -> ml_collections.ConfigDict:
    return Section(
        {
            "step_timeout_s": 0.0,
            "spike_zscore": 6.0,
            "spike_window": 50,
            "spike_min_jump": 0.2,
            "spike_confirm": True,
            "max_bad_steps": 5,
            "inject_nan_at_steps": (),
            "inject_spike_at_steps": (),
        }
    )


def _model_fields(cfg: ZayaConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    # ConfigDict cannot hold None for a typed field without a placeholder; keep the types explicit.
    for name, typ in (
        ("layer_types", list),
        ("sliding_window", int),
        ("pad_token_id", int),
        ("bos_token_id", int),
        ("eos_token_id", int),
    ):
        d[name] = config_dict.placeholder(typ) if d[name] is None else d[name]
    return d


def model_config(c: ml_collections.ConfigDict) -> ZayaConfig:
    """The validated ZayaConfig of a training config (ValueError names the bad `model.` key)."""
    d = c.model.to_dict()
    try:
        return ZayaConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        text = str(e)  # ZayaConfig names its field as ZayaConfig.<name>: here it is config.model.<name>
        if text.startswith("ZayaConfig."):
            raise ValueError("config.model." + text[len("ZayaConfig.") :]) from None
        raise ValueError(f"config.model: {text}") from None


_FRACTION = cli.Float(min=0.0, max=1.0)
_BETA = cli.Float(min=0.0, max=1.0, max_open=True)
_NON_NEGATIVE = cli.Float(min=0.0)
_DTYPE = cli.OneOf("float32", "bfloat16")
# Keys whose values are declared as a CLI flag's are (zaya_jax/runtime/cli.py); the other keys are checked
# below or by their section's own code (ZayaConfig, BalancingConfig, the mesh). None (a placeholder
# left unset) is always allowed.
DECLARED_VALUES: dict[str, cli.FlagValue] = {
    "seed": cli.Int(min=0),
    "train.grad_reduce": cli.OneOf(*GRAD_REDUCE),
    "train.grad_reduce_dtype": cli.OneOf(*GRAD_REDUCE_DTYPES),
    "train.overlap_grad_reduce": cli.OneOf(*OVERLAP_GRAD_REDUCE),
    "train.overlap_param_gather": cli.OneOf(*OVERLAP_PARAM_GATHER),
    "mesh.context_layout": cli.OneOf(*LAYOUTS),
    "model.pad_token_id": cli.Int(min=0),
    "model.bos_token_id": cli.Int(min=0),
    "model.eos_token_id": cli.Int(min=0),
    "optim.schedule": cli.OneOf(*SCHEDULE_NAMES),
    "optim.decay_shape": cli.OneOf(*DECAY_SHAPES),
    "optim.decay_fraction": _FRACTION,
    "optim.final_lr_fraction": _FRACTION,
    "optim.clip_grad_norm": _NON_NEGATIVE,
    "optim.adamw.b1": _BETA,
    "optim.adamw.b2": _BETA,
    "optim.adamw.eps": _NON_NEGATIVE,
    "optim.adamw.weight_decay": _NON_NEGATIVE,
    "optim.adamw.lr_multiplier": _NON_NEGATIVE,
    "optim.muon.beta": _BETA,
    "optim.muon.ns_steps": cli.Int(min=1),
    "optim.muon.ns_dtype": _DTYPE,
    "optim.muon.ns_impl": cli.OneOf("xla", "pallas", "auto"),
    "optim.muon.mu_dtype": _DTYPE,
    "optim.muon.eps": _NON_NEGATIVE,
    "optim.muon.consistent_rms": cli.Float(min=0.0, min_open=True),
    "optim.muon.weight_decay": _NON_NEGATIVE,
    "optim.muon.lr_multiplier": _NON_NEGATIVE,
}


def _validate_declared(c: ml_collections.ConfigDict) -> None:
    for key, values in DECLARED_VALUES.items():
        value = c
        for part in key.split("."):
            value = value[part]
        _check(
            value is None or (not isinstance(value, bool) and values.accepts(value)),
            key,
            f"must be {values.describe()}, got {value!r}",
        )


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ValueError(f"config.{key}: {message}")


def validate(c: ml_collections.ConfigDict, platform: str | None = None) -> ZayaConfig:
    """Checks the whole config once, before anything is built. Returns the model config.
    platform: of the devices the run compiles for (zaya_jax.parallel.mesh.device_platform; the dry
    run's target); None: the default device's, looked up only if a kernel is set to 'pallas'."""
    _validate_keys(c)
    _validate_declared(c)
    cfg = model_config(c)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = c.model[key]
        _check(
            value is None or value < cfg.vocab_size,
            f"model.{key}",
            f"{value} is not a token id of model.vocab_size={cfg.vocab_size}",
        )
    # A Pallas choice for devices without the Triton lowering fails here, not inside jit ("auto"
    # falls back to XLA there, so only an explicit 'pallas' needs the devices' platform).
    impls = (cfg.attention_impl, cfg.moe_impl, c.optim.muon.ns_impl)
    if "pallas" in impls:
        from zaya_jax.kernels import check_backend
        from zaya_jax.parallel.mesh import mesh_platform

        check_backend(platform or mesh_platform(None), *impls)
    _validate_train(c, cfg)
    _validate_data(c)
    _validate_optim(c)
    _validate_mesh(c)
    _validate_counts(c)
    _validate_fault(c)
    _validate_eval(c)
    _validate_balancing(c)
    return cfg


def _validate_keys(c: ml_collections.ConfigDict) -> None:
    base = base_config()
    unknown = _unknown_keys(c, base)
    _check(
        not unknown,
        unknown[0] if unknown else "",
        "unknown key" + (_near(unknown[0], base) if unknown else ""),
    )


def _validate_train(c: ml_collections.ConfigDict, cfg: ZayaConfig) -> None:
    t = c.train
    for key in ("steps", "batch_size", "seq_len", "grad_accum"):
        value = t[key]
        _check(isinstance(value, int) and value > 0, f"train.{key}", f"must be a positive int, got {value!r}")
    _check(
        t.batch_size % t.grad_accum == 0,
        "train.grad_accum",
        f"batch_size={t.batch_size} is not divisible by grad_accum={t.grad_accum}",
    )
    _check(
        t.seq_len <= cfg.max_position_embeddings,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_position_embeddings={cfg.max_position_embeddings}",
    )
    for key in ("sync_every_step", "reuse_host_memory", "lean_cpu_compile", "allow_schedule_change"):
        _check(isinstance(t[key], bool), f"train.{key}", f"must be True or False, got {t[key]!r}")


def _validate_optim(c: ml_collections.ConfigDict) -> None:
    steps = c.train.steps
    _check(c.optim.lr > 0, "optim.lr", f"must be > 0, got {c.optim.lr}")
    _check(
        0 <= c.optim.warmup_steps <= steps,
        "optim.warmup_steps",
        f"must be in [0, train.steps={steps}], got {c.optim.warmup_steps}; for a {steps}-step run "
        f"pass e.g. --config.optim.warmup_steps={steps // 10}",
    )
    # The schedule checks how its phases fit together (e.g. warmup + decay <= steps); building it
    # here reports a bad combination at start-up, under the config keys the user sets.
    from zaya_jax.optim.chain import lr_schedule

    try:
        lr_schedule(c.optim, steps)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.optim (schedule={c.optim.schedule!r}, train.steps={steps}): {e}") from None


def _validate_mesh(c: ml_collections.ConfigDict) -> None:
    """Each axis a positive int or -1, at most one -1; the device count is checked when the mesh is
    built (zaya_jax.parallel.mesh)."""
    try:
        check_mesh_sizes({a: c.mesh[a] for a in MESH_AXES})
    except ValueError as e:
        raise ValueError(f"config.{e}") from None


def _validate_counts(c: ml_collections.ConfigDict) -> None:
    for key in (
        "checkpoint.every_steps",
        "checkpoint.keep",
        "checkpoint.keep_period",
        "fault.spike_window",
        "fault.max_bad_steps",
        "eval.every_steps",
        "eval.batches",
        "eval.batch_size",
        "eval.task_limit",
        "eval.task_max_len",
        "logging.every_steps",
        "logging.dead_expert_window",
        "data.num_threads",
        "data.prefetch",
    ):
        section, name = key.split(".")
        value = c[section][name]
        _check(isinstance(value, int) and value >= 0, key, f"must be an int >= 0, got {value!r}")
    for key in (
        "checkpoint.every_minutes",
        "fault.step_timeout_s",
        "fault.spike_zscore",
        "fault.spike_min_jump",
    ):
        section, name = key.split(".")
        value = c[section][name]
        _check(isinstance(value, (int, float)) and value >= 0, key, f"must be a number >= 0, got {value!r}")
    for key in ("every_steps", "dead_expert_window"):
        _check(c.logging[key] > 0, f"logging.{key}", f"must be > 0, got {c.logging[key]}")


def _validate_fault(c: ml_collections.ConfigDict) -> None:
    _check(
        isinstance(c.fault.spike_confirm, bool),
        "fault.spike_confirm",
        f"must be True or False, got {c.fault.spike_confirm!r}",
    )
    _check(
        c.fault.spike_zscore == 0 or c.fault.spike_window >= 2,
        "fault.spike_window",
        f"must be >= 2 when spike detection is on, got {c.fault.spike_window}",
    )
    for key in ("inject_nan_at_steps", "inject_spike_at_steps"):
        value = c.fault[key]
        _check(
            isinstance(value, (tuple, list)) and all(isinstance(v, int) and v > 0 for v in value),
            f"fault.{key}",
            f"must be a list of positive ints, got {value!r}",
        )


def _validate_eval(c: ml_collections.ConfigDict) -> None:
    _check(
        isinstance(c.eval.tasks, (tuple, list)) and all(isinstance(t, str) for t in c.eval.tasks),
        "eval.tasks",
        f"must be a list of data specs (strings), got {c.eval.tasks!r}",
    )
    for i, spec in enumerate(c.eval.tasks):
        try:
            parse_data_spec(spec)
        except (OSError, ValueError) as e:
            raise ValueError(f"config.eval.tasks[{i}]: {e}") from None
    tasks = c.eval.harness_tasks
    _check(
        isinstance(tasks, (tuple, list)) and all(isinstance(t, str) and t.strip() for t in tasks),
        "eval.harness_tasks",
        f"must be a list of lm-evaluation-harness task names, got {tasks!r}",
    )
    path = c.eval.harness_include_path
    _check(
        path is None or os.path.isdir(path),
        "eval.harness_include_path",
        f"{path!r} is not a directory (of lm-evaluation-harness task YAML files)",
    )
    _check(
        path is None or bool(tasks),
        "eval.harness_include_path",
        "is set but eval.harness_tasks is empty: name the tasks to run",
    )


def _validate_balancing(c: ml_collections.ConfigDict) -> None:
    _check(c.balancing.lr > 0, "balancing.lr", "must be > 0 (set balancing.enabled=False to turn it off)")
    _check(
        isinstance(c.balancing.enabled, bool),
        "balancing.enabled",
        f"must be True or False, got {c.balancing.enabled!r}",
    )
    try:
        balancing_from_config(c.balancing)
    except (TypeError, ValueError) as e:
        text = str(e)  # BalancingConfig names a field as "balancing <name>"
        if text.startswith("balancing "):
            raise ValueError("config.balancing." + text[len("balancing ") :]) from None
        raise ValueError(f"config.balancing: {text}") from None


def _validate_data(c: ml_collections.ConfigDict) -> None:
    """data.mixture (format, prepared directories, one tokenizer) and train.batch_ramp (the rule's
    arithmetic and grad_accum; the mesh is checked when the trainer has built it)."""
    allow = c.data.allow_path_change
    _check(isinstance(allow, bool), "data.allow_path_change", f"must be True or False, got {allow!r}")
    try:
        ramp = parse_batch_ramp(c.train.batch_ramp, c.train.batch_size)
        ramp.check_divisible(devices=1, grad_accum=c.train.grad_accum)
    except ValueError as e:
        raise ValueError(f"config.train.batch_ramp: {e}") from None
    fraction, seed = c.data.eval_fraction, c.data.split_seed
    _check(0.0 <= fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {fraction}")
    _check(isinstance(seed, int) and seed >= 0, "data.split_seed", f"must be an int >= 0, got {seed!r}")
    if not c.data.mixture:
        return
    _check(not c.data.path, "data.mixture", "set either data.path or data.mixture, not both")
    from zaya_jax.data.megatron import MegatronOptions  # deferred: loads grain
    from zaya_jax.data.mixture import check_sources, parse_mixture

    try:
        check_sources(parse_mixture(c.data.mixture), MegatronOptions.of(c.data))
    except (OSError, ValueError) as e:
        raise ValueError(f"config.data.mixture: {e}") from None


def _near(key: str, base: ml_collections.ConfigDict) -> str:
    """' (did you mean config.X?)' for the known key nearest to an unknown one."""
    from zaya_jax.runtime.cli import near_key

    def leaves(c: ml_collections.ConfigDict, prefix: str) -> list[str]:
        return [
            k2
            for k, v in c.items()
            for k2 in (
                leaves(v, f"{prefix}{k}.") if isinstance(v, ml_collections.ConfigDict) else [f"{prefix}{k}"]
            )
        ]

    return near_key(key, leaves(base, ""), prefix="config.")


def _unknown_keys(c: Any, base: Any, prefix: str = "") -> list[str]:
    out = []
    for key in c:
        path = f"{prefix}{key}"
        if key not in base:
            out.append(path)
        elif isinstance(c[key], ml_collections.ConfigDict) and isinstance(
            base[key], ml_collections.ConfigDict
        ):
            out += _unknown_keys(c[key], base[key], path + ".")
    return out


def set_model(c: ml_collections.ConfigDict, cfg: ZayaConfig) -> None:
    """Writes a ZayaConfig into `c.model` (config files use this with the ZayaConfig presets)."""
    fields = _model_fields(cfg)
    for f in dataclasses.fields(ZayaConfig):
        c.model[f.name] = fields[f.name]


def from_json(d: dict[str, Any]) -> ml_collections.ConfigDict:
    """Rebuilds a training config from its JSON form (the `config` item saved with every checkpoint):
    base_config() with every saved key applied (lists back to tuples where the schema has tuples)."""
    c = base_config()
    _apply(c, d, "")
    return c


def _apply(c: ml_collections.ConfigDict, d: dict[str, Any], prefix: str) -> None:
    for key, value in d.items():
        if key not in c:
            raise ValueError(f"saved config: unknown key {prefix}{key}")
        if isinstance(c[key], ml_collections.ConfigDict):
            _apply(c[key], value, f"{prefix}{key}.")
            continue
        if isinstance(c[key], tuple) and isinstance(value, list):
            value = tuple(value)
        if isinstance(c[key], float) and isinstance(value, int):
            value = float(value)
        c[key] = value


def with_absolute_paths(d: dict[str, Any]) -> dict[str, Any]:
    """The JSON form of a config with data.path, data.mixture's paths and train.init_from made
    absolute (from the current directory): what a checkpoint saves, so that its workdir's commands
    read the same files from any directory."""
    absolute = lambda p: p if not p or p == "embedded" else os.path.abspath(os.path.expanduser(p))
    data, train = d.get("data", {}), d.get("train", {})
    if data.get("path"):
        data["path"] = absolute(data["path"])
    if data.get("mixture"):
        entries = [e.strip().rpartition(":") for e in str(data["mixture"]).split(",") if e.strip()]
        data["mixture"] = ",".join(f"{absolute(p)}{sep}{w}" for p, sep, w in entries)
    if train.get("init_from"):
        train["init_from"] = absolute(train["init_from"])
    return d
