"""zaya_jax.runtime.compile_cache: programs of several CPU devices stay out of jax's persistent
compilation cache; one-device programs are cached as jax does it."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
from xla_env import xla_flags

from zaya_jax.runtime import compile_cache

# Compiles the same function for one device and for a 2-device mesh with the persistent cache on
# (every program written, whatever its compile time), then prints the cache's entries.
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import zaya_jax  # installs compile_cache
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    def step(x):
        return jnp.tanh(x) @ x.T + 1.2345
    def entries():  # the cache's entries of `step`'s programs
        return [n for n in os.listdir(sys.argv[1]) if n.startswith("jit_step-")]
    jax.jit(step)(jnp.ones((8, 8))).block_until_ready()
    one = len(entries())
    mesh = Mesh(jax.devices()[:2], ("data",))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data")))
    jax.jit(step)(x).block_until_ready()
    print(one, len(entries()))
    """
)


def test_only_programs_of_one_cpu_device_are_cached(tmp_path):
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, check=True
    )
    one, after_mesh = map(int, out.stdout.split())
    assert one == 1  # the one-device program was written
    assert after_mesh == 1  # the 2-device program was not


def test_uncached_follows_the_devices_of_the_program():
    cpus = jax.devices("cpu")
    assert compile_cache.uncached(np.asarray(cpus[:2]))
    assert not compile_cache.uncached(np.asarray(cpus[:1]))


def test_install_is_idempotent():
    from jax._src import compiler

    wrapped = compiler._resolve_compilation_strategy
    compile_cache.install()
    assert compiler._resolve_compilation_strategy is wrapped
    assert wrapped.zaya_uncached_cpu_meshes
