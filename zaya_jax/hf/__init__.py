"""Hugging Face checkpoints in and out: `load_pretrained(dir)` and `save_pretrained(cfg, vars, dir)`.

    from zaya_jax import hf, model
    cfg, variables = hf.load_pretrained(path)        # native or legacy ZAYA1 layout
    out = model.ZayaForCausalLM(cfg).apply(variables, input_ids, attention_mask=None)
    hf.save_pretrained(cfg, variables, path, dtype="bfloat16")   # what transformers loads

Both directions stream tensor by tensor (see safetensors_io.py): import fills preallocated arrays
of our layout; export converts one tensor, writes it, drops it. Names and layout transforms come from
the parameter registry (zaya_jax/params.py), expanded per block in names.py; a variable the registry
does not list is an error, never silently left out.
"""

from __future__ import annotations

import json
import os
from typing import Any

import flax
import jax
import ml_dtypes
import numpy as np

from zaya_jax.hf import config as hf_config
from zaya_jax.hf.names import TensorMap, check_registered, is_legacy, legacy_map, native_map
from zaya_jax.hf.safetensors_io import SafetensorsError, iter_tensors, plan_shards, read_header, write_file
from zaya_jax.model.config import ZayaConfig
from zaya_jax.model.transformer import init_variables
from zaya_jax.runtime import output_dir

__all__ = ["SafetensorsError", "load_pretrained", "save_pretrained"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Routing decisions hinge on the balancing biases; they stay fp32 whatever the export dtype.
FP32_TENSOR_SUFFIXES = ("balancing_biases",)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    for f in files:
        if not os.path.exists(os.path.join(path, f)):
            raise FileNotFoundError(f"{path}: shard {f} named in {INDEX_FILE} is missing")
    return [os.path.join(path, f) for f in files]


def load_pretrained(
    path: str, *, param_dtype: str = "float32", **config_overrides
) -> tuple[ZayaConfig, dict]:
    """Reads an HF ZAYA1 directory (config.json + safetensors, sharded or not, native or legacy).

    Returns (ZayaConfig, variables) with variables = {"params": ..., "balancing": ...} as jax arrays.
    `config_overrides` set our compute fields (dtype, moe_impl, remat, ...). Raises ValueError naming
    the tensor for unknown, missing or mis-shaped tensors.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF checkpoint directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path}: config.json not found")
    with open(config_path) as f:
        raw_cfg = json.load(f)
    files = _safetensors_files(path)
    shapes = {}
    for file in files:
        shapes.update({n: tuple(i["shape"]) for n, i in read_header(file)[0].items()})
    cfg, by_name, ignorable = _checkpoint_table(
        path, raw_cfg, shapes, {"param_dtype": param_dtype, **config_overrides}
    )
    arrays = _allocate(cfg)
    for file in files:
        _fill(file, by_name, ignorable, arrays)
    variables = {}
    for key in list(arrays):  # hand arrays to jax one by one, never holding two full copies
        variables[key] = jax.numpy.asarray(arrays.pop(key))
    return cfg, flax.traverse_util.unflatten_dict(variables)


def _checkpoint_table(
    path: str, raw_cfg: dict, shapes: dict[str, tuple[int, ...]], overrides: dict
) -> tuple[ZayaConfig, dict[str, TensorMap], set[str]]:
    """(config, its tensors by HF name, names to skip) of a checkpoint whose tensors have `shapes`;
    ValueError naming unknown or missing tensors."""
    if is_legacy(shapes):
        cfg = hf_config.from_legacy(raw_cfg, shapes, **overrides)
        table = legacy_map(cfg)
    else:
        cfg = hf_config.from_native(raw_cfg, **overrides)
        table = native_map(cfg)
    by_name = {m.hf: m for m in table}
    if not cfg.tie_word_embeddings or "lm_head.weight" in by_name:
        ignorable = set()
    else:
        ignorable = {"lm_head.weight"}  # a tied head some writers store anyway
    unknown = sorted(set(shapes) - set(by_name) - ignorable)
    if unknown:
        raise ValueError(
            f"{path}: unknown tensor(s) for this ZAYA config: {unknown[:10]}"
            f"{' ...' if len(unknown) > 10 else ''}"
        )
    missing = sorted(set(by_name) - set(shapes))
    if missing:
        raise ValueError(f"{path}: missing tensor(s): {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return cfg, by_name, ignorable


def _fill(file: str, by_name: dict[str, TensorMap], ignorable: set[str], arrays: dict) -> None:
    """Copies every tensor of one safetensors file into its place in our preallocated `arrays`."""
    for name, tensor in iter_tensors(file):
        if name in ignorable:
            continue
        m = by_name[name]
        dest = arrays[m.path]
        value = m.transform.from_hf(tensor)
        want = dest.shape[len(m.index) :]
        if value.shape != want:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                f"{tuple(m.transform.to_hf(np.empty(want, np.float32)).shape)} for this config"
            )
        dest[m.index] = value.astype(dest.dtype)


def _allocate(cfg: ZayaConfig) -> dict[tuple[str, ...], np.ndarray]:
    """Empty numpy arrays of our layout; defaults for what no HF tensor supplies (block 0's EDA scale)."""
    shapes = flax.traverse_util.flatten_dict(jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0))))
    check_registered(shapes)  # an unlisted variable would stay uninitialised memory
    arrays = {k: np.empty(v.shape, np.dtype(v.dtype)) for k, v in shapes.items()}
    eda = ("params", "layers", "mlp", "gate", "router_states_scale")
    arrays[eda][0] = 1.0
    return arrays


def save_pretrained(
    cfg: ZayaConfig,
    variables: dict,
    path: str,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Writes `variables` as a transformers ZayaForCausalLM directory (native layout).

    config.json, generation_config.json and model.safetensors (or model-0000i-of-0000n.safetensors +
    model.safetensors.index.json past `max_shard_bytes`). `path` must be new or an empty directory;
    an existing file or non-empty directory is replaced only with `overwrite=True` (else
    cli.UserError). The directory is assembled beside `path` and moved into place at the end
    (zaya_jax.runtime.output_dir), so an interrupted export never leaves a half-written checkpoint.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"save_pretrained: dtype {dtype!r} not in {sorted(EXPORT_DTYPES)}")
    if cfg.skip_expert_output != "zero":
        raise ValueError(
            "save_pretrained: skip_expert_output='weighted_input' (legacy ZAYA1-base "
            "behaviour) cannot be expressed by transformers' native ZayaForCausalLM"
        )
    flat = flax.traverse_util.flatten_dict(variables)
    _check_variables(cfg, flat)
    table = native_map(cfg)
    by_name = {m.hf: m for m in table}

    def export_dtype(m: TensorMap):
        return np.float32 if m.hf.endswith(FP32_TENSOR_SUFFIXES) else EXPORT_DTYPES[dtype]

    def produce(name: str) -> np.ndarray:
        m = by_name[name]
        return m.transform.to_hf(np.asarray(flat[m.path][m.index] if m.index else flat[m.path]))

    def hf_shape(m: TensorMap) -> tuple[int, ...]:
        slice_shape = tuple(flat[m.path].shape[len(m.index) :])
        return tuple(m.transform.to_hf(np.empty(slice_shape, np.float32)).shape)

    specs = [(m.hf, hf_shape(m), np.dtype(export_dtype(m))) for m in table]
    with output_dir.staged(
        path, flag="save_pretrained: path", overwrite=overwrite, last=("config.json",)
    ) as tmp:
        _write_directory(tmp, cfg, dtype, plan_shards(specs, max_shard_bytes), produce)


def _check_variables(cfg: ZayaConfig, flat: dict[tuple[str, ...], Any]) -> None:
    """ValueError unless `flat` has every variable of `cfg` with its shape and nothing the
    parameter registry does not list (it would be silently left out of the checkpoint)."""
    check_registered(flat, "save_pretrained")
    expected = flax.traverse_util.flatten_dict(jax.eval_shape(lambda: init_variables(cfg, jax.random.key(0))))
    for key, spec in expected.items():
        if key not in flat:
            raise ValueError(f"save_pretrained: variable {'/'.join(key)} is missing")
        if tuple(flat[key].shape) != tuple(spec.shape):
            raise ValueError(
                f"save_pretrained: variable {'/'.join(key)} has shape {tuple(flat[key].shape)}, "
                f"config expects {tuple(spec.shape)}"
            )


def _write_directory(tmp: str, cfg: ZayaConfig, dtype: str, shards: list, produce) -> None:
    """Safetensors shards (+ index past one), config.json and generation_config.json into `tmp`."""
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(os.path.join(tmp, fname), shard, produce)
        weight_map.update({name: fname for name, _, _ in shard})
    if len(shards) > 1:
        _write_json(
            os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    _write_json(os.path.join(tmp, "config.json"), hf_config.to_native(cfg, dtype))
    _write_json(
        os.path.join(tmp, "generation_config.json"),
        {
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "transformers_version": hf_config.TRANSFORMERS_VERSION,
        },
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
