"""XLA_FLAGS, read and edited as tokens: the one place that parses XLA's flag string.

XLA reads the environment's XLA_FLAGS once, when jax creates its first backend; an edit made before
then holds for this process, and for every process started from it. A token is `--name=value` or a
bare `--name` (= "true"); XLA takes the last token naming a flag.
"""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"  # simulated CPU devices


def value(flags: str, name: str) -> str | None:
    """The value `flags` gives `name` (its last token), or None if no token names it."""
    found = None
    for token in flags.split():
        key, _, given = token.partition("=")
        if key == name:
            found = given or "true"
    return found


def with_flag(flags: str, name: str, setting: object, replace: bool = False) -> str:
    """`flags` with `--name=setting` appended: unless a token names it already (the user's choice
    stands), or with every such token dropped first (`replace`)."""
    tokens = flags.split()
    if replace:
        tokens = [t for t in tokens if t.partition("=")[0] != name]
    elif value(flags, name) is not None:
        return flags
    return " ".join([*tokens, f"{name}={setting}"])


def set_flag(name: str, setting: object, replace: bool = False) -> str:
    """with_flag on os.environ's XLA_FLAGS, in place; returns the flag's value now."""
    os.environ["XLA_FLAGS"] = with_flag(os.environ.get("XLA_FLAGS", ""), name, setting, replace)
    return value(os.environ["XLA_FLAGS"], name)


def current(name: str) -> str | None:
    """The value os.environ's XLA_FLAGS gives `name`."""
    return value(os.environ.get("XLA_FLAGS", ""), name)
