"""An nf4 linear at a training batch's rows on a GPU: the codes dequantized in the GEMM's prologue
(quantmesh's tensor-core kernel, `kernel4.launch_mma` with a program per BLOCK_M rows) against
dequantizing the weight to bf16 first and one cuBLAS matmul (what training runs), one process.

Issue 30 asks whether the dequantization inside the GEMM (the 4-bit base weight never written in
bf16) wins in training, where the profiles give the dequantization about 7% of a step. For each 7B
shape (out, in) = 4096x4096, 11008x4096, 4096x11008 and each row count (2048, 4096: micro-batches
of one and two sequences of 2048 tokens), every candidate is checked against x @
dequantize_4bit(W)^T (relative error of the norms within `TOL`), then timed as a CUDA graph of
one call replayed `REPLAYS` times (microseconds a call; TFLOP/s = 2 rows out in / time):
  bnb_dequant_mm  bitsandbytes' dequantize_4bit, then x @ w.t() (the default training forward)
  qm_dequant_mm   quantmesh's Triton dequantize (kernel4.dequantize_4bit), then the matmul
  bf16_mm         the bf16 weight, a plain matmul: what any prologue kernel must approach
  prologue        launch_mma at each tile of TILES (K in one share), ranked by time
nf4 with double quant, bf16 x, random weights. Forward only: the input gradient (g @ W) reads the
codes along the other axis and is left until the forward wins.

Usage (CUDA only, from the repository root, bitsandbytes importable):
    python3 benchmarks/nf4_prologue_bench.py [--out DIR] [--rows 2048,4096] [--budget-s S]
Writes DIR/nf4_prologue.json (default DIR .bench/prologue).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))  # this tree's kernels first
import qmbench as qb  # noqa: E402
from nf4_gemv_bench import rel_err  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in)
REPLAYS = 20
TOL = 1e-2
_T = dict(BLK=0, LUT=1)
# (BLOCK_N features, BLOCK_M rows) a program, NB blocks of 64 codes a step; the weight is wgmma's
# A operand in registers, x its B operand through shared memory
TILES = [
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=1, num_warps=8, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=1, num_warps=4, num_stages=3),
    dict(_T, BLOCK_N=64, BLOCK_M=128, NB=1, num_warps=4, num_stages=4),
    dict(_T, BLOCK_N=128, BLOCK_M=64, NB=2, num_warps=4, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=256, NB=1, num_warps=8, num_stages=2),
    dict(_T, BLOCK_N=64, BLOCK_M=256, NB=1, num_warps=8, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=2, num_warps=8, num_stages=2),
    dict(_T, BLOCK_N=64, BLOCK_M=64, NB=2, num_warps=4, num_stages=3),
]


def run_shape(out_f: int, in_f: int, rows: int, t_start: float, budget_s: float) -> dict:
    """The peers, then every tile that the budget leaves time for, at one shape and row count."""
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    flat = packed.reshape(-1).view(torch.uint8)
    stats = (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    ref = x @ F.dequantize_4bit(packed, qs).t()
    flops = 2 * rows * out_f * in_f
    r: dict = {"out": out_f, "in": in_f, "rows": rows, "peers": {}, "tiles": [], "skipped": []}

    def qm_dequant_mm() -> torch.Tensor:
        wd = k4.dequantize_4bit(flat, *stats, 64, "nf4", (out_f, in_f), torch.bfloat16)
        return x @ wd.t()

    peers = {
        "bnb_dequant_mm": lambda: x @ F.dequantize_4bit(packed, qs).t(),
        "qm_dequant_mm": qm_dequant_mm,
        "bf16_mm": partial(torch.matmul, x, w.t()),
    }
    for name, fn in peers.items():
        with qb.record_errors(r["peers"], name + "_error"):
            err = rel_err(fn(), ref)
            us = qb.graph_us(fn, 1, REPLAYS)
            r["peers"][name] = {"us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1),
                                "rel_err": err}  # fmt: skip
    for cfg in TILES:
        if time.time() - t_start > budget_s:
            r["skipped"].append({"cfg": cfg, "why": "budget"})
            continue
        fn = partial(k4.launch_mma, x, flat, *stats, 64, "nf4", out_f, cfg)
        try:
            y = fn()
            err = rel_err(y, ref)
            if not (err <= TOL and bool(torch.isfinite(y).all())):
                r["skipped"].append({"cfg": cfg, "why": f"wrong: relative error {err:.3g}"})
                continue
            us = qb.graph_us(fn, 1, REPLAYS)
        except Exception as e:  # a tile the compiler or the launch refuses: noted, not fatal
            r["skipped"].append({"cfg": cfg, "why": f"{type(e).__name__}: {e}"[:300]})
            continue
        r["tiles"].append({"cfg": cfg, "us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1),
                           "rel_err": err})  # fmt: skip
    r["tiles"].sort(key=lambda t: t["us"])
    if r["tiles"] and "bnb_dequant_mm" in r["peers"]:
        base = r["peers"]["bnb_dequant_mm"]["us"]
        r["best_vs_bnb_dequant_mm"] = round(base / r["tiles"][0]["us"], 3)
    return r


def line(r: dict) -> str:
    peers = ", ".join(f"{k} {v['us']} us ({v['TFLOPs']} TFLOP/s)" for k, v in r["peers"].items()
                      if isinstance(v, dict))  # fmt: skip
    best = r["tiles"][0] if r["tiles"] else None
    b = f"prologue {best['us']} us ({best['TFLOPs']} TFLOP/s) {best['cfg']}" if best else "none"
    return f"[{r['out']}x{r['in']} x {r['rows']} rows] {peers}; best {b}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=".bench/prologue")
    p.add_argument("--rows", default="4096,2048")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop trying tiles after this")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    R: dict = {"bench": "nf4_prologue", "ok": False, "versions": qb.versions(),
               "replays": REPLAYS, "tol": TOL, "results": []}  # fmt: skip
    path = os.path.join(a.out, "nf4_prologue.json")
    os.makedirs(a.out, exist_ok=True)
    with qb.record_errors(R), torch.no_grad():
        torch.manual_seed(0)
        for rows in (int(s) for s in a.rows.split(",")):
            for out_f, in_f in SHAPES:
                r = run_shape(out_f, in_f, rows, t_start, a.budget_s)
                R["results"].append(r)
                print(line(r), flush=True)
                qb.write_json(path, R)
        R["ok"] = True
    R["wall_s"] = round(time.time() - t_start, 1)
    qb.write_json(path, R)
    qb.log(json.dumps({"wall_s": R["wall_s"], "json": path}))
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
