"""zaya_jax.runtime.xla_flags: XLA_FLAGS as tokens (the trainer's lean compile, the dry run's and the
benchmarks' simulated devices all edit it through this)."""

import os

from zaya_jax.runtime import xla_flags

COUNT = xla_flags.DEVICE_COUNT


def test_value_is_the_last_token_naming_the_flag():
    assert xla_flags.value("", COUNT) is None
    assert xla_flags.value(f"{COUNT}=2 --other=1 {COUNT}=8", COUNT) == "8"
    assert xla_flags.value("--xla_cpu_use_fusion_emitters", "--xla_cpu_use_fusion_emitters") == "true"
    assert xla_flags.value(f"{COUNT}_not=3", COUNT) is None  # a longer name is another flag


def test_with_flag_keeps_a_given_value_unless_replacing():
    assert xla_flags.with_flag("", COUNT, 4) == f"{COUNT}=4"
    assert xla_flags.with_flag("--a=1", COUNT, 4) == f"--a=1 {COUNT}=4"
    assert xla_flags.with_flag(f"--a=1 {COUNT}=2", COUNT, 4) == f"--a=1 {COUNT}=2"
    assert xla_flags.with_flag(f"{COUNT}=2 --a=1 {COUNT}", COUNT, 4, replace=True) == f"--a=1 {COUNT}=4"


def test_set_flag_edits_the_environment(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--a=1")
    assert xla_flags.set_flag(COUNT, 3) == "3" and os.environ["XLA_FLAGS"] == f"--a=1 {COUNT}=3"
    assert xla_flags.set_flag(COUNT, 5) == "3" and xla_flags.current(COUNT) == "3"
    assert xla_flags.set_flag(COUNT, 5, replace=True) == "5" and os.environ["XLA_FLAGS"] == f"--a=1 {COUNT}=5"
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flags.current(COUNT) is None and xla_flags.set_flag(COUNT, 1) == "1"
