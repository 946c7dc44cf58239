"""Every numeric or enumerated flag of every CLI, and every enumerated or numeric config key,
refuses a value outside what it declares with one `error:` line naming it, exit 2, before anything
is loaded (zaya_jax/runtime/cli.py, "declared flag values"; zaya_jax/config.py). The flags are walked by
tests/support/cli_walk.py in one subprocess through each CLI's real `__main__`; a new CLI is one row of its
CLIS table, a new flag is walked as soon as it is defined."""

import ast
import json
import os
import subprocess
import sys

import ml_collections
import pytest
from support.cli_runs import ENV, assert_one_line_error, run_cli
from support.cli_walk import CLIS, ROOT

from zaya_jax import config as config_lib


@pytest.fixture(scope="module")
def walked():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "support", "cli_walk.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
        env={**ENV, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cli_modules() -> set[str]:
    """Every module under zaya_jax/ and benchmarks/ whose `__main__` block calls cli.run / run_absl."""
    out = set()
    for top in ("zaya_jax", "benchmarks"):
        for root, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(root, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for node in tree.body:
                    if (
                        isinstance(node, ast.If)
                        and "__main__" in ast.unparse(node.test)
                        and "cli.run" in ast.unparse(node)
                    ):
                        module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                        out.add(module.removesuffix(".__main__"))
    return out


def test_every_cli_is_in_the_walk():
    assert _cli_modules() == {c.run for c in CLIS}, "add the new CLI to tests/support/cli_walk.py CLIS"


def test_every_numeric_flag_declares_its_values(walked):
    assert {k: v for k, v in walked["undeclared"].items() if v} == {}
    assert {k: v for k, v in walked["bad_defaults"].items() if v} == {}


@pytest.mark.parametrize("run", sorted({c.run for c in CLIS}))
def test_out_of_range_values_are_one_error_line(walked, run):
    cases = [c for c in walked["cases"] if c["cli"] == run]
    bad = []
    for c in cases:
        lines = [line for line in c["stderr"].splitlines() if line.strip()]
        one_line = len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in c["stderr"]
        if c["code"] != 2 or not one_line or c["flag"] not in lines[0]:
            bad.append((c["flag"], c["value"], c["code"], c["stderr"][-500:]))
    assert not bad, bad
    if run != "zaya_jax.import_hf":  # its flags are paths and a config file only
        assert cases


def test_config_loading_errors_are_one_line(walked):
    """A missing config file, a get_config that raises, an unknown or misspelt `--config.` key: one
    error line naming the file or key, exit 2, for every CLI that takes a config."""
    cases = walked["config_cases"]
    assert {c["cli"] for c in cases} == {
        "zaya_jax.train",
        "zaya_jax.sizing",
        "zaya_jax.import_hf",
        "zaya_jax.reshard",
    }
    bad = []
    for c in cases:
        lines = [line for line in c["stderr"].splitlines() if line.strip()]
        one_line = len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in c["stderr"]
        if c["code"] != 2 or not one_line or not all(n in lines[0] for n in c["names"]):
            bad.append((c["cli"], c["argv"], c["code"], c["stderr"][-500:]))
    assert not bad, bad


def test_the_reported_case_and_reshard_mesh(tmp_path):
    """The issue's case as a user runs it, and reshard's new mesh, both checked before any file is read."""
    proc = run_cli("generate", "--checkpoint", tmp_path / "W", "--prompt", "hi", "--temperature", "-1")
    assert_one_line_error(proc, "--temperature", "-1")
    proc = run_cli("reshard", "--src", tmp_path / "a", "--dst", tmp_path / "b", "--config.mesh.expert=0")
    assert_one_line_error(proc, "--config.mesh.expert")
    assert not (tmp_path / "b").exists()


def test_grad_reduce_is_checked_at_start_up(tmp_path):
    """A train.grad_reduce that is neither "step" nor "microbatch": one error line from the trainer,
    before its workdir exists."""
    workdir = tmp_path / "w"
    proc = run_cli(
        "train",
        "--config",
        f"{ROOT}/configs/tiny.py",
        "--workdir",
        workdir,
        "--config.train.grad_reduce=zero2",
    )
    line = assert_one_line_error(proc, "config.train.grad_reduce", "step", "microbatch", "zero2")
    assert not workdir.exists(), line


def _leaves(c, prefix=""):
    for key, value in c.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# (key, the value it gets): a string key gets a name no enumeration has, a numeric key -7.
CONFIG_CASES = [
    (key, "no_such_value" if isinstance(value, str) else type(value)(-7))
    for key, value in _leaves(config_lib.base_config())
    if isinstance(value, (str, int, float)) and not isinstance(value, bool)
]


def test_config_walk_covers_the_enumerations():
    keys = {k for k, _ in CONFIG_CASES}
    assert {"model.attention_impl", "optim.schedule", "optim.muon.mu_dtype", "balancing.fraction_of"} <= keys
    assert "train.grad_reduce" in keys
    assert {"seed", "optim.adamw.b2", "model.eos_token_id", "logging.dead_expert_window"} <= keys


@pytest.mark.parametrize("key, value", CONFIG_CASES, ids=[k for k, _ in CONFIG_CASES])
def test_config_value_out_of_range_names_the_key(key, value):
    """What `--config.KEY=VALUE` reaches: validate() is the first thing every CLI taking a config runs."""
    c = config_lib.base_config()
    c.optim.warmup_steps = 0  # so that only KEY is wrong
    *path, last = key.split(".")
    section = c
    for part in path:
        section = section[part]
    section[last] = value
    with pytest.raises(ValueError) as e:
        config_lib.validate(c)
    assert str(e.value).startswith(f"config.{key}"), str(e.value)
