"""ZAYA1-base at the released sizes (SPEC §1) with the three public pretraining phases (SPEC §4).

  --config configs/zaya1_base.py:phase1   4k context, RoPE theta 10k, 8T tokens
  --config configs/zaya1_base.py:phase2   4k context, RoPE theta 10k, 4T tokens   (init_from phase 1)
  --config configs/zaya1_base.py:phase3   32k context, RoPE theta 1M, 1.2T tokens (init_from phase 2),
                                          context parallel over 2 devices (mesh.context=2,
                                          zigzag layout)

Every phase keeps 4096 x 4096 = 16.8M tokens per optimizer step (the paper's global batch), so the
32k phase runs 512 sequences per step. A phase after the first starts from the previous phase's
checkpoint: pass `--config.train.init_from=WORKDIR_OF_PREVIOUS_PHASE` (its latest checkpoint).

Data (README "Data: mixtures and phases"). Without more, a phase trains on the embedded corpus.
`--config configs/zaya1_base.py:phase2,data=DIR` trains on the phase's mixture of the prepared
datasets DIR/web, DIR/code, DIR/math, DIR/reasoning (and DIR/long in phase 3); or set
`--config.data.mixture=PATH:WEIGHT,...` directly. Phase 1 ramps the batch size up (train.batch_ramp).

PLACEHOLDERS: Zyphra's mixtures and batch ramp are not public (SPEC §4). The weights and the ramp
below only show the *shape* of the recipe (phase 2 leans towards reasoning, maths and code; phase 3
adds long documents; the batch ramps up at the start of phase 1); replace them with your own.
"""

from zaya_jax.config import base_config, set_model
from zaya_jax.model import ZayaConfig

TOKENS_PER_STEP = 4096 * 4096
PHASES = {
    # name: (sequence length, RoPE theta, tokens)
    "phase1": (4096, 10_000.0, 8e12),
    "phase2": (4096, 10_000.0, 4e12),
    "phase3": (32768, 1_000_000.0, 1.2e12),
}


# PLACEHOLDER weights (not Zyphra's): source name (a directory under data=DIR) -> weight
MIXTURES = {
    "phase1": {"web": 0.7, "code": 0.1, "math": 0.1, "reasoning": 0.1},
    "phase2": {"web": 0.4, "code": 0.2, "math": 0.2, "reasoning": 0.2},
    "phase3": {"long": 0.5, "web": 0.2, "code": 0.1, "math": 0.1, "reasoning": 0.1},
}
# PLACEHOLDER ramp (not Zyphra's): 1024 -> 4096 sequences in steps of 1024 over the first 4M sequences.
# train.steps counts optimizer steps, so with it phase 1 draws 0.3% fewer than its 8T tokens.
BATCH_RAMPS = {"phase1": "1024,1024,4194304"}


def get_config(arg: str = "phase1"):
    phase, *options = arg.split(",")
    if phase not in PHASES:
        raise ValueError(f"configs/zaya1_base.py: unknown phase {phase!r}; expected one of {sorted(PHASES)}")
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in options)
    if set(options) - {"data"}:
        unknown = sorted(set(options) - {"data"})
        raise ValueError(f"configs/zaya1_base.py: unknown option(s) {unknown}; expected data=DIR")
    seq_len, theta, tokens = PHASES[phase]
    c = base_config()
    set_model(
        c,
        ZayaConfig.zaya1_base(
            rope_theta=theta,
            dtype="bfloat16",
            param_dtype="float32",
            # The 4k phases keep every matmul output (1.02x remat none's compiled FLOPs, 109 GiB per
            # MI300X at one sequence per microbatch); the 32k phase recomputes the whole block
            # (docs/performance.md "Remat policies").
            remat="full" if phase == "phase3" else "matmuls",
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            # Pallas flash attention on GPUs (the 32k phase's context ranks too), blockwise from
            # 1024 keys on CPUs: the dense XLA scores of a 32k step do not fit
            # (kernels.attention_choice, docs/conventions.md).
            attention_impl="auto",
        ),
    )
    c.train.seq_len = seq_len
    c.train.batch_size = TOKENS_PER_STEP // seq_len
    c.train.steps = int(tokens // TOKENS_PER_STEP)
    c.train.grad_accum = 1
    c.train.batch_ramp = BATCH_RAMPS.get(phase)
    if options.get("data"):
        c.data.mixture = ",".join(f"{options['data']}/{name}:{w}" for name, w in MIXTURES[phase].items())
    c.optim.lr = 1e-3 if phase == "phase1" else 5e-4
    c.optim.warmup_steps = 2000 if phase == "phase1" else 500
    c.optim.schedule = "wsd"
    c.optim.decay_fraction = 0.1 if phase != "phase3" else 0.5
    c.mesh.data = -1
    # The 32k phase splits every sequence over 2 devices, as Zyphra ran it (docs/model.md §4): keys and
    # values are all-gathered over the pair, CCA's conv takes its left rows from the neighbour.
    c.mesh.context = 2 if phase == "phase3" else 1
    # Rank r holds chunks r and 3 - r of 4: causal attention skips as many key blocks on both ranks
    # (contiguous halves would leave rank 1 with 3/4 of the work).
    c.mesh.context_layout = "zigzag" if phase == "phase3" else "contiguous"
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 2000
    c.eval.batches = 50
    c.eval.batch_size = 64
    c.logging.every_steps = 10
    return c
