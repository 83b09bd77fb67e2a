"""`quantmesh generate --fast` (qm.fast_decode) prints what transformers' greedy path prints, at tp=2."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_cli_common import cli, make_tiny_llama, refused


@pytest.mark.slow
def test_fast_decoding_prints_the_greedy_reply(tmp_path: Path) -> None:
    """With a repetition penalty (the demo's setting), which `--fast` refused: the fast loop
    had none."""
    model = make_tiny_llama(tmp_path / "tiny")
    argv = ["generate", str(model), "--tp", "2", "--prompt", "whether tis nobler",
            "--max-new-tokens", "24", "--repetition-penalty", "1.3"]  # fmt: skip
    plain, fast = cli(*argv), cli(*argv, "--fast")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert fast.returncode == 0, fast.stderr[-3000:]
    assert plain.stdout.strip()  # a reply that a wrong path could get wrong
    assert fast.stdout == plain.stdout


def test_fast_refuses_no_kv_cache(tmp_path: Path, capsys, monkeypatch) -> None:
    """Refused in the launching process (main() here)."""
    argv = ["generate", str(tmp_path), "--prompt", "hi", "--fast", "--no-kv-cache"]
    err = refused(argv, capsys, monkeypatch)
    assert "--fast decodes with a static KV cache; drop --no-kv-cache, or drop --fast" in err
