"""zaya_jax/runtime/device_memory.py: what a compiled step needs against what the devices have (the
trainer's start-up refusal; its CLI cases are in tests/test_cli_errors.py)."""

import types

import jax
import jax.numpy as jnp
import pytest

from zaya_jax.runtime import device_memory

MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def stats(**sizes):
    fields = ("argument", "output", "alias", "temp")
    return types.SimpleNamespace(**{f"{f}_size_in_bytes": sizes.get(f, 0) for f in fields})


def test_host_available_is_meminfo_or_the_cgroups_room_if_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert device_memory.host_available_bytes(meminfo, cgroup) == 20000000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    (cgroup / "memory.current").write_text("5000000000\n")
    assert device_memory.host_available_bytes(meminfo, cgroup) == 20000000 * 1024
    (cgroup / "memory.max").write_text("8000000000\n")
    assert device_memory.host_available_bytes(meminfo, cgroup) == 3_000_000_000
    assert device_memory.host_available_bytes(tmp_path / "none", tmp_path / "none") is None


def test_step_bytes_and_the_refusal_line(monkeypatch):
    """arguments + outputs - alias + temporaries; CPU devices share the machine's RAM."""
    s = stats(argument=300 * 2**20, output=300 * 2**20, alias=290 * 2**20, temp=200 * 2**20)
    assert device_memory.step_bytes(s) == 510 * 2**20
    cpus = jax.devices("cpu")[:4]
    monkeypatch.setenv(device_memory.LIMIT_ENV, str(4 * 510 * 2**20))
    assert device_memory.shortfall(s, cpus, "the train step", "fix it") is None  # exactly fits
    monkeypatch.setenv(device_memory.LIMIT_ENV, str(2**30))
    line = device_memory.shortfall(s, cpus, "the train step", "fix it")
    assert line == (
        "the train step needs 1.99 GiB (510.00 MiB per device x 4 CPU devices) (XLA's buffers: arguments + "
        f"outputs - alias + temporaries) but the {device_memory.LIMIT_ENV} limit is 1.00 GiB: fix it"
    )
    monkeypatch.setenv(device_memory.LIMIT_ENV, "1GB")
    with pytest.raises(ValueError, match=device_memory.LIMIT_ENV):
        device_memory.budget(cpus)
    monkeypatch.delenv(device_memory.LIMIT_ENV)
    have = device_memory.budget(cpus)
    assert have.what == "this machine's available RAM" and have.sharing == 4 and have.bytes > 0


def test_a_compiled_programs_own_analysis():
    """The bytes of a real compiled program: a [1024, 1024] f32 argument and result, not donated."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    compiled = jax.jit(lambda a: a * 2.0).lower(x).compile()
    assert device_memory.step_bytes(compiled.memory_analysis()) >= 2 * 4 * 2**20


def test_a_compile_refused_for_memory_is_one_error_and_the_new_workdir_goes(tmp_path):
    """A compiler that refuses the start-up compile for memory (as XLA may on a real GPU) gives the
    same one-line refusal, and the directories the run made are removed; other compile errors pass."""
    from zaya_jax.config import base_config
    from zaya_jax.parallel.mesh import mesh_from_config
    from zaya_jax.runtime.cli import UserError
    from zaya_jax.trainer import startup

    c = base_config()
    c.mesh.data = 1

    class Refusing:
        def __init__(self, message):
            self.message = message

        def lower(self, *args):
            return self

        def compile(self):
            raise jax.errors.JaxRuntimeError(self.message)

    program = types.SimpleNamespace(mesh=mesh_from_config(c, devices=jax.devices()[:1]))
    program.train_step = Refusing("RESOURCE_EXHAUSTED: Out of memory allocating 87226507872 bytes.\nmore")
    state = types.SimpleNamespace(variables={})
    workdir = tmp_path / "new" / "run"
    created = startup._missing_root(str(workdir))
    workdir.mkdir(parents=True)
    with pytest.raises(UserError) as e:
        startup._check_memory(c, program, state, None)
    startup._remove_created(str(workdir), created)  # what the Trainer does on a refused start
    assert str(e.value).startswith(
        "the train step does not fit this machine's memory (XLA: RESOURCE_EXHAUSTED: Out of memory "
        "allocating 87226507872 bytes.): raise train.grad_accum"
    )
    assert not (tmp_path / "new").exists() and tmp_path.exists()
    program.train_step = Refusing("INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        startup._check_memory(c, program, state, None)
