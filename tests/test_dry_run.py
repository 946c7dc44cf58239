"""`python -m zaya_jax.train --dry_run`: the full-size train step compiled on simulated CPU devices."""

import os
import re
import subprocess
import sys
import types
import uuid

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from jax._src import config as jax_config  # a config option as a context: not public
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.xla_env import FAST_COMPILE_FLAGS

from zaya_jax.analysis import compiled as compiled_lib
from zaya_jax.analysis import dry_run, fit, report
from zaya_jax.analysis import hlo as hlo_lib
from zaya_jax.analysis.exchange import all_to_all_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("dry run: ", "Memory per device", "Collectives per device", "Compile: ")


def run_dry(cwd, config, *extra):
    """The CLI in an empty directory, with no device count in XLA_FLAGS (the dry run must set it), with
    a compilation cache directory in it (the dry run must not write one)."""
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cwd, "xla_cache")
    cmd = [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, config), "--dry_run"]
    cmd += extra
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=900, env=env)


def table(out: str, row: str) -> list[float]:
    """The numbers of the report row starting with `row`."""
    line = next(line for line in out.splitlines() if line.strip().startswith(row))
    return [float(x) for x in re.findall(r"(?<![\w(])\d+(?:\.\d+)?", line[len(row) + 2 :])]


def check_report(out: str, devices: int) -> None:
    for section in SECTIONS:
        assert section in out, out
    assert f"on {devices} simulated CPU devices" in out
    # The state is laid out exactly as sizing assumes: XLA's arguments (state + batch) and outputs
    # match sizing's params + optimizer per device to within the batch and metrics.
    xla, ours = table(out, "arguments (state + batch)")
    assert ours <= xla <= ours * 1.01, out
    xla, ours = table(out, "alias (outputs in donated arguments)")
    assert ours * 0.99 <= xla <= ours * 1.01, out  # the donated state is reused for the new state
    xla, ours = table(out, "temporaries")
    assert xla > 0 and ours > 0
    assert table(out, "reduce-scatter")[0] >= 1  # the gradients into the ZeRO-1 shards, once per step
    # Nothing crosses the data axis per microbatch; once per step the formula's bytes (docs/architecture.md).
    line = next(line for line in out.splitlines() if "data-parallel (spanning the data axis)" in line)
    assert "in the model 0.00 MiB" in line, line
    assert re.search(r"Compile: trace \+ lower [\d.]+ s, XLA compile [\d.]+ s", out)
    # a verdict against this machine's RAM, which the simulated devices share
    assert f"this machine's available RAM, shared by the {devices} simulated devices: " in out, out
    assert re.search(r"(: fits \([\d.]+% used\)|: DOES NOT FIT here: the step needs)", out), out


def no_xla_log(proc) -> None:
    """XLA's log records (XLA:CPU's constant-folding alarms, ...) are kept out of the output."""
    records = [line for line in proc.stderr.splitlines() if compiled_lib.XLA_LOG_RECORD.match(line)]
    assert not records, records[:5]


@pytest.mark.slow
def test_dry_run_tiny_cli(tmp_path):
    """Tiny config on 8 devices with an expert axis: the report, exit 0, nothing written."""
    proc = run_dry(tmp_path, "configs/tiny.py", "--config.mesh.expert=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    check_report(out, 8)
    no_xla_log(proc)
    assert "mesh data=2 fsdp=1 expert=4" in out
    assert table(out, "all-to-all")[0] >= 2  # tokens to their experts' devices and back
    # The exchange's spill round (only on overflow) has its own row, left out of every step's total.
    main, spill = table(out, "all-to-all"), table(out, "all-to-all" + report.SPILL)
    assert spill[0] >= 2 and spill[2] >= 2
    every_step, with_spill = table(out, "total (every step)"), table(out, "total (with spill taken)")
    assert with_spill[3] == pytest.approx(every_step[3] + spill[3], abs=0.02)  # MiB/step, 2 decimals
    assert main[3] < every_step[3] < with_spill[3]
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_dry_run_zaya1_base_phase1(tmp_path):
    """The full-size model (8.8B params) on 8 simulated devices: ~1 min, ~0.8 GB peak RSS."""
    proc = run_dry(tmp_path, "configs/zaya1_base.py:phase1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    check_report(out, 8)
    no_xla_log(proc)
    assert "8,840.5M parameters" in out and "(GiB per device)" in out
    assert os.listdir(tmp_path) == []


def test_device_count():
    c = ml_collections.ConfigDict({"mesh": {"data": 2, "fsdp": 2, "expert": 4, "context": 1}})
    assert compiled_lib.device_count(c) == 16
    assert compiled_lib.device_count(c, 4) == 4
    c.mesh.data = -1
    assert compiled_lib.device_count(c) == compiled_lib.DEFAULT_DEVICES
    with pytest.raises(ValueError, match="dry_run_devices"):
        compiled_lib.device_count(c, 0)


def test_simulated_devices_after_start():
    """jax already started (conftest: 8 CPU devices): its devices are used, too few is an error."""
    assert len(jax.devices()) == 8  # start jax here, whatever test ran first
    assert len(compiled_lib.simulated_devices(4)) == 4
    with pytest.raises(ValueError, match="needs 64 CPU devices"):
        compiled_lib.simulated_devices(64)


def test_collectives_counts_bytes_and_loop_trips():
    """On a compiled program with known collectives: an all-gather of a [8, 16] f32 array once, and a
    psum of a [4] f32 vector inside a 5-trip scan."""
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])
    sharded = NamedSharding(mesh, P("d"))

    def f(x, v):
        full = jax.lax.with_sharding_constraint(x * 2.0, NamedSharding(mesh, P()))

        def body(acc, _):
            return acc + jnp.sum(v * acc[0], axis=0), None

        acc, _ = jax.lax.scan(body, jnp.ones((4,)), None, length=5)
        return full, acc

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=sharded)
    v = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharded)
    compiled = jax.jit(f, out_shardings=(NamedSharding(mesh, P()),) * 2).lower(x, v).compile()
    stats = report.collectives(compiled.as_text())
    gather = stats["all-gather"]
    assert (gather.ops, gather.bytes, gather.ops_per_step) == (1, 8 * 16 * 4, 1)
    reduce = stats["all-reduce"]
    assert (reduce.ops, reduce.bytes, reduce.ops_per_step, reduce.bytes_per_step) == (1, 4 * 4, 5, 5 * 4 * 4)


def test_collectives_main_path_and_spill():
    """An all-to-all in a 3-trip loop (main path), an all-gather in a cond's default branch (main
    path) and an all-to-all in its other branch (spill): each counted where it runs, each in its
    row of the table."""
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])

    def body(x_bd):
        x_bd = jax.lax.fori_loop(0, 3, lambda i, v: jax.lax.all_to_all(v, "d", 0, 0, tiled=True), x_bd)
        flag = jax.lax.pmax((jnp.sum(x_bd) > 0).astype(jnp.int32), "d") > 0
        spill = lambda v: jax.lax.all_to_all(jnp.concatenate([v, v]) * 2, "d", 0, 0, tiled=True)[:8]
        main = lambda v: jax.lax.all_gather(v[:1], "d", tiled=True)
        return jax.lax.cond(flag, spill, main, x_bd)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    x = jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    hlo = jax.jit(fn).lower(x).compile().as_text()
    stats = report.collectives(hlo)
    a2a, spill, gather = stats["all-to-all"], stats["all-to-all" + report.SPILL], stats["all-gather"]
    assert (a2a.ops, a2a.bytes, a2a.ops_per_step, a2a.bytes_per_step) == (1, 8 * 4 * 4, 3, 3 * 8 * 4 * 4)
    assert (spill.ops, spill.bytes, spill.ops_per_step, spill.bytes_per_step) == (
        1,
        16 * 4 * 4,
        1,
        16 * 4 * 4,
    )
    assert (gather.ops, gather.bytes_per_step) == (1, 8 * 4 * 4)
    assert all_to_all_bytes(hlo) == (a2a.bytes_per_step, spill.bytes_per_step)
    rows = report.collective_rows(stats)
    labels = [row.split("  ")[1] for row in rows[1:-1]]
    assert rows[-1].startswith("  (spill: only in a conditional's non-default branch")
    assert labels == [
        "all-reduce",  # the pmax of the flag
        "all-gather",
        "all-to-all",
        "all-to-all" + report.SPILL,
        "total (every step)",
        "total (with spill taken)",
    ]


TINY_EXCHANGE = dict(
    hidden_size=64, num_hidden_layers=2, num_experts=8, moe_intermediate_size=32, vocab_size=128
)


@pytest.mark.slow
def test_compiled_step_exchange_main_path_and_spill(monkeypatch):
    """The tiny train step at data=2 x expert=4 (64 tokens per device, fp32, the config of
    test_expert_exchange's byte count): the dry run's every-step all-to-all bytes are the main round's
    (C = 24 slots per peer: x / ids forward, y, dy, dx) and its spill row the T - C = 40 others'; both
    agree with the exchange's count from the HLO (zaya_jax/analysis/exchange.py)."""
    from jax._src import compilation_cache

    from zaya_jax.config import base_config, set_model
    from zaya_jax.model import ZayaConfig

    c = base_config()
    set_model(c, ZayaConfig.tiny(**TINY_EXCHANGE))
    c.train.batch_size, c.train.seq_len = 8, 64
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = 2, 1, 4
    # This process's writes to the persistent cache, recorded where jax makes them (not by listing
    # the directory: the suite's other worker and its CLI subprocesses write their own train steps there).
    written = []
    put = compilation_cache.put_executable_and_time

    def record(cache_key, module_name, *args, **kwargs):
        written.append(module_name)
        return put(cache_key, module_name, *args, **kwargs)

    monkeypatch.setattr(compilation_cache, "put_executable_and_time", record)
    # Every compile written here (the minimum compile time 0), and the cache in use in this
    # process, as in the full suite: only compile_step itself may stop the write.
    with jax_config.persistent_cache_min_compile_time_secs(0.0):
        salt = float(uuid.uuid4().int % 10**6)  # a program no earlier run has put in the cache
        jax.jit(lambda x: x + salt)(1.0)
        assert written, "the recorder sees this process's cache writes"
        step = compiled_lib.compile_step(c, jax.devices()[:8])
    # Not written to the persistent cache (compile_step's own choice).
    assert not [m for m in written if m.startswith("jit_train_step")], written
    hlo = step.compiled.as_text()
    stats = report.collectives(hlo)
    n, t, cap, d, blocks = 4, 64, 24, TINY_EXCHANGE["hidden_size"], 2  # blocks: layers x grad_accum
    per_slot = 4 * d * 4 + 1  # x, y, dy, dx in fp32 and one byte of expert id, per slot
    main, spill = all_to_all_bytes(hlo)  # the exchange's (the optimizer's all-to-alls left out)
    assert main == blocks * n * cap * per_slot
    assert spill == stats["all-to-all" + report.SPILL].bytes_per_step == blocks * n * (t - cap) * per_slot
    # The table's every-step row: the exchange and distributed Muon's moves to the matrices' owners.
    ops = hlo_lib.collectives(hlo)
    muon = sum(c.bytes for c in ops if "optimizer_update" in c.op_name and c.op == "all-to-all")
    assert stats["all-to-all"].bytes_per_step == main + muon
    assert step.mesh.shape == {"data": 2, "fsdp": 1, "expert": 4, "context": 1}


GPU_STYLE_HLO = """HloModule jit_step

%fused_dot (p0: bf16[4,64,32], p1: bf16[4,32,16]) -> f32[4,64,16] {
  %p0 = bf16[4,64,32]{2,1,0} parameter(0)
  %p1 = bf16[4,32,16]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[4,64,16]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/ZayaForCausalLM/layers/mlp/experts/dot_general"}
}

%body (c: (s32[], bf16[4,64,32], bf16[4,32,16])) -> (s32[], bf16[4,64,32], bf16[4,32,16]) {
  %c = (s32[], bf16[4,64,32]{2,1,0}, bf16[4,32,16]{2,1,0}) parameter(0)
  %a = bf16[4,64,32]{2,1,0} get-tuple-element(%c), index=1
  %b = bf16[4,32,16]{2,1,0} get-tuple-element(%c), index=2
  %f = f32[4,64,16]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %k = f32[64,16]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/ZayaForCausalLM/layers/mlp/experts/zaya_gmm_flops_5000/pallas_call"}, backend_config={grid_x = 2 : i32, name = "zaya_gmm_flops_5000", num_warps = 4 : i32}
  ROOT %t = (s32[], bf16[4,64,32]{2,1,0}, bf16[4,32,16]{2,1,0}) tuple(%c)
}

%cond (c: (s32[], bf16[4,64,32], bf16[4,32,16])) -> pred[] {
  %c = (s32[], bf16[4,64,32]{2,1,0}, bf16[4,32,16]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: bf16[64,32], w: bf16[32,8], s: (s32[], bf16[4,64,32], bf16[4,32,16])) -> f32[64,8] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,8]{1,0} parameter(1)
  %s = (s32[], bf16[4,64,32]{2,1,0}, bf16[4,32,16]{2,1,0}) parameter(2)
  %loop = (s32[], bf16[4,64,32]{2,1,0}, bf16[4,32,16]{2,1,0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %g = (f32[64,8]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %cv = (f32[64,8]{1,0}, u8[0]{0}) custom-call(%x, %w), window={size=2}, custom_call_target="__cudnn$convForward"
  ROOT %r = f32[64,8]{1,0} get-tuple-element(%g), index=0
}
"""


def test_hlo_replica_groups_in_each_form():
    """Device groups from XLA's explicit, iota and mesh-axes forms (a -done takes its -start's), and
    the mesh axes they span on a data=4 x expert=2 mesh (device i at position i of the mesh)."""
    from zaya_jax.analysis import hlo

    groups = {
        "replica_groups={{0,2,4,6},{1,3,5,7}}": ((0, 2, 4, 6), (1, 3, 5, 7)),
        "replica_groups=[4,2]<=[8]": ((0, 1), (2, 3), (4, 5), (6, 7)),
        "replica_groups=[2,4]<=[4,2]T(1,0)": ((0, 2, 4, 6), (1, 3, 5, 7)),
        "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}": ((0, 2, 4, 6), (1, 3, 5, 7)),
        "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}": (
            (0, 1),
            (2, 3),
            (4, 5),
            (6, 7),
        ),
        "source_target_pairs={{0,1},{2,3}}": ((0, 1), (2, 3)),
    }
    for text, want in groups.items():
        line = f"  %x = f32[4]{{0}} all-gather(%y), {text}, dimensions={{0}}"
        assert hlo.replica_groups(line) == want, text
    shape, names = (4, 1, 2, 1), ("data", "fsdp", "expert", "context")
    assert hlo.group_axes(((0, 2, 4, 6), (1, 3, 5, 7)), names, shape) == ("data",)
    assert hlo.group_axes(((0, 1), (2, 3)), names, shape) == ("expert",)
    assert hlo.group_axes(((0,), (1,)), names, shape) == ()
    text = """ENTRY %main {
  %p = f32[8]{0} parameter(0)
  %s = (f32[8]{0}, f32[2]{0}) reduce-scatter-start(%p), replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  ROOT %d = f32[2]{0} reduce-scatter-done(%s), metadata={op_name="jit(f)/reduce_scatter"}
}"""
    (c,) = hlo.collectives(text)
    assert (c.op, c.bytes, c.op_name) == ("reduce-scatter", 8, "jit(f)/reduce_scatter")
    assert c.groups == ((0, 2, 4, 6), (1, 3, 5, 7))  # from the -start


def test_hlo_work_reads_gpu_style_text():
    """XLA:GPU's text names operands without shapes: a dot's contraction comes from its operand's
    declaration; a while body's work runs its trip count; our Triton call's FLOPs are the ones its
    name declares; a cuBLAS call's from its dot dimension numbers."""
    from zaya_jax.analysis import hlo

    works = {(w.kind, w.name): w for w in hlo.work(GPU_STYLE_HLO)}
    dot = works[("dot", "dot")]
    assert (dot.flops, dot.runs.main) == (2 * 4 * 64 * 16 * 32, 3) and "/experts/" in dot.op_name
    assert works[("triton", "zaya_gmm")].flops == 5000 and works[("triton", "zaya_gmm")].runs.main == 3
    assert works[("triton fusion", "__triton_nested_gemm_fusion")].runs.main == 3
    assert works[("gemm", "__cublas$gemm")].flops == 2 * 64 * 8 * 32
    assert works[("convolution", "__cudnn$convForward")].flops == 0


def test_hlo_work_reads_cpu_text():
    """XLA:CPU writes operand shapes inline: the same count from a compiled CPU dot."""
    from zaya_jax.analysis import hlo

    f = jax.jit(lambda a, b: a @ b)
    text = f.lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
    dots = [w for w in hlo.work(text) if w.kind == "dot"]
    assert [d.flops for d in dots] == [2 * 8 * 16 * 4]


# ------------------------------------------------------------------------------- memory verdicts
REMAT_LOG = (
    "W1129 02:48:09.000000  1234 hlo_rematerialization.cc:3005] Can't reduce memory use below 62.00GiB "
    "(66571993088 bytes) by rematerialization; only reduced to 123.30GiB (132391809024 bytes), down from "
    "150.00GiB (161061273600 bytes) originally\n"
)


def test_captured_xla_log_keeps_xla_records_and_passes_the_rest(capfd):
    """XLA's log records (and their continuation lines) go to the list, not the terminal; anything
    before the first record passes; the rematerialization shortfall is read from them."""
    log = []
    with compiled_lib.captured_xla_log(log):
        os.write(2, b"a plain line\n")
        os.write(2, b"E1129 02:48:08.779520  1234 slow_operation_alarm.cc:73] Constant folding an ")
        os.write(2, b"instruction is taking > 1s:\n  %reduce.1 = f32[] reduce(...)\n" + REMAT_LOG.encode())
    assert capfd.readouterr().err == "a plain line\n"
    assert len(log) == 2 and "Constant folding" in log[0] and "%reduce.1" in log[0]
    assert compiled_lib.remat_shortfall(log) == (66571993088, 132391809024)
    assert compiled_lib.remat_shortfall(log[:1]) is None
    assert report.xla_remat_rows(log) == [
        "  XLA's rematerialization could not bring the buffers under its 62.00 GiB limit: only to 123.30 GiB"
    ]


def test_host_verdict_for_the_cpu_target(monkeypatch):
    """The CPU target's verdict: the simulated devices of one process share the machine's RAM."""
    monkeypatch.setenv(dry_run.device_memory.LIMIT_ENV, str(8 * 2**30))
    limit = f"the {dry_run.device_memory.LIMIT_ENV} limit"
    assert report.host_rows(2 * 2**30, 4) == [
        f"  {limit}, shared by the 4 simulated devices: 8.00 GiB: fits (100.0% used)"
    ]
    assert report.host_rows(3 * 2**30, 4) == [
        (f"  {limit}, shared by the 4 simulated devices: 8.00 GiB: DOES NOT FIT here: the step needs "
        "12.00 GiB (4.00 GiB over)")
    ]
    assert report.host_rows(3 * 2**30, 1)[0].startswith(f"  {limit}: 8.00 GiB: fits (37.5% used)")


def small_moe_config(data: int = 8):
    from zaya_jax.config import base_config, set_model
    from zaya_jax.model import ZayaConfig

    c = base_config()
    set_model(c, ZayaConfig.tiny(**TINY_EXCHANGE))
    c.train.batch_size, c.train.seq_len, c.mesh.data = 16, 64, data
    return c


def test_memory_remedies_follow_the_config():
    """grad_accum while a microbatch holds several sequences, attention only where `auto` would drop
    the dense scores, remat unless full, fsdp on several devices."""
    from zaya_jax.parallel.mesh import mesh_from_config

    c = small_moe_config(data=1)
    one = mesh_from_config(c, devices=jax.devices()[:1])
    text = fit.memory_remedies(c, one)
    assert text.startswith("raise train.grad_accum (now 1: 16 sequences per device per microbatch)")
    assert "attention_impl" not in text and "set model.remat=full" in text and "fsdp" not in text
    c.train.seq_len, c.model.attention_impl, c.model.remat, c.train.grad_accum = 2048, "xla", "full", 16
    text = fit.memory_remedies(c, one)
    assert (
        text == "set model.attention_impl=auto (now xla: the dense [S, S] attention scores), or add devices"
    )
    c.model.attention_impl = "auto"  # resolves to blockwise at 2048 keys on CPU: nothing to change
    assert fit.memory_remedies(c, one) == "or add devices"


def test_layout_search_tries_the_ladder_until_one_fits(monkeypatch):
    """No microbatch fits: full remat, the experts over mesh.expert, the parameters over mesh.fsdp
    (here in place of the experts, which took all 8 devices), bf16 parameters, each adding to the one
    before, at one sequence per device; the first that fits is named as flags. (Memory stubbed; a
    compile XLA refuses with its rematerialization warning counts as over.)"""
    c = small_moe_config()
    devices = jax.devices()[:8]
    ladder = fit.layout_ladder(c, devices)
    assert ladder == [
        {"model.remat": "full"},
        {"model.remat": "full", "mesh.expert": 8, "mesh.data": -1},
        {"model.remat": "full", "mesh.expert": 1, "mesh.data": -1, "mesh.fsdp": 8},
        {
            "model.remat": "full",
            "mesh.expert": 1,
            "mesh.data": -1,
            "mesh.fsdp": 8,
            "model.param_dtype": "bfloat16",
        },
    ]
    seen = []

    def fake_compile(trial, devices):
        seen.append((trial.model.remat, trial.mesh.expert, trial.mesh.fsdp, trial.train.grad_accum))
        if trial.mesh.expert == 8:
            e = RuntimeError(
                "INTERNAL: CUDA Runtime error: Error loading CUDA libraries. GPU will not be used."
            )
            e.xla_log = (REMAT_LOG,)
            raise e
        mib = 30 if trial.mesh.fsdp == 8 else 80
        s = types.SimpleNamespace(
            argument_size_in_bytes=mib * 2**20, output_size_in_bytes=0, alias_size_in_bytes=0
        )
        s.temp_size_in_bytes = 0
        return types.SimpleNamespace(compiled=types.SimpleNamespace(memory_analysis=lambda: s))

    monkeypatch.setattr(fit, "compile_step", fake_compile)
    gpu = dry_run.gpu_target.GpuTarget("small", "cuda", "", 35 * 2**20, "sm_90")
    tries = fit.layout_search(c, devices, gpu)
    assert seen == [
        ("full", 1, 8, 2),  # the last layout first: it fits, so the ladder is compiled in turn
        ("full", 1, 1, 2),
        ("full", 8, 1, 2),
        ("full", 1, 8, 2),
    ]  # 16 rows / 8 devices: 2 microbatches
    assert [t.fits for t in tries] == [False, False, True, True] and tries[1].note == "over XLA's limit"
    rows = fit.layout_rows(tries, c, 8)
    assert rows[0] == (
        "First layout that fits: --config.model.remat=full --config.mesh.expert=1 --config.mesh.data=-1 "
        "--config.mesh.fsdp=8 --config.train.grad_accum=2"
    )
    assert "123.30" in rows[4] and "does not fit" in rows[4]
    gpu = dry_run.gpu_target.GpuTarget("tiny", "cuda", "", 2**20, "sm_90")
    seen.clear()
    rows = fit.layout_rows(fit.layout_search(c, devices, gpu), c, 8)
    assert rows[0] == "No layout tried fits: add devices"
    assert rows[-1].endswith("as it does not fit, the rest were not compiled)")
    assert len(seen) == 1  # the last layout needs the least memory and does not fit: nothing else


@pytest.mark.slow
def test_a_32k_sequence_compiles_under_8_gib_with_the_defaults(tmp_path):
    """configs/tiny.py at one 32,768-token sequence, nothing else changed but the position limit:
    model.attention_impl's default `auto` resolves to blockwise attention on CPU, and the compiled
    step needs under 8 GiB (the dense scores' step asked XLA:CPU for 87 GB)."""
    args = ["--dry_run_devices=1", "--config.train.seq_len=32768", "--config.train.batch_size=1"]
    proc = run_dry(tmp_path, "configs/tiny.py", *args, "--config.model.max_position_embeddings=32768")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "on cpu: attention blockwise (auto)" in out, out
    unit = 2**30 if "(GiB per device)" in out else 2**20
    xla = table(out, "total (arguments + outputs - alias + temp)")[0] * unit
    assert 0 < xla < 8 * 2**30, out
    assert re.search(r"this machine's available RAM: [\d,.]+ GiB: fits", out), out
