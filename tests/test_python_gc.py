"""Every CLI runs with Python's garbage collector set by zaya_jax/runtime/python_gc.py: the imported
modules frozen, the young generation's threshold raised."""

import json
import subprocess
import sys

from zaya_jax.runtime import python_gc

# what a CLI's main sees (cli.run is every entry point's wrapper), in a fresh process
MAIN = """
import gc, json
from zaya_jax.runtime import cli
cli.run(lambda: print(json.dumps([gc.get_threshold(), gc.get_freeze_count()])))
"""


def test_a_cli_main_runs_with_the_imports_frozen_and_young_collections_rare():
    proc = subprocess.run([sys.executable, "-c", MAIN], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (young, older, oldest), frozen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert young == python_gc.YOUNG_THRESHOLD and (older, oldest) == (10, 10)  # Python's for the older
    assert frozen > 10_000  # jax and the package, imported before main


def test_collect_rarely_freezes_once():
    import gc

    python_gc.collect_rarely()  # tests/conftest.py called it first
    before = gc.get_freeze_count()
    garbage = [[] for _ in range(100)]
    python_gc.collect_rarely()
    assert gc.get_freeze_count() == before and garbage
