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
and the same for the input gradient dx = g @ W (g: rows x out), the product training's backward
makes with the frozen weight: dequantize then g @ w (bitsandbytes', quantmesh's), the bf16
weight, and `nf4_dx.launch_dx` (an experiment: the codes dequantized in its prologue) at each
tile of TILES_DX. nf4 with double quant, bf16, random weights.

Usage (from the repository root, bitsandbytes importable):
    python3 benchmarks/nf4_prologue_bench.py [--out DIR] [--rows 4096,2048] [--budget-s S]
    TRITON_INTERPRET=1 python3 benchmarks/nf4_prologue_bench.py --smoke   (CPU: each kernel on
        small shapes in Triton's interpreter, fp16, checked only: exit 1 when one is wrong)
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
TOL = 1e-2  # relative error of the norms against the product of the dequantized weight
SMOKE_TOL = 1e-3  # (fp16 in the interpreter: each weight and the output rounded once)
_T = dict(BLK=0, LUT=1)
# (BLOCK_N features, BLOCK_M rows) a program, NB blocks of 64 codes a step; the weight is wgmma's
# A operand in registers, x its B operand through shared memory
TILES = [
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=1, num_warps=8, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=256, NB=1, num_warps=8, num_stages=3),
    dict(_T, BLOCK_N=256, BLOCK_M=128, NB=1, num_warps=8, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=1, num_warps=4, num_stages=3),
    dict(_T, BLOCK_N=128, BLOCK_M=256, NB=1, num_warps=8, num_stages=2),
    dict(_T, BLOCK_N=128, BLOCK_M=128, NB=2, num_warps=8, num_stages=2),
    dict(_T, BLOCK_N=64, BLOCK_M=128, NB=1, num_warps=4, num_stages=4),
    dict(_T, BLOCK_N=128, BLOCK_M=64, NB=2, num_warps=4, num_stages=3),
]
# the input gradient's (`nf4_dx.launch_dx`): BLOCK_M rows and BLOCK_K inputs a program, BLOCK_R of
# W's rows a step
TILES_DX = [
    dict(BLOCK_M=128, BLOCK_K=128, BLOCK_R=64, LUT=1, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, LUT=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_K=128, BLOCK_R=64, LUT=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_K=128, BLOCK_R=32, LUT=1, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_K=256, BLOCK_R=32, LUT=1, num_warps=8, num_stages=3),
]


def _weights(out_f: int, in_f: int, device: str, dtype: torch.dtype) -> tuple:
    """(the weight in `dtype`, its nf4 codes, QuantState, flat codes, kernel statistics) of a
    random W (the QuantState dequantizes to `dtype`)."""
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    w = (torch.randn(out_f, in_f, device=device) * 0.02).to(dtype)
    packed, qs = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    flat = packed.reshape(-1).view(torch.uint8)
    return w, packed, qs, flat, k4._statistics(qs, w.device)


def _candidates(r: dict, key: str, peers: dict, tiles: list, launch, ref: torch.Tensor,
                flops: int, t_start: float, budget_s: float, timed: bool = True) -> None:  # fmt: skip
    """Into r[key]: the peers (a function, or a function and its own reference: the bf16
    weight's product is not the dequantized weight's) and every tile (`launch(cfg)`), each
    checked against `ref`, then timed (`timed`), the tiles ranked; a tile that fails or is wrong
    is noted, not fatal."""
    out: dict = {"peers": {}, "tiles": [], "skipped": []}
    r[key] = out
    runs = [(name, fn, None) for name, fn in peers.items()]  # (fn, or (fn, its own reference))
    runs += [(None, partial(launch, cfg), cfg) for cfg in tiles]
    for name, fn, cfg in runs:
        if cfg is not None and time.time() - t_start > budget_s:
            out["skipped"].append({"cfg": cfg, "why": "budget"})
            continue
        fn, want = fn if isinstance(fn, tuple) else (fn, ref)
        try:
            y = fn()
            err = rel_err(y, want)
            tol = TOL if timed else SMOKE_TOL
            if not (err <= tol and bool(torch.isfinite(y).all())):
                raise ValueError(f"wrong: relative error {err:.3g} > {tol}")
            row: dict = {"rel_err": err}
            if timed:
                us = qb.graph_us(fn, 1, REPLAYS)
                row.update(us=round(us, 1), TFLOPs=round(flops / us / 1e6, 1))
        except Exception as e:  # a tile the compiler or the launch refuses, or a wrong one
            why = f"{type(e).__name__}: {e}"[:300]
            if cfg is None:
                out["peers"][name] = {"error": why}
            else:
                out["skipped"].append({"cfg": cfg, "why": why})
            continue
        if cfg is None:
            out["peers"][name] = row
        else:
            out["tiles"].append(dict(row, cfg=cfg))
    if timed:
        out["tiles"].sort(key=lambda t: t["us"])
        base = out["peers"].get("bnb_dequant_mm", {}).get("us")
        if out["tiles"] and base:
            out["best_vs_bnb_dequant_mm"] = round(base / out["tiles"][0]["us"], 3)


def run_shape(out_f: int, in_f: int, rows: int, t_start: float, budget_s: float,
              device: str = "cuda", smoke: bool = False) -> dict:  # fmt: skip
    """The forward's and the input gradient's peers and tiles at one shape and row count."""
    import bitsandbytes.functional as F
    from nf4_dx import launch_dx

    from quantmesh.quant import kernel4 as k4

    dt = torch.float16 if smoke else torch.bfloat16  # (the interpreter's bf16 dot is wrong)
    # (smoke: an fp32 weight, so that the reference's dequantized weight rounds to fp16 once, as
    # the kernels' do)
    w, packed, qs, flat, stats = _weights(out_f, in_f, device, torch.float32 if smoke else dt)
    x = torch.randn(rows, in_f, device=device).to(dt)
    g = torch.randn(rows, out_f, device=device).to(dt)
    wd = F.dequantize_4bit(packed, qs).to(dt)
    flops = 2 * rows * out_f * in_f
    r: dict = {"out": out_f, "in": in_f, "rows": rows}
    fwd_tiles = [dict(t, LUT=0) for t in SMOKE_TILES] if smoke else TILES
    dx_tiles = [dict(t, LUT=0) for t in SMOKE_TILES_DX] if smoke else TILES_DX

    def qm_w() -> torch.Tensor:
        return k4.dequantize_4bit(flat, *stats, 64, "nf4", (out_f, in_f), dt)

    wc = w.to(dt)  # (smoke: fp16; else the bf16 weight itself)
    peers = {  # (smoke: checked, not timed)
        "bnb_dequant_mm": lambda: x @ F.dequantize_4bit(packed, qs).to(dt).t(),
        "qm_dequant_mm": lambda: x @ qm_w().t(),
        "bf16_mm": (partial(torch.matmul, x, wc.t()), x.float() @ wc.float().t()),  # unquantized
    }  # fmt: skip
    _candidates(r, "forward", peers, fwd_tiles,
                lambda cfg: k4.launch_mma(x, flat, *stats, 64, "nf4", out_f, cfg),
                x.float() @ wd.float().t(), flops, t_start, budget_s, not smoke)  # fmt: skip
    peers = {
        "bnb_dequant_mm": lambda: g @ F.dequantize_4bit(packed, qs).to(dt),
        "qm_dequant_mm": lambda: g @ qm_w(),
        "bf16_mm": (partial(torch.matmul, g, wc), g.float() @ wc.float()),
    }  # fmt: skip
    _candidates(r, "input_grad", peers, dx_tiles,
                lambda cfg: launch_dx(g, flat, *stats, in_f, cfg),
                g.float() @ wd.float(), flops, t_start, budget_s, not smoke)  # fmt: skip
    return r


def line(r: dict) -> str:
    """One shape's figures on one line a product (forward, input gradient)."""
    out = []
    for key in ("forward", "input_grad"):
        d = r[key]
        peers = ", ".join(f"{k} {v['us']} us" if "us" in v else
                          f"{k} {v.get('error') or 'checked'}" for k, v in d["peers"].items())  # fmt: skip
        best = d["tiles"][0] if d["tiles"] else None
        if best is None:
            b = "none"
        elif "us" in best:
            b = f"{best['us']} us ({best['TFLOPs']} TFLOP/s) {best['cfg']}"
        else:
            b = f"checked, rel_err at most {max(t['rel_err'] for t in d['tiles']):.2g}"
        bad = f"; {len(d['skipped'])} skipped" if d["skipped"] else ""
        out.append(f"[{r['out']}x{r['in']} x {r['rows']} rows, {key}] {peers}; best {b}{bad}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=".bench/prologue")
    p.add_argument("--rows", default="4096,2048")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop trying tiles after this")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, Triton's interpreter (TRITON_INTERPRET=1): small shapes, checked only")  # fmt: skip
    a = p.parse_args(argv)
    if a.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
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


# --smoke: small tiles (LUT 0: the interpreter loads each code's value) on shapes whose last
# programs are partly masked
SMOKE_TILES = [dict(BLK=0, BLOCK_N=16, BLOCK_M=16, NB=1), dict(BLK=0, BLOCK_N=32, BLOCK_M=32, NB=2)]
SMOKE_TILES_DX = [
    dict(BLOCK_M=16, BLOCK_K=64, BLOCK_R=16),
    dict(BLOCK_M=32, BLOCK_K=128, BLOCK_R=32),
]


def smoke() -> int:
    """Each kernel and tile in Triton's interpreter on CPU, checked against the dequantized
    weight's product; 0 when all hold."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.manual_seed(0)
    bad = 0
    for out_f, in_f, rows in ((72, 192, 40), (40, 256, 17)):
        r = run_shape(out_f, in_f, rows, time.time(), 1e9, device="cpu", smoke=True)
        print(line(r), flush=True)
        for key in ("forward", "input_grad"):
            bad += len(r[key]["skipped"]) + sum("error" in v for v in r[key]["peers"].values())
            bad += len(r[key]["tiles"]) != len(SMOKE_TILES if key == "forward" else SMOKE_TILES_DX)
    return 1 if bad else 0


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
