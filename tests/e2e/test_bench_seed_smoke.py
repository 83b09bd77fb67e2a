"""benchmarks/bench_seed.py (the seed layout for a 4-GPU machine), run small on CPU ranks.

The split layout at dp=2: 2 gloo ranks, each owning 2 CPU "devices" (init_mesh(devices_per_rank=2),
in-process layer split, DDP with device_ids=None), an OPT-shaped model with an int8 base and LoRA on
q_proj/v_proj, built on meta and filled per shard, 1 + 2 timed steps, and the loss check of a small
OPT on the same layout against the tp=1 fp32 CPU reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
def test_bench_seed_smoke_split_dp2_int8_on_two_cpu_ranks(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(BENCH / "bench_seed.py"), "--smoke", "--layout", "split", "--quant", "int8",
        "--model", "opt", "--out", str(tmp_path),
    ]  # fmt: skip
    # 11-15 s on 2 cores (most of it imports); the hard stop leaves room for a loaded machine
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=90)
    out = tmp_path / "result_seed_split_opt_int8_dp2_tp1.json"
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert proc.returncode == 0 and res["ok"], res.get("traceback") or proc.stderr[-3000:]
    assert (res["layout"], res["dp"], res["tp"], res["devices_per_rank"]) == ("split", 2, 1, 2)
    assert res["tokens_per_s"] > 0 and len(res["rank_times"]) == 2
    assert res["losses_first"] and all(x == x for x in res["losses_first"])  # finite, not NaN
    assert res["args"]["targets"] == ["q_proj", "v_proj"]

    chk = res["check"]
    assert len(chk["mesh_losses"]) == len(chk["cpu_fp32_losses"]) == 4
    # fp32 on both sides (no autocast on CPU) with the same int8 codes (tp=1 quantizes whole
    # rows): only the order of the dp gradient average differs, ~1e-7 relative measured
    tol = 1e-4
    for got, ref in zip(chk["mesh_losses"], chk["cpu_fp32_losses"], strict=True):
        assert abs(got - ref) <= tol * abs(ref), chk
    # the adapters learn: the loss moves over the 4 steps, so the check covers the DDP gradients
    assert chk["cpu_fp32_losses"][-1] < chk["cpu_fp32_losses"][0]
