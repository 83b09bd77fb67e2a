"""Atomic saves: the previous save survives an exception, a SIGKILL while writing, and a SIGKILL
between any two steps of the swap; `recover` then leaves exactly one complete save and no debris.

The killed writers are separate processes that import only quantmesh.io.atomic (no torch), so each
costs a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantmesh.io import atomic
from quantmesh.io.atomic import atomic_dir, atomic_write_file, recover
from quantmesh.io.reader import open_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"

# A writer that saves NEW into `path` with atomic_dir: files are written slowly, after "writing" is
# printed; with KILL_AT=n it SIGKILLs itself right after the n-th os.rename of the swap.
WRITER = r"""
import os, signal, sys, time
from quantmesh.io.atomic import atomic_dir
path, kill_at = sys.argv[1], int(sys.argv[2])
real_rename, calls = os.rename, [0]
def rename(a, b):
    real_rename(a, b)
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
with atomic_dir(path) as tmp:
    for i in range(4):
        (tmp / f"part{i}.bin").write_bytes(b"NEW" * 100_000)
        if i == 0 and kill_at == 0:
            print("writing", flush=True)
            time.sleep(60)  # the parent kills us here, in the middle of the save
print("done", flush=True)
"""


def _run_writer(path: Path, kill_at: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(kill_at)], env=env, stdout=subprocess.PIPE
    )


def _old_save(path: Path) -> torch.Tensor:
    """A previous save: a real safetensors file plus a marker."""
    w = torch.arange(64.0).view(8, 8)
    path.mkdir(parents=True)
    save_file({"w": w}, path / "model.safetensors")
    (path / "OLD").write_text("old")
    return w


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_success_replaces_previous_folder(tmp_path) -> None:
    path = tmp_path / "save"
    _old_save(path)
    with atomic_dir(path) as tmp:
        assert tmp.parent == path.parent and tmp.name.startswith(".save.tmp-")  # same filesystem
        assert list(tmp.iterdir()) == []
        (tmp / "NEW").write_text("new")
    assert sorted(p.name for p in path.iterdir()) == ["NEW"]  # nothing of the old one is left
    assert _siblings(path) == []


def test_exception_inside_leaves_previous_intact(tmp_path) -> None:
    path = tmp_path / "save"
    w = _old_save(path)
    with pytest.raises(RuntimeError, match="disk full"), atomic_dir(path) as tmp:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")
    assert torch.equal(open_checkpoint(path).read("w"), w)
    assert (path / "OLD").read_text() == "old"
    assert _siblings(path) == []  # the temp folder was removed


def test_first_save_creates_parents(tmp_path) -> None:
    path = tmp_path / "a" / "b" / "save"
    with atomic_dir(path) as tmp:
        (tmp / "x").write_text("1")
    assert (path / "x").read_text() == "1"


def test_a_file_in_the_way_is_an_error(tmp_path) -> None:
    (tmp_path / "save").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=r"a file is there, expected a folder"):
        with atomic_dir(tmp_path / "save"):
            pass


posix_only = pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals (SIGKILL)")


@posix_only
def test_sigkill_while_writing_leaves_previous_save_readable(tmp_path) -> None:
    path = tmp_path / "save"
    w = _old_save(path)
    proc = _run_writer(path, kill_at=0)
    try:
        assert proc.stdout.readline() == b"writing\n"  # the child is inside atomic_dir
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert torch.equal(open_checkpoint(path).read("w"), w)  # readable before any recovery
    left = _siblings(path)
    assert len(left) == 1 and left[0].startswith(".save.tmp-")  # the half-written temp folder
    assert recover(path) == [f"removed {left[0]}"]
    assert _siblings(path) == [] and (path / "OLD").exists()


# rename 1: tmp -> new (killed: old still in place); 2: save -> old (killed: no `save`, the new
# one complete aside); 3: new -> save (killed: new in place, old aside).
@posix_only
@pytest.mark.parametrize(("kill_at", "expect"), [(1, "OLD"), (2, "part3.bin"), (3, "part3.bin")])
def test_sigkill_between_swap_steps_recovers_one_complete_save(tmp_path, kill_at, expect) -> None:
    path = tmp_path / "save"
    _old_save(path)
    proc = _run_writer(path, kill_at)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert path.exists() == (kill_at != 2)
    actions = recover(path)
    assert actions and _siblings(path) == [], actions
    assert (path / expect).exists()
    if expect == "part3.bin":  # the new save, complete: every file, full length
        assert [len((path / f"part{i}.bin").read_bytes()) for i in range(4)] == [300_000] * 4
        assert not (path / "OLD").exists()


def test_recover_restores_old_when_only_old_is_left(tmp_path) -> None:
    path = tmp_path / "save"
    _old_save(path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    old = tmp_path / f".save.old-{atomic._HOST}-{int(dead.stdout)}-0123abcd"
    os.rename(path, old)  # as if killed between "rename save aside" and "rename new in", no new
    assert recover(path) == [f"restored {path} from {old.name}"]
    assert (path / "OLD").exists() and _siblings(path) == []


def test_recover_leaves_a_live_writer_alone(tmp_path) -> None:
    path = tmp_path / "save"
    _old_save(path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".save.tmp-{atomic._HOST}-{live.pid}-0123abcd"
        busy.mkdir()
        assert recover(path) == [] and busy.exists()
    finally:
        live.kill()
        live.wait()
    assert recover(path) == [f"removed {busy.name}"]


def test_atomic_write_file(tmp_path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text("old")
    with pytest.raises(ValueError, match="boom"), atomic_write_file(path) as tmp:
        tmp.write_text("half")
        raise ValueError("boom")
    assert path.read_text() == "old" and _siblings(path) == []
    with atomic_write_file(path) as tmp:
        assert tmp.parent == path.parent and tmp.exists()
        tmp.write_text("new")
    assert path.read_text() == "new" and _siblings(path) == []
    st = tmp_path / "w.safetensors"
    with atomic_write_file(st) as tmp:
        save_file({"x": torch.ones(2)}, tmp)  # any writer that takes a path
    assert torch.equal(open_checkpoint(st).read("x"), torch.ones(2))
    # an ordinary file's mode (0o666 minus umask), not mkstemp's private 0o600
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
