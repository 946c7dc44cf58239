"""Streaming safetensors I/O (zaya_jax/hf/safetensors_io.py) against the reference library."""

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from zaya_jax.hf.safetensors_io import SafetensorsError, iter_tensors, plan_shards, read_header, write_file


def test_write_is_read_by_reference_library_bf16_and_fp32(tmp_path):
    r = np.random.default_rng(0)
    tensors = {
        "a": r.normal(size=(3, 5)).astype(np.float32),
        "b": r.normal(size=(7,)).astype(ml_dtypes.bfloat16),
        "c": np.arange(4, dtype=np.int64),
    }
    path = str(tmp_path / "x.safetensors")
    write_file(path, [(n, t.shape, t.dtype) for n, t in tensors.items()], tensors.__getitem__)
    ref = load_file(path)
    assert ref["b"].dtype == torch.bfloat16
    for n, t in tensors.items():
        np.testing.assert_array_equal(ref[n].float().numpy(), t.astype(np.float32))


def test_reads_reference_library_files(tmp_path):
    path = str(tmp_path / "y.safetensors")
    t = {"w": torch.randn(4, 6).to(torch.bfloat16), "v": torch.randn(2)}
    save_file(t, path, metadata={"format": "pt"})
    got = dict(iter_tensors(path))
    assert got["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["w"].astype(np.float32), t["w"].float().numpy())
    np.testing.assert_array_equal(got["v"], t["v"].numpy())


def test_corrupt_header_and_declared_shape_mismatch(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json......}")
    with pytest.raises(SafetensorsError, match="corrupt safetensors header"):
        read_header(str(bad))
    with pytest.raises(ValueError, match="declared"):
        write_file(
            str(tmp_path / "z.safetensors"), [("a", (2, 2), np.float32)], lambda n: np.zeros(3, np.float32)
        )
    assert not (tmp_path / "z.safetensors").exists()


def test_plan_shards_respects_the_limit():
    specs = [(f"t{i}", (10,), np.float32) for i in range(10)]  # 40 bytes each
    shards = plan_shards(specs, 100)
    assert [len(s) for s in shards] == [2, 2, 2, 2, 2]
    assert [n for s in shards for n, _, _ in s] == [n for n, _, _ in specs]
    assert len(plan_shards([("big", (1000,), np.float32)], 100)) == 1
