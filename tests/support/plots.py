"""`python -m zaya_jax.plot` as a user runs it, and whether what it wrote is a drawing."""

import subprocess
import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_plot(*args):
    """`python -m zaya_jax.plot ARGS` in a new process: its CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "zaya_jax.plot", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def is_png(path):
    """Whether `path` is a PNG with a drawing in it."""
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 5_000  # a real drawing, not an empty canvas
