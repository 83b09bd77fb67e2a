"""Atomic saves: a folder or a file at `path` is either the previous complete one or the new one.

`atomic_dir(path)` yields an empty sibling folder to write into; on success it is swapped in:

    1. write into   .NAME.tmp-HOST-PID-RAND   (incomplete until the body returns; then fsync'd)
    2. rename it to .NAME.new-HOST-PID-RAND   (the name now says: complete)
    3. rename NAME  to .NAME.old-HOST-PID-RAND  (only if NAME exists)
    4. rename .new  to NAME, fsync the parent folder
    5. remove .old

Renames within one folder are atomic on POSIX filesystems, so a crash (SIGKILL, power loss) at any
point leaves a complete save findable. Recovery rule, applied by `recover(path)` (which
`atomic_dir` and `atomic_write_file` call first):

- NAME missing and a `.NAME.new-*` present: the crash fell between 3 and 4; the new save is
  complete, so it becomes NAME (the newest one, if several) and the `.old-*` are removed.
- NAME missing and only `.NAME.old-*` present: restore the newest `.old-*` as NAME.
- NAME present: it is authoritative; leftover `.tmp-*`, `.new-*` and `.old-*` are removed.

Leftovers of a writer that is still running on this host (its PID is alive) are never touched, so
one stray concurrent save is not broken; still, a path is meant to have one writer at a time.

Example:
    >>> with atomic_dir("out/step100") as tmp:  # doctest: +SKIP
    ...     torch.save(model.state_dict(), tmp / "model.pt")
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_write_file", "recover"]

_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _sibling(path: Path, kind: str) -> Path:
    """A fresh hidden sibling name of `path` that records its kind and its writer."""
    return path.with_name(f".{path.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def _leftovers(path: Path) -> list[tuple[str, Path]]:
    """(kind, leftover) siblings of `path` whose writer is not running on this host."""
    pattern = re.compile(
        rf"\.{re.escape(path.name)}\.(tmp|new|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}"
    )
    found: list[tuple[str, Path]] = []
    if not path.parent.is_dir():
        return found
    for entry in path.parent.iterdir():
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        pid = int(m["pid"])
        if m["host"] == _HOST and pid != os.getpid() and _alive(pid):
            continue  # a save in progress in another process
        found.append((m[1], entry))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 checks existence only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _fsync_path(p: Path) -> None:
    """Flush a file or a folder entry to disk (folders: POSIX only; Windows cannot open them)."""
    if p.is_dir() and os.name != "posix":
        return
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def recover(path: str | os.PathLike) -> list[str]:
    """Repair what a crashed save left next to `path` (see the module docstring); say what was done.

    Example:
        >>> recover("out/step100")  # doctest: +SKIP
        ['restored out/step100 from .step100.old-host-4242-1a2b3c4d']
    """
    path = Path(path)
    actions: list[str] = []
    left = _leftovers(path)
    if not os.path.lexists(path):
        # newest first: st_mtime of the folder entry, set when its last file was created
        for kind in ("new", "old"):
            cands = sorted((p for k, p in left if k == kind), key=lambda p: p.stat().st_mtime)
            if cands:
                os.rename(cands[-1], path)
                actions.append(f"restored {path} from {cands[-1].name}")
                break
    for _, p in left:
        if os.path.lexists(p):
            _remove(p)
            actions.append(f"removed {p.name}")
    if actions:
        _fsync_path(path.parent)
    return actions


@contextmanager
def atomic_dir(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield an empty folder next to `path`; on success it replaces `path`, on error it is removed.

    `fsync=True` flushes every written file before the swap, so that a power loss cannot leave a
    renamed folder of empty files; a killed process needs no fsync (the page cache survives it).

    Example:
        >>> with atomic_dir("out/adapter") as tmp:  # doctest: +SKIP
        ...     (tmp / "adapter_config.json").write_text("{}")
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"atomic_dir({str(path)!r}): a file is there, expected a folder or nothing; "
            "remove the file or choose another path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = _sibling(path, "tmp")
    os.mkdir(tmp)  # mode 0o777 minus umask, like an ordinary folder (mkdtemp would give 0o700)
    try:
        yield tmp
        if fsync:
            _fsync_tree(tmp)
    except BaseException:
        _remove(tmp)
        raise
    new = tmp.with_name(tmp.name.replace(".tmp-", ".new-", 1))
    os.rename(tmp, new)  # from here on the new save counts as complete
    if os.path.lexists(path):
        old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
        os.rename(path, old)
        os.rename(new, path)
        _fsync_path(path.parent)
        _remove(old)
    else:
        os.rename(new, path)
        _fsync_path(path.parent)


@contextmanager
def atomic_write_file(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp file path next to `path`; on success it replaces `path` in one os.replace.

    Write the temp path by any means (safetensors.torch.save_file, torch.save, write_text).

    Example:
        >>> with atomic_write_file("out/config.json") as tmp:  # doctest: +SKIP
        ...     tmp.write_text(json.dumps(cfg))
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = _sibling(path, "tmp")
    # O_EXCL: never write through someone else's file; mode 0o666 minus umask (mkstemp: 0o600)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        yield tmp
        if fsync:
            _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    if fsync:
        _fsync_path(path.parent)
