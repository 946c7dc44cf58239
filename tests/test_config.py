"""The training config schema (zaya_jax/config.py) and the shipped configs/."""

import os

import pytest
from support.configs import CONFIGS, load

from zaya_jax import config as config_lib


@pytest.mark.parametrize(
    "name, arg",
    [
        ("tiny", None),
        ("mid", None),
        ("ablation_1b", None),
        ("zaya1_base", "phase1"),
        ("zaya1_base", "phase2"),
        ("zaya1_base", "phase3"),
    ],
)
def test_shipped_configs_validate(name, arg):
    c = load(name, arg)
    cfg = config_lib.validate(c)
    assert c.train.batch_size % c.train.grad_accum == 0 and cfg.hidden_size > 0


def test_zaya1_phases_follow_the_recipe():
    p1, p2, p3 = (load("zaya1_base", p) for p in ("phase1", "phase2", "phase3"))
    assert (p1.train.seq_len, p1.model.rope_theta) == (4096, 10_000.0)
    assert (p2.train.seq_len, p2.model.rope_theta) == (4096, 10_000.0)
    assert (p3.train.seq_len, p3.model.rope_theta) == (32768, 1_000_000.0)
    for p, tokens in ((p1, 8e12), (p2, 4e12), (p3, 1.2e12)):
        assert p.train.batch_size * p.train.seq_len == 4096 * 4096
        assert abs(p.train.steps * 4096 * 4096 / tokens - 1) < 1e-3
    assert p1.model.hidden_size == 2048 and p1.model.num_hidden_layers == 40
    with pytest.raises(ValueError, match="unknown phase"):
        load("zaya1_base", "phase4")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.steps", 0, "config.train.steps: must be a positive int"),
        ("train.grad_accum", 3, "config.train.grad_accum: batch_size=16 is not divisible"),
        ("train.seq_len", 10**6, "config.train.seq_len"),
        ("optim.lr", -1.0, "config.optim.lr"),
        ("mesh.data", 0, "config.mesh.data"),
        ("train.overlap_grad_reduce", "sometimes", "config.train.overlap_grad_reduce"),
        ("train.overlap_param_gather", "always", "config.train.overlap_param_gather"),
        (
            "model.num_key_value_heads",
            3,
            "config.model.num_attention_heads=4 .*divisible by num_key_value_heads",
        ),
        ("model.moe_impl", "loop", "config.model.moe_impl='loop'"),
        ("eval.tasks", ("no/such/task.jsonl",), r"config.eval.tasks\[0\]: .*does not exist"),
        ("eval.tasks", (3,), "config.eval.tasks: must be a list of data specs"),
        ("eval.task_limit", -1, "config.eval.task_limit: must be an int >= 0"),
        ("eval.harness_tasks", ("arc_easy", ""), "config.eval.harness_tasks: must be a list of lm-eval"),
        (
            "eval.harness_include_path",
            "no/such/dir",
            "config.eval.harness_include_path: 'no/such/dir' is not a",
        ),
        ("eval.harness_include_path", ".", "config.eval.harness_include_path: is set but eval.harness_tasks"),
        # tiny: warmup 50 + 30% decay of 60 steps do not fit; caught at start-up, not at step 0.
        ("train.steps", 60, r"config.optim \(schedule='wsd', train.steps=60\): warmup_steps \(50\) \+ decay"),
        ("optim.schedule", "linear", "config.optim.schedule: must be one of wsd, cosine, constant"),
    ],
)
def test_validation_names_the_bad_key(key, value, message):
    c = load("tiny")
    section, name = key.split(".")
    with c.unlocked():
        c[section][name] = value
    with pytest.raises(ValueError, match=message):
        config_lib.validate(c)


def test_unknown_key_is_rejected():
    c = load("tiny")
    with c.unlocked():
        c.train.stepz = 3
    with pytest.raises(ValueError, match="config.train.stepz: unknown key"):
        config_lib.validate(c)


def test_model_section_round_trips_into_zaya_config():
    c = load("tiny")
    cfg = config_lib.model_config(c)
    assert cfg.hidden_size == c.model.hidden_size and cfg.layer_types is None


def test_mid_config_is_the_50_to_100m_benchmark_size():
    """configs/mid.py: the second size of benchmarks/train_step.py, ~50-100M parameters."""
    from zaya_jax import sizing

    counts = sizing.param_counts(config_lib.validate(load("mid")))
    assert 50e6 <= counts.total <= 100e6 and counts.active < counts.total / 4


def test_every_balancing_field_is_settable_from_the_command_line():
    """`balancing.*` keys are derived from BalancingConfig: each field (skip_target included) set
    with --config.balancing.<field> reaches the BalancingConfig the trainer builds."""
    import dataclasses

    from absl import flags
    from ml_collections import config_flags

    from zaya_jax.optim.balancing import BalancingConfig
    from zaya_jax.training.train_state import balancing_config

    values = {
        "lr": 0.02,
        "b1": 0.5,
        "b2": 0.75,
        "eps": 1e-6,
        "weight_decay": 0.125,
        "update_skip": True,
        "skip_target": 0.3,
        "fraction_of": "routed",
    }
    fields = {f.name: f.default for f in dataclasses.fields(BalancingConfig)}
    assert set(values) == set(fields)  # a new field needs a value here
    assert all(values[k] != fields[k] for k in fields)

    def parse(*overrides):  # as the CLIs parse --config and its --config.<key> overrides
        argv = ["prog", f"--config={os.path.join(CONFIGS, 'tiny.py')}", *overrides]
        fv = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
        fv(argv)
        return fv.config

    c = parse(*(f"--config.balancing.{k}={v}" for k, v in values.items()))
    config_lib.validate(c)
    assert balancing_config(c) == BalancingConfig(**values)
    assert balancing_config(config_lib.base_config()) == BalancingConfig()  # defaults are the dataclass's
    with pytest.raises(ValueError, match="config.balancing.skip_target must be in"):
        config_lib.validate(parse("--config.balancing.skip_target=1.5"))


def test_config_does_not_import_the_evaluator():
    import subprocess
    import sys

    code = "import sys, zaya_jax.config; print(sorted(m for m in sys.modules if m.startswith('zaya_jax.evaluate')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
