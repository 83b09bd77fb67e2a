"""The GPU benchmark scripts, run small on CPU ranks so that they do not rot between GPU sessions.

bench_train.py runs as its `main(argv)` on run_ranks' ranks (torchrun's environment, the suite's
fork server's imports), as `torchrun bench_train.py ARGV` runs it per rank.

bench_train.py's smoke mode is the 7B run's code path at tiny shapes: a meta skeleton, tp=2 nf4 +
LoRA on 2 gloo ranks, random weights filled slice by slice, timed steps, the loss check against the
tp=1 fp32 CPU reference; summarize.py must turn its JSON into the tables. The vocab-parallel
cross-entropy prototype is checked against the plain one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantmesh.testing import run_ranks

from ._bench import BENCH, bench_on_ranks


@pytest.mark.slow
def test_bench_train_smoke_tp2_nf4_lora_on_two_cpu_ranks(tmp_path: Path) -> None:
    bench_on_ranks(
        2, "bench_train.py", "--smoke", "--tp", "2", "--quant", "nf4", "--check", "--out",
        str(tmp_path),
    )  # fmt: skip
    res = json.loads((tmp_path / "result_qm_tp2_dp1_nf4_lora.json").read_text())
    assert res["ok"], res.get("traceback")
    assert (res["tp"], res["dp"], res["gpus"]) == (2, 1, 2)
    assert res["tokens_per_s"] > 0 and len(res["rank_times"]) == 2
    assert all(x == x for x in res["losses_first"])  # finite, not NaN
    # both sides run bf16 autocast on CPU here; 2e-2 is the GPU bound, far above what CPU shows
    assert res["check"]["passed"], res["check"]

    out = subprocess.run(
        [sys.executable, str(BENCH / "summarize.py"), "--bundle", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "| quantmesh | tp=2 nf4 + LoRA |" in out.stdout
    assert "| peer D: accelerate layer split" in out.stdout and "not yet run" in out.stdout


def _vocab_parallel_ce(rank: int) -> dict:
    """On 2 gloo ranks: vocab-parallel CE (uneven shards, an ignored target) vs plain CE."""
    sys.path.insert(0, str(BENCH))
    import torch.distributed as dist
    from vocab_parallel_ce import vocab_parallel_cross_entropy

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    out = {}
    g = torch.Generator().manual_seed(0)
    full = torch.randn(12, 10, generator=g, dtype=torch.float64)
    target = torch.randint(0, 10, (12,), generator=g)
    target[3] = -100
    lo, hi = (0, 6) if rank == 0 else (6, 10)  # uneven shards
    local = full[:, lo:hi].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, lo, mesh.tp_group)
    loss.backward()
    ref_full = full.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_full, target, ignore_index=-100)
    ref.backward()
    out["ce"] = float((loss - ref).abs())
    out["ce_grad"] = float((local.grad - ref_full.grad[:, lo:hi]).abs().max())

    dist.barrier()
    return out


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_matches_the_plain_one() -> None:
    for r in run_ranks(_vocab_parallel_ce, 2, timeout=120, env={"CUDA_VISIBLE_DEVICES": ""}):
        # fp64 throughout: only the summation order differs
        assert r["ce"] < 1e-12 and r["ce_grad"] < 1e-12, r


@pytest.mark.slow
def test_bench_train_smoke_pp2_1f1b_on_two_cpu_ranks(tmp_path: Path) -> None:
    bench_on_ranks(
        2, "bench_train.py", "--smoke", "--pp", "2", "--microbatches", "2", "--quant", "nf4",
        "--mb", "2", "--out", str(tmp_path),
    )  # fmt: skip
    res = json.loads((tmp_path / "result_qm_tp1_pp2_1f1b_m2_dp1_nf4_lora.json").read_text())
    assert res["ok"], res.get("traceback")
    assert (res["pp"], res["microbatches"], res["bubble_theory"]) == (2, 2, round(1 / 3, 4))
    assert res["tokens_per_s"] > 0 and all(x == x for x in res["losses_first"])
    out = subprocess.run(
        [sys.executable, str(BENCH / "summarize.py"), "--bundle", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "| quantmesh, pipeline | pp=2 1f1b M=2 nf4 + LoRA" in out.stdout


@pytest.mark.slow  # make test-fast leaves the benchmark smokes out
def test_bench_train_smoke_fsdp_on_one_cpu_rank(tmp_path: Path) -> None:
    """The one-GPU FSDP cost run's code path (torchao nf4, --fsdp on a 1-rank mesh), tiny."""
    bench_on_ranks(
        1, "bench_train.py", "--smoke", "--quant", "nf4", "--quant-backend", "torchao", "--fsdp",
        "--out", str(tmp_path),
    )  # fmt: skip
    res = json.loads((tmp_path / "result_qm_tp1_dp1_nf4_ao_lora_fsdp.json").read_text())
    assert res["ok"], res.get("traceback")
    assert res["tokens_per_s"] > 0
    assert res["memory_estimate"]["parts_GiB"]["gathered"] > 0  # the FSDP terms are estimated


@pytest.mark.slow  # a benchmark smoke
def test_fsdp_table_prints_every_layout(capsys) -> None:
    import runpy

    mod = runpy.run_path(str(BENCH / "fsdp_table.py"), run_name="fsdp_table")
    capsys.readouterr()
    assert mod["main"](["--layers", "16"]) == 0  # estimates on meta: no process of its own
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 6  # tp {1, 2} x dp {2, 4, 8}
    for row in rows:  # 16 layers: enough blocks that sharding them pays for the gathered ones
        plain, fsdp, off = (c.strip() for c in row.strip("|").split("|")[2:])
        assert float(off.split()[0]) < float(fsdp) < float(plain)
        assert float(off.split()[1].strip("()")) > 0  # the base's host share


def test_held_gemm_bench_smoke_fused_siblings_equal_separate(tmp_path: Path) -> None:
    """benchmarks/held_gemm_bench.py on CPU: the fused q/k/v and gate/up give the separate
    projections' outputs (the GPU timing compares the two)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import held_gemm_bench

    assert held_gemm_bench.main(["--smoke", "--rows", "1,3", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "held_gemm.json").read_text())
    assert set(res["rows"]) == {"1", "3"} and res["weight_GB"] > 0, res


def test_prologue_bench_kernels_hold_in_the_interpreter() -> None:
    """benchmarks/nf4_prologue_bench.py --smoke: the tensor-core kernel at more rows than a
    program's BLOCK_M (the forward) and the experiment `nf4_dx.launch_dx` (the input gradient,
    g @ W), both dequantizing the codes in their prologue, each within 1e-3 of the dequantized
    weight's product in Triton's interpreter (fp16, partly masked programs), and the peers
    (dequantize + matmul, the unquantized weight's matmul) within 1e-3 of their own references:
    exit 0, a line a product and shape."""
    root = Path(__file__).parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "nf4_prologue_bench.py"),
                        "--smoke"], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    lines = [x for x in r.stdout.splitlines() if x.startswith("[")]
    assert len(lines) == 4 and all("rel_err at most" in x for x in lines), r.stdout
    # the peers are checked too, each against its own reference (the bf16 weight's is unquantized)
    assert all("bf16_mm checked" in x and "bnb_dequant_mm checked" in x for x in lines), r.stdout


def test_scheduler_host_bench_smoke(tmp_path: Path) -> None:
    """benchmarks/scheduler_host_bench.py: every request of a burst ends, each way of posting."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import scheduler_host_bench

    for post in ("mail", "each"):
        argv = [
            "--rows",
            "4",
            "--tokens",
            "5",
            "--repeat",
            "1",
            "--post",
            post,
            "--out",
            str(tmp_path),
        ]
        assert scheduler_host_bench.main(argv) == 0
        res = json.loads((tmp_path / "scheduler_host.json").read_text())
        assert res["post"] == post and res["runs"][0]["steps"] == 4, res  # 5 tokens: 1 + 4 steps
        assert res["host_ms_per_step_median"] > 0, res


@pytest.mark.slow
def test_bench_train_smoke_compiled_with_the_kept_elementwise_and_held_variants(
    tmp_path: Path,
) -> None:
    """--compile --variants keep_elementwise,keep_dequantized,keep_dequantized:1,fused_adamw: the
    blocks compiled again from scratch under torch's own partitioner rule (dynamo's caches
    cleared), timed, then back to the default; then the 4-bit weights held dequantized, timed, then
    dropped; then the first layer's alone; then a fused AdamW; then the last two together; then
    the default twice (kept apart); CUDA graphs and programmatic launches skipped on CPU, said;
    an inductor option skipped where the blocks do not compile with inductor (make test's
    aot_eager), said."""
    bench_on_ranks(
        1, "bench_train.py", "--smoke", "--quant", "nf4", "--compile", "--variants",
        "keep_elementwise,keep_dequantized,keep_dequantized:1,fused_adamw,"
        "keep_dequantized:1+fused_adamw,default,default,cuda_graphs,pdl,"
        "inductor:combo_kernels=True+fused_adamw", "--variant-steps", "1",
        "--out",
        str(tmp_path),
        timeout=300,
    )  # fmt: skip
    res = json.loads(next(tmp_path.glob("result_qm_*.json")).read_text())
    assert res["ok"], res.get("traceback")
    for name in ("keep_elementwise", "keep_dequantized", "keep_dequantized:1", "fused_adamw"):
        v = res["variants"][name]
        assert "error" not in v and v["tokens_per_s"] > 0, (name, v)
        assert all(x == x for x in v["losses_first"])
    every, first = (
        res["variants"][k]["held_bytes"] for k in ("keep_dequantized", "keep_dequantized:1")
    )
    assert 0 < first < every
    assert res["variants"]["fused_adamw"]["adamw"] == "fused"
    both = res["variants"]["keep_dequantized:1+fused_adamw"]
    assert "error" not in both and both["tokens_per_s"] > 0, both
    assert (both["held_bytes"], both["adamw"]) == (first, "fused")
    for name in ("default", "default#2"):
        v = res["variants"][name]
        assert v["tokens_per_s"] > 0 and "held_bytes" not in v and v["adamw"] != "fused", (name, v)
    for name in ("cuda_graphs", "pdl"):
        assert res["variants"][name] == {"skipped": f"{name}: needs --compile on a GPU"}
    # an inductor option: timed where the blocks compile with inductor, else skipped, said
    v = res["variants"]["inductor:combo_kernels=True+fused_adamw"]
    backend = os.environ.get("QUANTMESH_COMPILE_BACKEND") or "inductor"
    if backend == "inductor":
        assert "error" not in v and v["tokens_per_s"] > 0, v
    else:
        assert v == {"skipped": f"inductor: the blocks compile with {backend!r}, which reads no "
                                "inductor option"}, v  # fmt: skip
