"""lm-evaluation-harness over our own checkpoints: the model backend `zaya_jax` and its CLI.

    python -m zaya_jax.lm_eval --model zaya_jax \\
        --model_args checkpoint=PATH[,batch_size=N,max_length=L,prefix=none|bos|eos|auto|ID,mesh=...] \\
        --tasks TASKS [any other flag of lm-eval: --include_path, --num_fewshot, --limit, --output_path,
                       --log_samples, --gen_kwargs, ...]

PATH is a training workdir, one of its checkpoints (WORKDIR/checkpoints/STEP) or a Hugging Face
directory (zaya_jax.hf.pretrained). The backend (zaya_jax/lm_eval/backend.py) gives `--model hf`'s
numbers on the exported directory: the same acc / acc_norm, per-request log-likelihoods within
1e-4 and the same greedy generations, with `prefix` in place of HF's BOS options. Inside
training, `eval.harness_tasks` runs tasks through it at every evaluation (zaya_jax/lm_eval/harness.py).

lm-eval is an optional dependency (the `interop` extra): this package's `__init__` does not import
it; `import zaya_jax.lm_eval.backend` does (and registers the model name `zaya_jax` with lm-eval, for
`lm_eval.simple_evaluate(model="zaya_jax", ...)` from Python), and `require_lm_eval` turns a missing
one into a one-line error.
"""

from __future__ import annotations

import importlib

from zaya_jax.runtime.cli import UserError, one_line


def require_lm_eval(what: str) -> None:
    """Imports lm-eval; a missing one (or a missing dependency of it) is a UserError naming `what`."""
    try:
        importlib.import_module("lm_eval.api.model")
    except ImportError as e:
        raise UserError(
            f"{what} needs lm-evaluation-harness, which cannot be imported ({one_line(e)}): "
            "pip install -e '.[interop]'"
        ) from None
