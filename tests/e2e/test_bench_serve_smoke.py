"""benchmarks/bench_serve.py run small on CPU ranks (tiny model, tp=2), so that it does not rot
between GPU sessions: the model and adapters it builds, the server it starts, every phase's
figures and the target ratios. The server runs the slot engine (`--engine slots`, eager on CPU):
the other server tests run the default one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serve_smoke_tp2_on_cpu_ranks(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--smoke",
           "--engine", "slots", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "result_serve_tiny_none_tp2_slots_captured.json").read_text())
    assert res["engine"] == "slots" and res["server_start_s"] > 0
    assert [(p["mix"], p["concurrency"]) for p in res["phases"]] == [
        ("single", 1), ("single", 4), ("mixed", 1), ("mixed", 4)
    ]  # fmt: skip
    for p in res["phases"]:
        assert p["tokens"] > 0 and p["tokens_per_s"] > 0 and p["p99_s"] >= p["p50_s"] > 0
        assert 0 < p["ttft_p50_s"] <= p["p50_s"]
    conc1, conc4 = res["phases"][0], res["phases"][1]
    assert conc1["mean_batch"] == 1.0 and conc4["mean_batch"] > 1.0  # requests shared steps
    assert res["scaling_hi_over_lo"] > 0 and res["mixed_over_single_at_hi"] > 0
