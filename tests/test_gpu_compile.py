"""The train step compiled by XLA's GPU compiler for 8 x H100 and 8 x MI300X, without a GPU
(zaya_jax/runtime/gpu_target.py, `train --dry_run_target`).

Every fact the GPU claims rest on, checked on the compiled step rather than on the kernels alone:
our Pallas kernels reach Triton inside the real step (chosen by the target's platform, not this
CPU process'), compilation produced device code for them (cubin for sm_90, HSACO for gfx942), the
experts' compiled work stays at the routed work whatever the expert count, and the memory report.

Compiles are shared (module fixtures) and small: one block of width 64, 8 sequences of 512 tokens
(512 tokens per device on data=8). The MI300X ones load compile-only stand-ins for the ROCm
libraries (tests/support/rocm_standins.py: built with gcc from the plugin's undefined symbols).
"""

import functools
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import jaxlib
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="the gpu_compile extra is not installed")

from support import rocm_standins
from support.xla_env import FAST_COMPILE_FLAGS

from zaya_jax import sizing
from zaya_jax.analysis import compiled as compiled_lib
from zaya_jax.analysis import dry_run, fit, hardware, hlo, prediction
from zaya_jax.analysis import report as report_lib
from zaya_jax.analysis.exchange import all_to_all_bytes
from zaya_jax.config import base_config, set_model
from zaya_jax.kernels import pick_blocks
from zaya_jax.model import ZayaConfig
from zaya_jax.parallel.overlap import BLOCK_GATHER_SCOPE, BLOCK_REDUCE_SCOPE
from zaya_jax.runtime import gpu_target
from zaya_jax.training.train_state import OPTIMIZER_SCOPE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = {"zaya_gmm", "zaya_tgmm", "zaya_flash_attention_fwd", "zaya_flash_attention_dq"}
OURS |= {"zaya_flash_attention_dkv", "zaya_ns_matmul"}
SEQ, DEVICES = 512, 8


def small_config(
    experts: int = 8,
    impl: str = "auto",
    data: int = 8,
    expert_axis: int = 1,
    remat: str = "none",
    context: int = 1,
    layers: int = 1,
):
    """`layers` blocks of width 64 (bf16 compute), 8 x 512 tokens; `impl` for attention, experts and
    Newton-Schulz ('auto' resolves on the target's platform)."""
    c = base_config()
    model = dict(hidden_size=64, num_hidden_layers=layers, num_experts=experts, moe_intermediate_size=64)
    set_model(c, ZayaConfig.tiny(**model, vocab_size=128, head_dim=16, dtype="bfloat16", remat=remat))
    c.train.batch_size, c.train.seq_len = 8, SEQ
    c.mesh.data, c.mesh.expert, c.mesh.context = data, expert_axis, context
    c.model.attention_impl = c.optim.muon.ns_impl = "pallas" if impl == "pallas" else "auto"
    c.model.moe_impl = impl
    return c


@pytest.fixture(scope="module")
def rocm(tmp_path_factory):
    """The directory of the ROCm stand-ins (loaded into this process), or a skip naming why not."""
    where = tmp_path_factory.mktemp("rocm_standins")
    why = rocm_standins.standins(str(where))
    if why:
        pytest.skip(why)
    return str(where)


@functools.cache
def compiled(target: str, experts: int, impl: str, data: int = 8, expert_axis: int = 1, remat: str = "none",
             context: int = 1):  # fmt: skip
    """(GpuTarget, CompiledStep) of the small step for 8 devices of `target`; shared by the tests."""
    gpu = gpu_target.load_target(target)
    gpu_target.prepare_process()
    c = small_config(experts, impl, data, expert_axis, remat, context)
    return gpu, c, compiled_lib.compile_step(c, gpu_target.target_devices(gpu, DEVICES))


def triton_kernels(step) -> set[str]:
    return {w.name for w in hlo.work(step.compiled.as_text()) if w.kind == "triton"}


def expert_flops(step) -> float:
    return report_lib.flops_per_step(hlo.work(step.compiled.as_text()), report_lib.is_expert)


def routed_with_padding(c, experts: int) -> float:
    """Tokens x one expert's FLOPs (x3 forward + backward), plus the rows the grouped kernels' tiles
    may pad: up to one tile per expert, of the tile the kernels pick for this shape."""
    cfg = ZayaConfig.from_dict(c.model.to_dict())
    tokens = c.train.batch_size * SEQ / DEVICES
    per_token = 3 * sizing.flops_breakdown(cfg, SEQ).moe_active
    shape = {"m": int(tokens), "k": 64, "n": 128, "groups": experts}
    tile = max(pick_blocks(k, shape, jnp.bfloat16)["block_m"] for k in ("grouped_matmul", "tgmm"))
    return (tokens + experts * tile) * per_token


def test_h100_pallas_step_has_our_triton_kernels_and_cubins():
    """The pallas impls on 8 x H100 with an expert axis and remat "full": every kernel of ours is a
    Triton custom call of the compiled step (inside the expert shard_map too), ptxas made cubins
    for sm_90, the memory report fits the 80 GiB, and the expert exchange is 4 exchanges of
    C = 192 slots per peer (512 tokens per device, factor 1.5) in the dtypes the GPU moves: bf16
    tokens, fp32 outputs, their bf16 cotangent, the tokens' bf16 cotangent; plus int8 ids."""
    gpu, _c, step = compiled("h100", 8, "pallas", data=2, expert_axis=4, remat="full")
    assert triton_kernels(step) >= OURS
    code = gpu_target.device_code(step.compiled, gpu)
    assert code["cubin"] >= 1 and code["hsaco"] == 0 and code["arch"] >= 1, code
    stats = step.compiled.memory_analysis()
    rows, error = report_lib.device_rows(report_lib.memory_total(stats), gpu, 2**30)
    assert error is None and "fits" in rows[0] and "H100" in rows[0]
    main, _spill = all_to_all_bytes(step.compiled.as_text())
    n, cap, d = 4, 192, 64
    assert main == n * cap * d * (2 + 4 + 2 + 2) + n * cap  # 1.875x the ideal 4 x 512 x d x 2
    exchange = [
        op
        for op in hlo.collectives(step.compiled.as_text())
        if op.op == "all-to-all" and op.runs.main and OPTIMIZER_SCOPE not in op.op_name
    ]
    assert len(exchange) == 5  # distributed Muon's all-to-alls (zaya_jax/parallel/zero1.py) aside
    # A device of 1 MiB: the overshoot is named.
    tiny = gpu_target.GpuTarget("tiny", "cuda", gpu.config_text, 2**20, gpu.arch)
    _, error = report_lib.device_rows(report_lib.memory_total(stats), tiny, 2**30)
    assert error and "MiB more than the tiny's 1.00 MiB" in error and "\n" not in error


def test_mi300x_auto_step_is_triton_and_hsaco(rocm):
    """auto on 8 x MI300X with a context axis (data 4 x context 2, phase 3's layout): every kernel
    of ours (the platform is the mesh's, this process is CPU), flash attention with each rank's
    traced query offset included, compiled to HSACO for gfx942."""
    gpu, c, step = compiled("mi300x", 8, "auto", data=4, context=2)
    assert triton_kernels(step) >= OURS
    code = gpu_target.device_code(step.compiled, gpu)
    assert code["hsaco"] >= 1 and code["cubin"] == 0 and code["arch"] >= 1, code
    summary = report_lib.impl_summary(c, ZayaConfig.from_dict(c.model.to_dict()), "rocm")
    assert "experts pallas (auto)" in summary and "Newton-Schulz pallas (auto)" in summary
    assert "attention pallas (auto)" in summary


@pytest.mark.slow
def test_expert_work_does_not_grow_with_the_expert_count(rocm):
    """moe_impl=auto on MI300X at 8 and 32 experts (same width, top-1): the compiled expert work is
    the routed work (within 1.25x, tiles' padding included) at both counts; ragged_dot, which
    XLA:GPU expands densely, runs every expert on every token (>= 8x at 32 experts)."""
    works = {}
    for experts in (8, 32):
        _, c, step = compiled("mi300x", experts, "auto", data=4, context=2)
        works[experts] = expert_flops(step)
        routed = routed_with_padding(c, experts)
        assert 0 < works[experts] <= 1.25 * routed, (experts, works[experts], routed)
    assert works[32] <= 1.25 * works[8], works
    _, c, dense = compiled("mi300x", 32, "ragged_dot")
    assert expert_flops(dense) >= 8 * works[32]


@pytest.mark.slow
def test_zero1_collectives_hidden_behind_compute_on_mi300x(rocm):
    """The two overlaps on 8 x MI300X (two blocks, grad_accum 2): with train.overlap_grad_reduce each
    block's gradients are reduce-scattered in the last microbatch's backward, with
    train.overlap_param_gather each block's weights are gathered in the first one's forward too;
    the step's ZeRO-1 bytes stay the same, and the timeline hides most of them with the
    reduce-scatters in the backward, nearly all with both (XLA's latency-hiding scheduler, which
    the step turns on for ROCm)."""
    gpu = gpu_target.load_target("mi300x")
    hw = hardware.builtin("mi300x")
    shares, wires = {}, {}
    for reduce, gather in (("on", "off"), ("on", "on")):
        c = small_config(layers=2)
        c.train.batch_size, c.train.grad_accum = 16, 2
        c.train.overlap_grad_reduce, c.train.overlap_param_gather = reduce, gather
        step = compiled_lib.compile_step(c, gpu_target.target_devices(gpu, DEVICES))
        hlo_text = step.compiled.as_text()
        ops = [col.op_name for col in hlo.collectives(hlo_text)]
        assert any(BLOCK_REDUCE_SCOPE in op for op in ops)
        assert any(BLOCK_GATHER_SCOPE in op for op in ops) == (gather == "on")
        dp = prediction.predict(hlo_text, c, step.cfg, DEVICES, hw, step.mesh)["data_parallel"]
        shares[reduce, gather], wires[reduce, gather] = dp["hidden_share"], dp["wire_bytes"]
    assert len(set(wires.values())) == 1, wires
    assert shares["on", "off"] >= 0.5, shares
    assert shares["on", "on"] >= 0.8 and shares["on", "on"] > shares["on", "off"], shares


@pytest.mark.slow
def test_cli_gpu_target_file_that_does_not_fit(tmp_path):
    """`train --dry_run --dry_run_target=FILE --dry_run_fit --dry_run_hardware=FILE --dry_run_json=FILE`
    for a GPU file of 8 MiB (XLA compiles against it) and a hardware file of 4 MiB and its own bf16
    peak: the report (memory next to the hardware file's, the fit search, collectives, compiled
    work, device code, the predicted step), one `error:` line naming the overshoot, exit 2, and the
    JSON report written all the same, with the contract's keys, its MFU against the file's peak and
    a `hardware` object that is a valid hardware file."""
    spec = gpu_target.load_target("h100").config_text
    small = spec.replace("device_memory_size: 84942979072", f"device_memory_size: {8 * 2**20}")
    assert small != spec
    path = tmp_path / "small_gpu.txtpb"
    path.write_text(small)
    override = tmp_path / "hw.json"
    override.write_text(json.dumps({"peak_flops_per_second": {"bfloat16": 5e14}, "memory_bytes": 4 * 2**20}))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS  # the dry run sets its device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "xla_cache")
    args = ["--config.model.num_hidden_layers=1", "--config.train.batch_size=8", "--config.mesh.data=8"]
    cmd = [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py")]
    cmd += ["--dry_run", f"--dry_run_target={path}", "--dry_run_fit", *args]
    cmd += [f"--dry_run_hardware={override}", f"--dry_run_json={report}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    out = proc.stdout
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "8 x NVIDIA H100 80GB HBM3 (CUDA, sm_90; deviceless" in out
    assert "DOES NOT FIT" in out and "Largest microbatch that fits: none" in out
    assert "Least recompute that fits at 1 sequences per device (train.grad_accum=1): none" in out
    # full remat and then the last layout (bf16 parameters on top of the others) need the least
    # memory: neither fits, so no other policy or layout is compiled
    assert "(full needs the least memory: as it does not fit, the rest were not compiled)" in out
    assert "(the last layout needs the least memory: as it does not fit, the rest were not compiled)" in out
    [layout] = [line for line in out.splitlines() if line.strip().startswith(("0.", "-")) and "--config." in line]
    assert "does not fit" in layout and "--config.model.param_dtype=bfloat16" in layout, out
    for part in ("Collectives per device", "Compiled work per device", "zaya_gmm", "useful share", "cubin"):
        assert part in out, out
    assert "Predicted step per device" in out and "MFU" in out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # the hardware file's 4 MiB decide, not the GPU file's 8
    assert "MiB more than the NVIDIA H100 80GB HBM3's 4.00 MiB" in errors[0], errors[0]

    data = json.loads(report.read_text())
    p, hw, memory = data["prediction"], data["hardware"], data["memory"]
    for key in ("step_seconds", "compute_seconds", "communication_seconds", "exposed_communication_seconds"):
        assert p[key] >= 0, key
    assert p["step_seconds"] > 0 and p["compute_seconds"] > 0 and p["communication_seconds"] > 0
    assert p["step_seconds"] == pytest.approx(p["compute_seconds"] + p["exposed_communication_seconds"])
    assert p["exposed_communication_seconds"] <= p["communication_seconds"] + 1e-12
    assert hw["peak_flops_per_second"]["bfloat16"] == 5e14 and hw["name"] == "NVIDIA H100 80GB HBM3"
    assert hw["hbm_bytes_per_second"] == hardware.builtin("h100")["hbm_bytes_per_second"]
    assert p["mfu"] == pytest.approx(p["model_flops_per_device"] / (p["step_seconds"] * 5e14))
    assert p["tokens_per_second_per_device"] == pytest.approx(8 * 128 / 8 / p["step_seconds"])  # 128 tokens
    assert memory["device_bytes"] == 4 * 2**20 and memory["fits"] is False
    assert memory["total_bytes"] > memory["device_bytes"] and memory["arguments_bytes"] > 0
    assert memory["temporaries_bytes"] > 0
    assert data["collectives"]["all-reduce"]["ops"] >= 1 and data["error"]
    assert hardware.check(hw) == hw
    assert sorted(os.listdir(tmp_path)) == ["hw.json", "report.json", "small_gpu.txtpb", "xla_cache"]
    # the compiles' kernels, kept in the compilation cache directory for the next dry run
    [kernels] = os.listdir(tmp_path / "xla_cache" / "xla_gpu_kernels")
    assert kernels == f"cuda-NVIDIA_H100_80GB_HBM3-jaxlib{jaxlib.__version__}.pb"
    assert os.path.getsize(tmp_path / "xla_cache" / "xla_gpu_kernels" / kernels) > 0


def test_kernel_cache_file_per_device_kind(monkeypatch, tmp_path):
    """A GPU compile's kernel cache: one file per platform, device kind and jaxlib, in jax's
    compilation cache directory where the process can write there, else in one directory of the
    process; none for a CPU compile or where XLA_FLAGS names the option."""
    option = gpu_target.KERNEL_CACHE
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE_FLAGS)
    monkeypatch.setattr(gpu_target, "_compilation_cache_dir", lambda: str(tmp_path))
    h100 = gpu_target.kernel_cache_options("cuda", "NVIDIA H100 80GB HBM3")[option]
    mi300x = gpu_target.kernel_cache_options("rocm", "AMD Instinct MI300X")[option]
    assert os.path.dirname(h100) == os.path.dirname(mi300x) == str(tmp_path / "xla_gpu_kernels")
    assert os.path.basename(mi300x) == f"rocm-AMD_Instinct_MI300X-jaxlib{jaxlib.__version__}.pb"
    assert gpu_target.kernel_cache_options("cpu", "cpu") == {}
    monkeypatch.setattr(gpu_target, "_compilation_cache_dir", lambda: None)
    own = gpu_target.kernel_cache_options("cuda", "NVIDIA H100 80GB HBM3")[option]
    assert os.path.isdir(os.path.dirname(own)) and not own.startswith(str(tmp_path))
    assert gpu_target.kernel_cache_options("cuda", "NVIDIA H100 80GB HBM3")[option] == own
    # a cache directory the process cannot use (missing parent that cannot be made, remote): its own
    for unusable in ("/proc/no_such_cache", "gs://bucket/xla_cache"):
        monkeypatch.setattr(gpu_target, "_compilation_cache_dir", lambda d=unusable: d)
        assert gpu_target.kernel_cache_options("cuda", "NVIDIA H100 80GB HBM3")[option] == own
    monkeypatch.setenv("XLA_FLAGS", f"{FAST_COMPILE_FLAGS} --{option}=/elsewhere/kernels.pb")
    assert gpu_target.kernel_cache_options("cuda", "NVIDIA H100 80GB HBM3") == {}


def test_rocm_without_its_libraries_is_one_line(tmp_path):
    """Without ROCm 7 (and no stand-ins on the loader's path) a MI300X dry run ends before any
    compile with one `error:` line naming the missing libraries."""
    plugin = rocm_standins.plugin_library()
    if plugin is None:
        pytest.skip("jax-rocm7-plugin is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    probe = [
        sys.executable,
        "-c",
        f"from zaya_jax.runtime.gpu_target import missing_libraries as m; print(m({plugin!r}))",
    ]
    missing = subprocess.run(probe, capture_output=True, text=True, env=env, check=True).stdout.strip()
    if missing == "[]":
        pytest.skip("ROCm 7 is installed here: the dry run uses it")
    cmd = [sys.executable, "-m", "zaya_jax.train", "--config", os.path.join(ROOT, "configs/tiny.py")]
    proc = subprocess.run(
        [*cmd, "--dry_run", "--dry_run_target=mi300x"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "libamdhip64.so.7" in errors[0] and "not found" in errors[0], proc.stderr[
        -2000:
    ]


def test_fit_search_is_a_binary_search_over_powers_of_two(monkeypatch):
    """The search compiles sizes of 1, 2, 4, ... sequences per device (grad_accum to match; the
    powers of two dividing the per-device batch, then the whole of it) by bisection, memory growing
    with the microbatch; a compile XLA refuses counts as not fitting. (Memory stubbed: 10 MiB per
    sequence; the real compiles are test_cli_gpu_target_file_that_does_not_fit's.)"""
    c = small_config()
    c.train.batch_size = 8 * 12  # 12 sequences per device: the ladder 1, 2, 4, 12
    seen = []

    class Stats:
        def __init__(self, micro):
            self.argument_size_in_bytes = self.output_size_in_bytes = self.alias_size_in_bytes = 0
            self.temp_size_in_bytes = micro * 10 * 2**20

    def fake_compile(trial, devices):
        micro = trial.train.batch_size // 8 // trial.train.grad_accum
        seen.append((micro, trial.train.grad_accum))
        if micro == 12:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore")
        return type("Step", (), {"compiled": type("C", (), {"memory_analysis": lambda self: Stats(micro)})()})

    monkeypatch.setattr(fit, "compile_step", fake_compile)
    gpu = gpu_target.GpuTarget("small", "cuda", "", 35 * 2**20, "sm_90")
    tries = fit.fit_search(c, list(range(8)), gpu)
    assert seen == [(2, 6), (4, 3)]  # bisection: 2 fits, 4 does not
    assert [(t.micro, t.fits) for t in tries] == [(2, True), (4, False)]
    assert (
        fit.fit_rows(tries)[0]
        == "Largest microbatch that fits: 2 sequences per device (train.grad_accum=6)"
    )
    seen.clear()
    gpu = gpu_target.GpuTarget("big", "cuda", "", 2**40, "sm_90")
    tries = fit.fit_search(c, list(range(8)), gpu)
    assert seen == [(2, 6), (4, 3), (12, 1)] and tries[-1].note.startswith("RESOURCE_EXHAUSTED")
    assert "did not compile: RESOURCE_EXHAUSTED" in fit.fit_rows(tries)[-1]
    assert fit.fit_rows(tries)[0].endswith("4 sequences per device (train.grad_accum=3)")
    seen.clear()
    gpu = gpu_target.GpuTarget("none", "cuda", "", 2**20, "sm_90")
    assert fit.fit_rows(fit.fit_search(c, list(range(8)), gpu))[0].endswith(
        "none (not even 1 sequence per device)"
    )
    assert seen == [(2, 6), (1, 12)]
    seen.clear()
    c.train.grad_accum = 1  # the config's own size (12) was refused by XLA: not compiled again
    tries = fit.fit_search(c, list(range(8)), gpu, own_error="INTERNAL: refused")
    assert (tries[-1].micro, tries[-1].note) == (12, "INTERNAL: refused") and (12, 1) not in seen


def test_a_step_xla_refuses_is_reported_with_one_error_line(monkeypatch):
    """XLA:CUDA ends a step whose buffers exceed the device with "Error loading CUDA libraries"
    (measured on zaya1_base phase1, 512 sequences per device): the report says so, runs the fit
    search, and the error line names XLA's reason."""
    import jax

    def refuse(trial, devices):
        if trial.train.grad_accum == 1:
            raise jax.errors.JaxRuntimeError(
                "INTERNAL: CUDA Runtime error: Error loading CUDA libraries.\nmore"
            )
        raise RuntimeError("RESOURCE_EXHAUSTED: smaller too")

    for module in (dry_run, fit):  # the step itself, then the fit search
        monkeypatch.setattr(module, "compile_step", refuse)
    report = dry_run.dry_run(small_config(), 8, "small", target="h100", fit=True)
    assert "XLA's GPU compiler refused the step: INTERNAL: CUDA Runtime error" in report.text
    assert "Largest microbatch that fits: none" in report.text
    assert report.error.startswith("XLA's H100 SXM compiler did not compile the train step: INTERNAL")
    assert report.error.endswith("try --dry_run_fit)") and "\n" not in report.error


def test_a_step_over_xlas_memory_limit_is_named_as_memory(monkeypatch):
    """XLA:CUDA's "Error loading CUDA libraries" after its rematerialization logged that the buffers
    stay over its limit (zaya1_base phase1 on 8 x H100 at grad_accum 64: 123.3 GiB against 62 GiB):
    the error says it is memory, how much, against what, and the remedies."""
    import jax

    log = (
        ("W1129 02:48:09.000000  1234 hlo_rematerialization.cc:3005] Can't reduce memory use below 62.00GiB "
        "(66571993088 bytes) by rematerialization; only reduced to 123.30GiB (132391809024 bytes), down "
        "from 150.00GiB (161061273600 bytes) originally\n"),
    )

    def refuse(trial, devices):
        e = jax.errors.JaxRuntimeError(
            "INTERNAL: CUDA Runtime error: Error loading CUDA libraries. GPU will not be used."
        )
        e.xla_log = log
        raise e

    for module in (dry_run, fit):  # the step itself, then the fit search
        monkeypatch.setattr(module, "compile_step", refuse)
    c = small_config()
    c.train.grad_accum = 1
    report = dry_run.dry_run(c, 8, "small", target="h100")
    assert (
        "XLA's rematerialization could not bring the buffers under its 62.00 GiB limit: only to 123.30 GiB"
        in (report.text)
    )
    assert report.error.startswith(
        "the train step does not fit the H100 SXM's memory: its buffers need at least 123.30 GiB per device, "
        "over the 62.00 GiB XLA allows of the 80.00 GiB device"
    ), report.error
    assert "the CUDA-libraries error that follows is this, not the install" in report.error
    assert "set model.remat=full" in report.error
    assert "\n" not in report.error
