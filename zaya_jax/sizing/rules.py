"""The GEMM sizing rules of the MI300X (docs/model.md §4): the forward GEMMs of a config and the
warnings for dimensions that break the rules. The paper measured that an MI300X GEMM needs ~200
GFLOP to reach peak throughput, so a per-expert GEMM far below that (few tokens per expert per
device) runs far from peak."""

from __future__ import annotations

from collections.abc import Mapping

from zaya_jax.model.config import ZayaConfig

# docs/model.md §4: an MI300X GEMM needs roughly this much work to reach peak throughput.
GEMM_PEAK_WORK_FLOPS = 200e9
# A GEMM below this fraction of GEMM_PEAK_WORK_FLOPS is "far below" the rule and gets a warning.
GEMM_FAR_BELOW_FRACTION = 0.25


def gemm_shapes(
    cfg: ZayaConfig, tokens: int, expert_axis: int = 1, head_tokens: int | None = None
) -> list[tuple[str, int, int, int]]:
    """The forward GEMMs of one block and the head as (name, M, N, K) for `tokens` tokens per device.

    Experts see tokens * expert_axis / E rows each (top-1, uniform routing; the all-to-all brings the
    expert group's tokens to the device that holds the expert). The head sees `head_tokens` rows per
    call (the loss chunk; default all tokens)."""
    d, nq, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    i, r = cfg.moe_intermediate_size, cfg.router_hidden_size
    tpe = max(1, round(tokens * expert_axis / cfg.num_experts))
    return [
        ("q_proj", tokens, nq * hd, d),
        ("k_proj", tokens, nkv * hd, d),
        ("v_proj (each half)", tokens, nkv * hd // 2, d),
        ("o_proj", tokens, d, nq * hd),
        ("router down", tokens, r, d),
        ("router fc1/fc2", tokens, r, r),
        ("router out", tokens, cfg.num_router_classes, r),
        ("expert gate_up", tpe, 2 * i, d),
        ("expert down", tpe, d, i),
        ("lm head", head_tokens or tokens, cfg.vocab_size, d),
    ]


def sizing_warnings(
    cfg: ZayaConfig,
    *,
    tokens_per_device: int | None = None,
    mesh: Mapping[str, int] | None = None,
    gemm_peak_work: float = GEMM_PEAK_WORK_FLOPS,
    far_below: float = GEMM_FAR_BELOW_FRACTION,
) -> list[str]:
    """Human-readable warnings for dimensions that break the GEMM sizing rules (docs/model.md §4).

    "WARNING" lines break a rule (width not a multiple of 64, head_dim != 128, experts not divisible by
    the expert axis, expert GEMMs far below the ~200 GFLOP needed for peak); "note" lines are softer
    (a multiple of 64 but not of 256)."""
    mesh = dict(mesh or {"data": 1, "fsdp": 1, "expert": 1})
    out = []
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    widths = [
        ("hidden_size", cfg.hidden_size),
        ("query width num_attention_heads*head_dim", nq * hd),
        ("key width num_key_value_heads*head_dim", nkv * hd),
        ("value half-width num_key_value_heads*head_dim/2", nkv * hd // 2),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("router_hidden_size", cfg.router_hidden_size),
        ("vocab_size", cfg.vocab_size),
    ]
    for name, value in widths:
        if value % 64:
            out.append(
                f"WARNING {name}={value} is not a multiple of 64: GEMM tiles run partly empty "
                f"(pad to {-(-value // 64) * 64}, ideally {-(-value // 256) * 256})"
            )
        elif value % 256:
            out.append(f"note    {name}={value} is a multiple of 64 but not of 256 (ideal for MI300X GEMMs)")
    if hd != 128:
        out.append(f"WARNING head_dim={hd}: attention kernels are tuned for head_dim 128")
    e_ax = mesh.get("expert", 1)
    if cfg.num_experts % e_ax:
        out.append(f"WARNING num_experts={cfg.num_experts} is not divisible by the expert axis {e_ax}")
    if tokens_per_device:
        tpe = tokens_per_device * e_ax / cfg.num_experts
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        gate_up = 2 * tpe * d * 2 * i
        if gate_up < far_below * gemm_peak_work:
            need = gemm_peak_work / (2 * d * 2 * i)
            out.append(
                f"WARNING expert GEMMs are small: {tpe:,.0f} tokens per expert per device "
                f"({tokens_per_device:,} tokens x expert axis {e_ax} / {cfg.num_experts} experts) give "
                f"{gate_up / 1e9:.1f} GFLOP per expert gate_up GEMM, {gate_up / gemm_peak_work:.0%} of the "
                f"~{gemm_peak_work / 1e9:.0f} GFLOP an MI300X GEMM needs for peak (~{need:,.0f} tokens per "
                f"expert); raise the micro-batch or the expert axis"
            )
    return out
