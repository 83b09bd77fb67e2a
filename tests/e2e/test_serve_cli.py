"""`quantmesh serve` refuses what it can check before any worker starts: one line, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_cli_common import cli, make_adapter, make_tiny_llama


@pytest.mark.slow  # six CLI starts
def test_serve_refuses_bad_setups_before_starting(tmp_path: Path) -> None:
    proc = cli("serve", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = cli("serve", str(tmp_path), "--adapter", "no-equals-sign")
    assert proc.returncode == 2 and "NAME=DIR" in proc.stderr
    model = make_tiny_llama(tmp_path / "tiny")
    adapter = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj"], seed=0)
    proc = cli("serve", str(model), "--adapter", f"a={adapter}", "--max-lora-rank", "2")
    assert proc.returncode == 2 and "raise --max-lora-rank to 4" in proc.stderr, proc.stderr
    proc = cli("serve", str(model), "--adapter", f"a={tmp_path / 'nope'}")
    assert (
        proc.returncode == 2 and "--adapter a=" in proc.stderr and "does not exist" in proc.stderr
    )
    proc = cli("serve", str(model), "--adapter-dir", str(tmp_path / "none"))
    assert (
        proc.returncode == 2
        and "--adapter-dir" in proc.stderr
        and "no such directory" in proc.stderr
    )
    proc = cli("serve", str(model), "--api-key", "")
    assert proc.returncode == 2 and "--api-key is empty" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
