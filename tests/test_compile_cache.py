"""zaya_jax.runtime.compile_cache: XLA:CPU programs of several devices with a collective inside a
loop stay out of jax's persistent compilation cache; every other program is cached, and a program
of several devices read back runs."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.xla_env import xla_flags

from zaya_jax.runtime import compile_cache

# Runs three programs with the persistent cache on (every program written, whatever its compile
# time) and prints, per program, whether the cache held it before it was compiled, whether it holds
# it after, and its result's sum: one device; two devices with their collective (an all-gather) in
# the entry computation; two devices with an all-reduce inside a loop.
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import zaya_jax  # installs compile_cache
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    mesh = Mesh(jax.devices()[:2], ("data",))
    x = jnp.arange(64.0).reshape(8, 8) / 64
    def one_device(x):
        return jnp.tanh(x) @ x.T + 1.25
    def gathered(x):  # rows sharded: x.T's rows are gathered in the entry
        return jnp.tanh(x) @ x.T + 2.5
    def looped(x):  # an all-reduce inside a while loop
        step = lambda i, c: c + jax.lax.psum(c, "data") * 0.5
        return jax.lax.fori_loop(0, 3, step, jnp.tanh(x))
    looped = jax.shard_map(looped, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    for name, fn, arg in (("one_device", one_device, x), ("gathered", gathered, sharded),
                          ("looped", looped, sharded)):
        held = lambda: any(n.startswith(f"jit_{name}-") for n in os.listdir(sys.argv[1]))
        before = held()
        out = jax.jit(fn)(arg)
        print(name, int(before), int(held()), float(out.sum()))
    """
)


def _run(cache_dir) -> dict[str, tuple[int, int, float]]:
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir)], env=env, capture_output=True, text=True, check=True
    )
    rows = (line.split() for line in out.stdout.splitlines())
    return {name: (int(before), int(after), float(total)) for name, before, after, total in rows}


def test_cpu_programs_with_a_collective_in_a_loop_are_not_cached_the_others_read_back_run(tmp_path):
    first = _run(tmp_path)
    assert first["one_device"][:2] == (0, 1)  # written
    assert first["gathered"][:2] == (0, 1)  # written: its collective is in the entry
    assert first["looped"][:2] == (0, 0)  # not written: its collective is in a loop body
    second = _run(tmp_path)  # a new process: two programs read back, the third compiled again
    assert {name: row[:2] for name, row in second.items()} == {
        "one_device": (1, 1),
        "gathered": (1, 1),
        "looped": (0, 0),
    }
    assert {name: row[2] for name, row in second.items()} == {name: row[2] for name, row in first.items()}


def _executable(fn, *args):
    return jax.jit(fn).lower(*args).compile().runtime_executable()


def test_deadlocks_read_back_follows_the_platform_devices_and_collectives():
    mesh = Mesh(jax.devices("cpu")[:2], ("data",))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
    looped = jax.shard_map(
        lambda c: jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, "data"), c),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    in_loop = _executable(looped, x)
    assert compile_cache.nested_collectives(in_loop.hlo_modules()[0].to_string())
    assert compile_cache.deadlocks_read_back(in_loop, "cpu")
    assert not compile_cache.deadlocks_read_back(in_loop, "gpu")
    in_entry = _executable(lambda x: x @ x.T, x)
    assert not compile_cache.deadlocks_read_back(in_entry, "cpu")
    assert not compile_cache.deadlocks_read_back(_executable(jnp.tanh, np.ones(4)), "cpu")


HLO = """\
HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %v = f32[4] get-tuple-element(%p), index=1
  %ar = f32[4] all-reduce(%v), channel_id=2, replica_groups=[1,2]<=[2], to_apply=%add
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %ag = f32[8] all-gather(%x), channel_id=1, replica_groups=[1,2]<=[2], dimensions={0}
}
"""


def test_nested_collectives_names_the_computations_outside_the_entry():
    assert compile_cache.nested_collectives(HLO) == ["body"]
    entry_only = HLO.replace(" all-reduce(", " add(")
    assert compile_cache.nested_collectives(entry_only) == []


def test_install_is_idempotent():
    from jax._src import compiler

    wrapped = compiler._cache_write
    compile_cache.install()
    assert compiler._cache_write is wrapped
    assert wrapped.zaya_cpu_guard
