"""zaya_jax.reshard: a checkpoint saved on one mesh restores on others with identical params and
the same next losses (8 simulated devices; 1 device in a subprocess)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import cli_fork
from support.configs import small_train_config
from support.xla_env import xla_flags

from zaya_jax import config as config_lib
from zaya_jax.parallel.mesh import mesh_from_config
from zaya_jax.reshard import reshard
from zaya_jax.train import train
from zaya_jax.training.checkpoint import Checkpointer
from zaya_jax.training.metrics import read_metrics
from zaya_jax.training.train_state import abstract_train_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Saved at step 2, then steps 3 and 4 from the restored state on every mesh: step 3's loss checks the
# restored params, step 4's the update step 3 made with the restored optimizer state and step.
STEPS = 4


def _losses(w):
    return {r["step"]: r["loss"] for r in read_metrics(str(w), split="train")}


def _params(w, step):
    ck = Checkpointer(str(w), read_only=True)
    c = config_lib.from_json(ck.restore_config(step))
    target = abstract_train_state(c, config_lib.validate(c), mesh_from_config(c))
    state, _, _ = ck.restore(step, target)
    ck.close()
    return jax.tree.map(np.asarray, (state.params, state.opt_state, state.balancing))


def _continue(w):
    """Resumes the run in `w` with the config saved in its checkpoint (which carries its mesh)."""
    ck = Checkpointer(str(w), read_only=True)
    c = config_lib.from_json(ck.restore_config())
    ck.close()
    return train(c, str(w))


@pytest.mark.slow
def test_reshard_to_other_meshes(tmp_path):
    c = small_train_config(steps=STEPS)
    c.mesh.data, c.mesh.expert = 2, 4
    c.checkpoint.every_steps = 2
    src = tmp_path / "src"
    train(c, str(src))
    ref_losses, ref_params = _losses(src), _params(src, 2)

    for name, mesh in (("d4e2", {"data": 4, "expert": 2}), ("d8", {"data": 8, "expert": 1})):
        dst = tmp_path / name
        info = reshard(str(src / "checkpoints" / "2"), str(dst), mesh)
        assert info["to_mesh"]["data"] == mesh["data"] and info["to_mesh"]["expert"] == mesh["expert"]
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(_params(dst, 2))):
            np.testing.assert_array_equal(a, b)
        _continue(dst)
        got = _losses(dst)
        assert sorted(got) == list(range(3, STEPS + 1))
        for s in got:
            assert abs(got[s] - ref_losses[s]) < 1e-5, (name, s, got[s], ref_losses[s])

    # One device: the CLI (replacing an unrelated directory; a process forked from one that imported
    # the CLIs, tests/support/cli_fork.py), then training resumed from the resharded checkpoint, in a
    # subprocess.
    one = tmp_path / "one"
    one.mkdir()
    (one / "old.txt").write_text("replaced by --overwrite")
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    saved_at_2, to_one = src / "checkpoints" / "2", ["--config.mesh.data=1", "--config.mesh.expert=1"]
    args = ["--src", saved_at_2, "--dst", one, *to_one, "--overwrite"]
    cli = cli_fork.shared(env).run("reshard", *args, env=env, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    code = (
        "import sys, json; sys.path.insert(0, 'tests'); from test_reshard import _continue, _params;"
        "import numpy as np, jax;"
        f"_continue({str(one)!r});"
        f"np.savez({str(tmp_path / 'one.npz')!r}, *jax.tree.leaves(_params({str(one)!r}, 2)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (one / "old.txt").exists()
    saved = np.load(tmp_path / "one.npz")
    for i, a in enumerate(jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(a, saved[f"arr_{i}"])
    got = _losses(one)
    assert sorted(got) == list(range(3, STEPS + 1))
    for s in got:
        assert abs(got[s] - ref_losses[s]) < 1e-5, ("one", s, got[s], ref_losses[s])
