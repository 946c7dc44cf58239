"""zaya_jax.runtime.output_dir: what a command writes appears complete or not at all, and an interrupted
write leaves what was there (the commands themselves are walked in tests/test_cli_errors.py)."""

import os
from pathlib import Path

import pytest

from zaya_jax.runtime import output_dir
from zaya_jax.runtime.cli import UserError


def _tree(path):
    return {
        os.path.relpath(os.path.join(r, f), path): open(os.path.join(r, f)).read()
        for r, _, files in os.walk(path)
        for f in files
    }


def test_an_interrupted_overwrite_leaves_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt), output_dir.staged(str(out), overwrite=True) as tmp:
        (Path(tmp) / "config.json").write_text("half")
        raise KeyboardInterrupt
    assert _tree(out) == {"old.txt": "old"} and sorted(os.listdir(tmp_path)) == ["out"]
    with output_dir.staged(str(out), overwrite=True) as tmp:
        (Path(tmp) / "new.txt").write_text("new")
    assert _tree(out) == {"new.txt": "new"} and sorted(os.listdir(tmp_path)) == ["out"]


def test_an_empty_directory_is_written_in_place(tmp_path):
    """The user's empty directory (its inode, its mode) is kept; the marker file moves in last."""
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    inode = os.stat(out).st_ino
    moved = []
    real_replace = os.replace
    os.replace = lambda a, b: (moved.append(os.path.basename(b)), real_replace(a, b))
    try:
        with output_dir.staged(str(out), last=("config.json",)) as tmp:
            for name in ("config.json", "a.bin", "z.bin"):
                (Path(tmp) / name).write_text(name)
    finally:
        os.replace = real_replace
    assert moved == ["a.bin", "z.bin", "config.json"]
    assert os.stat(out).st_ino == inode and os.stat(out).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(out)) == ["a.bin", "config.json", "z.bin"]


def test_what_is_read_is_never_replaced(tmp_path):
    src = tmp_path / "run"
    (src / "checkpoints").mkdir(parents=True)
    for out in (src, tmp_path, src / "checkpoints", src / "new"):
        with pytest.raises(UserError, match="which this command reads"):
            output_dir.check(str(out), overwrite=True, reading=[("--checkpoint", str(src))])
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(UserError, match="is --checkpoint"):  # compared as real paths
        output_dir.check(str(link), overwrite=True, reading=[("--checkpoint", str(src))])
    output_dir.check(str(tmp_path / "other"), reading=[("--checkpoint", str(src))])
    assert sorted(os.listdir(tmp_path)) == ["link", "run"]
