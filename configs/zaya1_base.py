"""ZAYA1-base at the released sizes (SPEC §1) with the three public pretraining phases (SPEC §4).

  --config configs/zaya1_base.py:phase1   4k context, RoPE theta 10k, 8T tokens
  --config configs/zaya1_base.py:phase2   4k context, RoPE theta 10k, 4T tokens   (init_from phase 1)
  --config configs/zaya1_base.py:phase3   32k context, RoPE theta 1M, 1.2T tokens (init_from phase 2)

Every phase keeps 4096 x 4096 = 16.8M tokens per optimizer step (the paper's global batch), so the
32k phase runs 512 sequences per step. A phase after the first starts from the previous phase's
checkpoint: pass `--config.train.init_from=WORKDIR_OF_PREVIOUS_PHASE` (its latest checkpoint).
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


def get_config(phase: str = "phase1"):
    if phase not in PHASES:
        raise ValueError(f"configs/zaya1_base.py: unknown phase {phase!r}; expected one of {sorted(PHASES)}")
    seq_len, theta, tokens = PHASES[phase]
    c = base_config()
    set_model(
        c,
        ZayaConfig.zaya1_base(
            rope_theta=theta,
            dtype="bfloat16",
            param_dtype="float32",
            remat="full",
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
    )
    c.train.seq_len = seq_len
    c.train.batch_size = TOKENS_PER_STEP // seq_len
    c.train.steps = int(tokens // TOKENS_PER_STEP)
    c.train.grad_accum = 1
    c.optim.lr = 1e-3 if phase == "phase1" else 5e-4
    c.optim.warmup_steps = 2000 if phase == "phase1" else 500
    c.optim.schedule = "wsd"
    c.optim.decay_fraction = 0.1 if phase != "phase3" else 0.5
    c.mesh.data = -1
    c.checkpoint.every_steps = 1000
    c.eval.every_steps = 2000
    c.eval.batches = 50
    c.eval.batch_size = 64
    c.logging.every_steps = 10
    return c
