"""Output directories a command writes: never over what the user has, and complete or absent.

    output_dir.check(out, flag="--out", overwrite=a.overwrite, reading=[("--checkpoint", ckpt)])
    with output_dir.staged(out, flag="--out", overwrite=..., reading=..., last=("config.json",)) as tmp:
        ...  # write everything into tmp
    # here `out` holds the finished result

The rules (`check`): a path that is, contains or is inside something the command reads is always
refused; an existing file or non-empty directory is refused unless `overwrite`; a non-empty
directory that is or contains the current directory is refused even then. A missing path or an
empty directory is written. A refusal is one `UserError` naming the path and the remedy.

`staged` writes into a temporary directory beside `out` (inside it when `out` is an existing empty
directory, which may be a mount point or the current directory) and moves the result into place
at the end: a new or replaced `out` appears in one rename; into an empty directory the entries move
one by one, the `last` names (the marker a reader checks for) last. A replaced `out` is moved aside
only once the new one is complete, and deleted after. An error or interrupt removes the temporary
directory and leaves `out` as it was. Created directories get 0o777 minus the umask (a temporary
directory starts at 0o700).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

from zaya_jax.runtime.cli import UserError


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _within(inner: str, outer: str) -> bool:
    """Whether real path `inner` is `outer` or under it."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def _relation(out: str, src: str) -> str | None:
    """How real path `out` overlaps real path `src`: 'is', 'contains', 'is inside' or None."""
    if out == src:
        return "is"
    if _within(src, out):
        return "contains"
    return "is inside" if _within(out, src) else None


def _overwrite(flag: str) -> str:
    """How the caller spells overwrite: the CLI flag, or the Python argument."""
    return "--overwrite" if flag.startswith("--") else "overwrite=True"


def check(
    path: str, *, flag: str = "--out", overwrite: bool = False, reading: Sequence[tuple[str, str]] = ()
) -> None:
    """UserError unless `path` may be written (the rules in the module docstring). `reading` lists
    (flag, path) of what the command reads, e.g. ("--checkpoint", WORKDIR)."""
    out = _real(path)
    for src_flag, src in reading:
        src_real = _real(src)
        where = _relation(out, src_real)
        if where:
            raise UserError(
                f"{flag} {path} {where} {src_flag} {src}, which this command reads: write to a "
                f"directory outside it ({_overwrite(flag)} never replaces what is being read)"
            )
    if not os.path.lexists(path) or _is_empty_dir(path):
        return
    kind = "a directory that is not empty" if os.path.isdir(path) else "a file"
    if _within(_real(os.getcwd()), out):
        raise UserError(
            f"{flag} {path} is the current directory or holds it, and is not empty: "
            "name a new or empty directory"
        )
    if not overwrite:
        raise UserError(
            f"{flag} {path} is {kind}: name a new or empty directory, "
            f"or pass {_overwrite(flag)} to replace it"
        )


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged(
    path: str,
    *,
    flag: str = "--out",
    overwrite: bool = False,
    reading: Sequence[tuple[str, str]] = (),
    last: Sequence[str] = (),
) -> Iterator[str]:
    """Yields an empty temporary directory; on a clean exit its contents become `path`."""
    check(path, flag=flag, overwrite=overwrite, reading=reading)
    target = os.path.abspath(path)
    into_empty = _is_empty_dir(target)
    where = target if into_empty else os.path.dirname(target)
    os.makedirs(where, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=where)
    try:
        os.chmod(tmp, 0o777 & ~umask())
        yield tmp
        _check_unchanged(path, flag, overwrite, tmp if into_empty else None)
        if into_empty:
            _move_entries(tmp, target, last)
        else:
            _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_unchanged(path: str, flag: str, overwrite: bool, inner_tmp: str | None) -> None:
    """UserError if something was written at `path` while the result was being made."""
    target = os.path.abspath(path)
    if inner_tmp is not None:
        changed = os.listdir(target) != [os.path.basename(inner_tmp)]
    else:
        changed = not overwrite and os.path.lexists(target) and not _is_empty_dir(target)
    if changed:
        raise UserError(f"{flag} {path} changed while this command wrote; its result was discarded")


def _move_entries(tmp: str, target: str, last: Sequence[str]) -> None:
    """Moves every entry of `tmp` into the empty directory `target` (which holds `tmp`), `last` last."""
    names = sorted(os.listdir(tmp), key=lambda n: (n in last, n))
    for name in names:
        os.replace(os.path.join(tmp, name), os.path.join(target, name))
    os.rmdir(tmp)


def _replace(tmp: str, target: str) -> None:
    """Renames `tmp` to `target`; an existing `target` is moved aside first, deleted after."""
    if not os.path.lexists(target):
        os.replace(tmp, target)
        return
    trash = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
    os.replace(target, os.path.join(trash, "old"))
    os.replace(tmp, target)
    shutil.rmtree(trash, ignore_errors=True)
