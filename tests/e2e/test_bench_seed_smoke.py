"""benchmarks/bench_seed.py (the seed layout for a 4-GPU machine), run small on CPU ranks.

The split layout at dp=2: 2 gloo ranks, each owning 2 CPU "devices" (init_mesh(devices_per_rank=2),
in-process layer split, DDP with device_ids=None), an OPT-shaped model with an int8 base and LoRA on
q_proj/v_proj, built on meta and filled per shard, 1 + 2 timed steps, and the loss check of a small
OPT on the same layout against the tp=1 fp32 CPU reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._bench import bench_on_ranks


@pytest.mark.slow
def test_bench_seed_smoke_split_dp2_int8_on_two_cpu_ranks(tmp_path: Path) -> None:
    bench_on_ranks(
        2, "bench_seed.py", "--smoke", "--layout", "split", "--quant", "int8", "--model", "opt",
        "--out", str(tmp_path),
    )  # fmt: skip
    out = tmp_path / "result_seed_split_opt_int8_dp2_tp1.json"
    res = json.loads(out.read_text())
    assert res["ok"], res.get("traceback")
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
