"""`quantmesh demo` (what `make demo` runs), shortened with --steps and --seq-len: the held-out
loss falls and every product is written. The assets come from the session's `demo_assets` cache
(tests/conftest.py: prepared from PyPI once, and checked by tests/unit/test_assets.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from .test_cli_common import cli


@pytest.mark.slow
def test_demo_short_run_learns_and_writes_its_results(tmp_path: Path, demo_assets: Path) -> None:
    out = tmp_path / "demo"
    t0 = time.monotonic()
    # shortened: 4 steps of 32-token examples (the demo's own: 30 of 128; 64 tokens took 1.5x as
    # long, and the held-out loss fell 4.55 -> 4.14 there, 5.15 -> 4.46 here). A fresh interpreter,
    # as `make demo` starts it: its workers come from a fork server (cli/launch.py), where the
    # suite's other commands fork theirs from their launcher
    proc = cli("demo", "--steps", "4", "--seq-len", "32", "--max-new-tokens", "8",
               "--output-dir", str(out), timeout=420, fresh=True,
               env={"QUANTMESH_CACHE": str(demo_assets)})  # fmt: skip
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "loaded on tp=2: q_proj 6+3 heads, k_proj 2+1 KV heads" in text, text
    assert "--- before fine-tuning:" in text and "--- after fine-tuning:" in text
    before, after = (
        float(x) for x in re.search(r"held-out loss: ([\d.]+) -> ([\d.]+)", text).groups()
    )
    assert after < before - 0.05, (before, after)  # 4 steps at lr 3e-3 move it well past noise
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert rows[-1]["eval_loss"] == pytest.approx(after, abs=1e-3)
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "generations.md", "checkpoints/step-000004/state/state.json"):  # fmt: skip
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    gens = (out / "generations.md").read_text()
    assert "## Before fine-tuning" in gens and "## After 4 steps on Shakespeare" in gens
    assert f"written to {out}" in text
    print(f"demo --steps 4 took {took:.0f} s")
