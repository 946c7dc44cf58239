"""The step-time model (zaya_jax/analysis/timeline.py, zaya_jax/analysis/hardware.py) on programs
whose answer is known: one dot, an async all-gather with and without compute beside it, a while loop's trips, the bus
bandwidth of each collective by where its group lies. Hand-written HLO in XLA:GPU's post-optimisation
form (operands named, not typed; async collectives as -start / -done pairs) and small programs
compiled by XLA's GPU compiler for deviceless H100s. Round figures (TEST_HW) make each answer one
division."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.cli_runs import one_error
from support.xla_env import FAST_COMPILE_FLAGS

from zaya_jax.analysis import hardware, timeline

PEAK, HBM, INTRA, INTER, LATENCY = 1e12, 1e20, 1e9, 1e8, 1e-5
TEST_HW = hardware.check(
    {
        "name": "test GPU",
        "peak_flops_per_second": {"bfloat16": PEAK, "float32": PEAK / 4},
        "hbm_bytes_per_second": HBM,
        "memory_bytes": 2**30,
        "gpus_per_node": 8,
        "intra_node_bus_bytes_per_second": INTRA,
        "inter_node_bus_bytes_per_second": INTER,
        "collective_latency_seconds": 0.0,
    }
)


def dot_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def module(entry: str, partitions: int = 8, extra: str = "") -> str:
    """A GPU-style module: a GEMM fusion computation of [M, 512] x [512, 128] (M from its use), the
    `extra` computations, and ENTRY."""
    return f"""HloModule jit_f, is_scheduled=true, num_partitions={partitions}

%gemm_computation (p0: bf16[256,512], p1: bf16[512,128]) -> bf16[256,128] {{
  %p0 = bf16[256,512]{{1,0}} parameter(0)
  %p1 = bf16[512,128]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[256,128]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
{extra}
ENTRY %main (a: bf16[256,512], b: bf16[512,128], w: bf16[64,1024]) -> bf16[256,128] {{
  %a = bf16[256,512]{{1,0}} parameter(0)
  %b = bf16[512,128]{{1,0}} parameter(1)
  %w = bf16[64,1024]{{1,0}} parameter(2)
{entry}
}}
"""


GEMM = "  %{name} = bf16[256,128]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_computation"
GEMM_SECONDS = dot_flops(256, 512, 128) / PEAK
START = (
    "  %ag-start = (bf16[64,1024]{1,0}, bf16[512,1024]{1,0}) all-gather-start(%w), channel_id=1, "
    "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
)
DONE = "  %ag-done = bf16[512,1024]{1,0} all-gather-done(%ag-start)"
GATHER_SECONDS = 512 * 1024 * 2 * 7 / 8 / INTRA  # (n-1)/n of the gathered buffer over the bus


def test_one_dot_hand_written():
    cost = timeline.step_cost(
        module(GEMM.format(name="g") + "\n  ROOT %r = bf16[256,128]{1,0} copy(%g)"), TEST_HW
    )
    assert cost.kinds["gemm"] == pytest.approx(GEMM_SECONDS, rel=1e-9)
    assert cost.seconds == pytest.approx(cost.compute) and cost.communication == 0 and cost.exposed == 0
    assert cost.kernels == 2  # the GEMM and the copy (memory-bound: its bytes over HBM, ~0 here)


def test_async_all_gather_without_compute_beside_it_is_exposed():
    cost = timeline.step_cost(module("\n".join([START, DONE, GEMM.format(name="g")])), TEST_HW)
    assert cost.communication == pytest.approx(GATHER_SECONDS, rel=1e-9)
    assert cost.exposed == pytest.approx(GATHER_SECONDS, rel=1e-9)
    assert cost.seconds == pytest.approx(GATHER_SECONDS + GEMM_SECONDS, rel=1e-9)
    assert cost.collectives["all-gather"] == [pytest.approx(GATHER_SECONDS), pytest.approx(GATHER_SECONDS), 1]


@pytest.mark.parametrize("gemms", [1, 3, 2000])
def test_async_all_gather_hidden_by_the_compute_between_start_and_done(gemms):
    """k GEMMs between start and done hide k x the GEMM's time of the gather; the rest is exposed."""
    between = [GEMM.format(name=f"g{i}") for i in range(gemms)]
    cost = timeline.step_cost(module("\n".join([START, *between, DONE])), TEST_HW)
    compute = gemms * GEMM_SECONDS
    assert cost.compute == pytest.approx(compute, rel=1e-9)
    assert cost.communication == pytest.approx(GATHER_SECONDS, rel=1e-9)
    assert cost.exposed == pytest.approx(max(0.0, GATHER_SECONDS - compute), rel=1e-9, abs=1e-15)
    assert cost.seconds == pytest.approx(max(compute, GATHER_SECONDS), rel=1e-9)


def test_while_loop_runs_its_trip_count():
    """A body of one GEMM and one synchronous all-reduce, 7 trips: 7 x both, all exposed."""
    body = """
%body (param: (s32[], bf16[256,512], bf16[512,128])) -> (s32[], bf16[256,512], bf16[512,128]) {
  %param = (s32[], bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %a = bf16[256,512]{1,0} get-tuple-element(%param), index=1
  %b = bf16[512,128]{1,0} get-tuple-element(%param), index=2
  %g = bf16[256,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation
  %ar = bf16[256,128]{1,0} all-reduce(%g), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (s32[], bf16[256,512]{1,0}, bf16[512,128]{1,0}) tuple(%i, %a, %b)
}

%cond (param.1: (s32[], bf16[256,512], bf16[512,128])) -> pred[] {
  %param.1 = (s32[], bf16[256,512]{1,0}, bf16[512,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}
"""
    entry = """  %zero = s32[] constant(0)
  %init = (s32[], bf16[256,512]{1,0}, bf16[512,128]{1,0}) tuple(%zero, %a, %b)
  %loop = (s32[], bf16[256,512]{1,0}, bf16[512,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}"""
    cost = timeline.step_cost(module(entry, extra=body), TEST_HW)
    reduce = 2 * 256 * 128 * 2 * 3 / 4 / INTRA  # all-reduce: 2 (n-1)/n of the buffer
    assert cost.compute == pytest.approx(7 * GEMM_SECONDS, rel=1e-9)
    assert cost.communication == pytest.approx(7 * reduce, rel=1e-9)
    assert cost.exposed == pytest.approx(7 * reduce, rel=1e-9)
    assert cost.seconds == pytest.approx(7 * (GEMM_SECONDS + reduce), rel=1e-9)
    assert cost.collectives["all-reduce"][2] == 7


@pytest.mark.parametrize(
    "op, result, groups, expected",
    [
        # reduce-scatter: the result is 1/n of the reduced buffer; (n-1)/n of that buffer moves
        ("reduce-scatter", "f32[128]", "{{0,1,2,3,4,5,6,7}}", 128 * 4 * 7 / INTRA),
        ("all-gather", "f32[1024]", "{{0,1,2,3},{4,5,6,7}}", 1024 * 4 * 3 / 4 / INTRA),
        ("all-reduce", "f32[1024]", "{{0,8},{1,9}}", 2 * 1024 * 4 / 2 / INTER),  # spans two nodes
        ("all-to-all", "f32[1024]", "[2,8]<=[16]", 1024 * 4 * 7 / 8 / INTRA),  # iota: 0-7, 8-15
        ("all-reduce", "f32[1024]", "{}", 2 * 1024 * 4 * 15 / 16 / INTER),  # every device: 2 nodes
    ],
)
def test_collective_bus_bandwidth_by_algorithm_and_place(op, result, groups, expected):
    hw = {**TEST_HW, "collective_latency_seconds": LATENCY}
    line = f"  %c = {result}{{0}} {op}(%x), replica_groups={groups}, dimensions={{0}}"
    entry = f"  %x = {result}{{0}} parameter(3)\n{line}"
    cost = timeline.step_cost(module(entry, partitions=16), hw)
    assert cost.communication == pytest.approx(LATENCY + expected, rel=1e-9)
    assert cost.exposed == pytest.approx(cost.communication) == pytest.approx(cost.seconds)


def test_fully_connected_links_scale_with_the_group():
    """xGMI: a group of 2 of a node's 8 gets one of its 7 links' share."""
    hw = {**TEST_HW, "intra_node_links": "fully_connected"}
    line = "  %c = f32[1024]{0} all-gather(%x), replica_groups={{0,1}}, dimensions={0}"
    cost = timeline.step_cost(module(f"  %x = f32[512]{{0}} parameter(3)\n{line}"), hw)
    assert cost.communication == pytest.approx(1024 * 4 / 2 / (INTRA / 7), rel=1e-9)


def test_in_place_update_counts_the_update_bytes():
    """A fusion writing one [1, 1024] f32 row into a [4096, 1024] buffer in place moves the row
    (read and written) and its index, not the buffer."""
    extra = """
%dus_computation (p0: f32[4096,1024], p1: f32[1,1024], p2: s32[]) -> f32[4096,1024] {
  %p0 = f32[4096,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[4096,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}
"""
    entry = """  %buf = f32[4096,1024]{1,0} parameter(3)
  %row = f32[1,1024]{1,0} parameter(4)
  %i = s32[] parameter(5)
  ROOT %f = f32[4096,1024]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%dus_computation"""
    hw = {**TEST_HW, "hbm_bytes_per_second": 1e9, "kernel_overhead_seconds": 2e-6}
    cost = timeline.step_cost(module(entry, extra=extra), hw)
    assert cost.kinds["memory"] == pytest.approx((2 * 1024 * 4 + 4) / 1e9 + 2e-6, rel=1e-9)


def test_in_place_update_through_bitcasts_counts_the_update_bytes():
    """The same update when the buffer reaches the dynamic-update-slice through a bitcast and the
    result leaves through one (a layer stack laid out with another dimension major, as XLA writes
    a gathered weight into it): XLA still updates in place, so the buffer is not moved."""
    extra = """
%dus_computation (p0: f32[4096,1024], p1: f32[1024], p2: s32[]) -> f32[1024,4096] {
  %p0 = f32[4096,1024]{0,1} parameter(0)
  %b0 = f32[1024,4096]{1,0} bitcast(%p0)
  %p1 = f32[1024]{0} parameter(1)
  %b1 = f32[1024,1]{1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[1024,4096]{1,0} dynamic-update-slice(%b0, %b1, %z, %p2)
  ROOT %r = f32[1024,4096]{1,0} bitcast(%u)
}
"""
    entry = """  %buf = f32[4096,1024]{0,1} parameter(3)
  %row = f32[1024]{0} parameter(4)
  %i = s32[] parameter(5)
  ROOT %f = f32[1024,4096]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%dus_computation"""
    hw = {**TEST_HW, "hbm_bytes_per_second": 1e9, "kernel_overhead_seconds": 2e-6}
    cost = timeline.step_cost(module(entry, extra=extra), hw)
    assert cost.kinds["memory"] == pytest.approx((2 * 1024 * 4 + 4) / 1e9 + 2e-6, rel=1e-9)


def test_triton_kernel_uses_its_declared_flops_and_efficiency():
    line = (
        '  %k = bf16[256,128]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={grid_x = 2 : i32, name = "zaya_gmm_flops_1000000000", num_warps = 4 : i32}'
    )
    hw = {**TEST_HW, "kernel_efficiency": {"default": 0.5, "zaya_gmm": 0.25}}
    cost = timeline.step_cost(module(line), hw)
    assert cost.kinds["triton"] == pytest.approx(1e9 / (PEAK * 0.25), rel=1e-9)


def test_gemm_efficiency_interpolates_in_log_flops():
    hw = {**TEST_HW, "gemm_efficiency": [[1e8, 0.1], [1e10, 0.5]]}
    assert hardware.gemm_efficiency(hw, 1e6) == 0.1 and hardware.gemm_efficiency(hw, 1e12) == 0.5
    assert hardware.gemm_efficiency(hw, 1e9) == pytest.approx(0.3)


# --------------------------------------------------------------------------- compiled for H100
@pytest.fixture(scope="module")
def h100():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="the gpu_compile extra is not installed")
    from zaya_jax.runtime import gpu_target

    gpu = gpu_target.load_target("h100")
    gpu_target.prepare_process()
    return gpu_target.target_devices(gpu, 8)


def compiled_text(devices, f, *shapes) -> str:
    mesh = Mesh(np.array(devices), ("data",))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p)) for s, p in shapes]
    return jax.jit(f).lower(*args).compile().as_text()


def test_compiled_dot(h100):
    text = compiled_text(h100[:1], lambda a, b: a @ b, ((256, 512), P()), ((512, 1024), P()))
    cost = timeline.step_cost(text, TEST_HW)
    assert cost.kinds["gemm"] == pytest.approx(dot_flops(256, 512, 1024) / PEAK, rel=1e-9)
    assert cost.communication == 0 and cost.seconds == pytest.approx(cost.compute)


def test_compiled_while_loop(h100):
    """x @ y, then 5 trips of c @ y: six GEMMs of 1024^3."""

    def f(x, y):
        return jax.lax.fori_loop(0, 5, lambda i, c: c @ y, x @ y)

    text = compiled_text(h100[:1], f, ((1024, 1024), P()), ((1024, 1024), P()))
    cost = timeline.step_cost(text, TEST_HW)
    assert cost.kinds["gemm"] == pytest.approx(6 * dot_flops(1024, 1024, 1024) / PEAK, rel=1e-9)


def test_compiled_all_gather_alone_and_beside_compute(h100):
    """The gather of a [4096, 1024] bf16 buffer over 8 devices: exposed alone; beside six GEMMs of
    1024^3 that do not depend on it (XLA schedules them between its start and done), hidden."""
    gather = 4096 * 1024 * 2 * 7 / 8 / INTRA
    everywhere = NamedSharding(Mesh(np.array(h100), ("data",)), P())

    def replicate(w):
        return jax.lax.with_sharding_constraint(w, everywhere)

    alone = timeline.step_cost(
        compiled_text(h100, lambda w: replicate(w) * 2, ((4096, 1024), P("data"))), TEST_HW
    )
    assert alone.communication == pytest.approx(gather, rel=1e-9)
    assert alone.exposed == pytest.approx(gather, rel=1e-9)

    def beside(w, x, y):
        z = jax.lax.fori_loop(0, 5, lambda i, c: c @ y, x @ y)
        return (replicate(w) * 2).sum() + z.sum()

    shapes = (((4096, 1024), P("data")), ((1024, 1024), P()), ((1024, 1024), P()))
    cost = timeline.step_cost(compiled_text(h100, beside, *shapes), TEST_HW)
    compute = 6 * dot_flops(1024, 1024, 1024) / PEAK
    assert compute > gather
    assert cost.communication == pytest.approx(gather, rel=1e-9)
    assert cost.exposed == 0
    assert cost.seconds == pytest.approx(cost.compute) and cost.compute >= compute


# ------------------------------------------------------------------------------------ hardware
def test_builtin_hardware_files_are_complete_with_sources():
    for target in hardware.FILES:
        hw = hardware.builtin(target)
        numbers = [
            k for k in hardware.REQUIRED + hardware.OPTIONAL if k in hw and k not in ("name", "sources")
        ]
        assert not [k for k in numbers if k not in hw["sources"]], target
        assert hardware.check(json.loads(json.dumps(hw))) == hw  # the report's object is a valid file


def test_override_merges_by_dtype_and_checks_values(tmp_path):
    base = hardware.builtin("h200")
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"peak_flops_per_second": {"bfloat16": 5e14}, "gpus_per_node": 4}))
    hw = hardware.merged(base, hardware.read_file(str(path)))
    assert hw["peak_flops_per_second"] == {**base["peak_flops_per_second"], "bfloat16": 5e14}
    assert hw["gpus_per_node"] == 4 and hw["name"] == "H200"
    for bad, what in [
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"hbm_bytes_per_second": -1}, "hbm_bytes_per_second"),
        ({"gemm_efficiency": [[1e9, 0.5], [1e8, 0.6]]}, "gemm_efficiency"),
        ({"kernel_efficiency": {"zaya_gmm": 1.5}}, "kernel_efficiency.zaya_gmm"),
        ({"peak_flop_per_second": {}}, "unknown key 'peak_flop_per_second'"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=what):
            hardware.read_file(str(path))
    with pytest.raises(ValueError, match="missing key"):
        hardware.merged(None, {"name": "x"})


# ------------------------------------------------------------------------------------------ CLI
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.model.num_hidden_layers=1", "--config.train.batch_size=8", "--config.mesh.data=8"]


def train_cli(cwd, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS  # the dry run sets its device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env, check=False)


def test_cli_bad_hardware_file_is_one_line_at_start_up(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"hbm_bytes_per_second": "fast"}))
    proc = train_cli(tmp_path, "--dry_run", "--dry_run_target=h100", f"--dry_run_hardware={bad}")
    assert "hbm_bytes_per_second" in one_error(proc)
    proc = train_cli(tmp_path, f"--dry_run_json={tmp_path / 'r.json'}")
    assert "--dry_run_json" in one_error(proc) and not (tmp_path / "r.json").exists()
