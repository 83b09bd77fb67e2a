"""What a benchmark result says about the code it ran (benchmarks/qmbench.py): the checkout's
commit, marked "-dirty" when the measured files differ from it, and a hash of those files that is
the same for the same tree anywhere (a GPU machine's copy may carry a .git that lags behind)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import qmbench  # noqa: E402


def _tree(root: Path) -> None:
    for part, name, text in (("src/quantmesh", "a.py", "x = 1\n"), ("benchmarks", "b.sh", "true\n"),
                             ("benchmarks", "notes.md", "not code\n")):  # fmt: skip
        (root / part).mkdir(parents=True, exist_ok=True)
        (root / part / name).write_text(text)


def test_the_tree_hash_follows_the_code_and_nothing_else(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a)
    _tree(b)
    assert qmbench.tree_hash(str(a)) == qmbench.tree_hash(str(b))  # same files, other place
    (b / "benchmarks" / "notes.md").write_text("edited\n")
    assert qmbench.tree_hash(str(a)) == qmbench.tree_hash(str(b))  # not a .py or .sh
    (b / "src/quantmesh" / "a.py").write_text("x = 2\n")
    assert qmbench.tree_hash(str(a)) != qmbench.tree_hash(str(b))


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_commit_is_marked_dirty_when_the_measured_files_differ(tmp_path, monkeypatch) -> None:
    _tree(tmp_path)

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)  # fmt: skip

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(qmbench, "ROOT", str(tmp_path))
    clean = qmbench.commit()
    assert clean and not clean.endswith("-dirty")
    (tmp_path / "README").write_text("outside the measured parts\n")
    assert qmbench.commit() == clean
    (tmp_path / "src/quantmesh" / "a.py").write_text("x = 3\n")
    assert qmbench.commit() == clean + "-dirty"
