"""The one-row 4-bit kernel (`gemv4.gemv_4bit` through `gemv4.launch_gemv`, beside this script) against
bitsandbytes' own 1-row kernel and a bf16 matmul, on a GPU: a sweep of its tiles.

For each 7B shape (out, in) = 4096x4096, 11008x4096, 4096x11008 (nf4 with double quant, bf16 x,
random weights quantized by bitsandbytes' quantize_4bit), every tile of `CONFIGS` is first checked
against x @ dequantize_4bit(W)^T (bf16; relative error of the norms within `TOL`: the kernel sums
fp32 products of the unrounded weights, the reference rounds each weight and the output to bf16),
then timed as a CUDA graph of `CALLS` calls replayed `REPLAYS` times (microseconds per call). Tiles
that fail to compile or to launch (out of shared memory, registers, ...) or give wrong results are
skipped with a note; the second shape on reuses the compiled kernels (N and K are not specialized).
Peers in the same process: bitsandbytes' matmul_4bit (its gemv kernel at one row), the bf16 weight
(x @ w.t()), and quantmesh's older block kernel at its probe tiles. GB/s = the bytes read once
(packed codes + 8-bit absmax + nested fp32 absmax; the bf16 weight for bf16) / time.
The error column: against the nf4 reference (for bf16_mm it is the quantization error).

Usage (CUDA only, from the repository root, bitsandbytes importable):
    python3 benchmarks/nf4_gemv_bench.py [--out DIR] [--budget-s S] [--shapes 0,1,2]
Writes DIR/nf4_gemv.json (default DIR: .bench/gemv); stops sweeping once --budget-s seconds
(default 120) have passed since the start, noting the tiles not run.
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

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (out, in)
CALLS, REPLAYS = 20, 50
TOL = 1e-2  # relative error of the norms against the bf16 reference
# (BLOCK_N, NB, SPLIT_K, LUT, num_warps, num_stages), the likeliest first (a budget cut keeps
# them). A step reads BLOCK_N x NB x 32 bytes (blocksize 64): 16 bytes a thread at 2 x BLOCK_N x
# NB threads, so BLOCK_N x NB / (16 x num_warps) 16-byte loads per thread per step (1 to 4 here).
# Small programs (1 or 2 warps, 1 to 8 features): 512 to 4096 per 4096 features, many resident
# per SM. LUT 1: the code values gathered from registers (tl.gather) instead of an L1 line.
CONFIGS = [
    (4, 8, 1, 0, 1, 1),
    (2, 16, 1, 0, 1, 1),
    (4, 16, 1, 0, 2, 1),
    (8, 8, 1, 0, 2, 1),
    (2, 8, 1, 0, 1, 1),
    (1, 16, 1, 0, 1, 1),
    (4, 4, 1, 0, 1, 1),
    (8, 4, 1, 0, 1, 1),
    (1, 32, 1, 0, 2, 1),
    (2, 16, 1, 0, 2, 1),
    (4, 8, 1, 0, 2, 1),
    (8, 8, 1, 0, 4, 1),
    (8, 16, 1, 0, 4, 1),
    (4, 16, 1, 0, 4, 1),
    (4, 8, 1, 0, 1, 3),  # software pipelining of the loads
    (2, 16, 1, 0, 1, 3),
    (4, 8, 2, 0, 1, 1),  # split K: partials added by each tile's last program
    (8, 8, 2, 0, 2, 1),
    (8, 8, 4, 0, 2, 1),
    (8, 16, 4, 0, 4, 1),
    (4, 8, 1, 1, 1, 1),  # code values from registers
    (2, 16, 1, 1, 1, 1),
    (8, 8, 1, 1, 2, 1),
]
KEYS = ("BLOCK_N", "NB", "SPLIT_K", "LUT", "num_warps", "num_stages")
BLOCKS_PROBE = dict(KERNEL="blocks", BLOCK_N=16, NB=8, SPLIT_K=1, DOT=0, ROUND=0, num_warps=4,
                    num_stages=3)  # fmt: skip


def bench_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one CUDA graph, replayed
    `replays` times (`qmbench.graph_us`)."""
    return qb.graph_us(fn, calls, replays)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in fp64."""
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def gbps(nbytes: int, us: float) -> int:
    return round(nbytes / (us * 1e-6) / 1e9)


def run_shape(out_f: int, in_f: int, t_start: float, budget_s: float) -> dict:
    """One shape: the peers, then every tile of CONFIGS (checked, then timed) until the budget."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from gemv4 import launch_gemv

    from quantmesh.quant import kernel4 as k4

    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    flat = packed.reshape(-1).view(torch.uint8)
    stats = (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
    nbytes = flat.numel() + qs.absmax.numel() + 4 * qs.state2.absmax.numel()
    x = torch.randn(1, in_f, device="cuda", dtype=torch.bfloat16)
    ref = x @ F.dequantize_4bit(packed, qs).t()  # bf16, as bitsandbytes' weights multiply
    r: dict = {"out": out_f, "in": in_f, "nf4_MB": round(nbytes / 1e6, 3), "peers": {}}
    peers = {
        "bnb_gemv": (partial(bnb.matmul_4bit, x, packed.t(), qs), nbytes),
        "bf16_mm": (partial(torch.matmul, x, w.t()), 2 * out_f * in_f),
        "ours_blocks": (
            partial(k4._launch, x, flat, *stats, 64, "nf4", out_f, BLOCKS_PROBE),
            nbytes,
        ),
    }
    for name, (fn, nb) in peers.items():
        try:
            err = rel_err(fn(), ref)
            us = bench_us(fn)
            r["peers"][name] = {"us": round(us, 2), "GBps": gbps(nb, us), "rel_err": err}
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            r["peers"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    r["sweep"], r["skipped"], r["not_run"] = [], [], []
    for tile in CONFIGS:
        cfg = dict(zip(KEYS, tile, strict=True))
        if time.time() - t_start > budget_s:
            r["not_run"].append(cfg)
            continue
        fn = partial(launch_gemv, x, flat, *stats, 64, "nf4", out_f, cfg)
        t0 = time.time()
        try:
            y = fn()  # compiles on first use
            torch.cuda.synchronize()
        except Exception as e:  # a tile the compiler or the launch refuses: skipped, noted
            r["skipped"].append({"cfg": cfg, "why": f"{type(e).__name__}: {e}"[:300]})
            continue
        err = rel_err(y, ref)
        row = {"cfg": cfg, "rel_err": err, "first_call_s": round(time.time() - t0, 2)}
        if not (err <= TOL and bool(torch.isfinite(y).all())):
            r["skipped"].append(dict(row, why=f"wrong: relative error {err:.3g} > {TOL}"))
            continue
        try:
            us = bench_us(fn)
            again = fn()  # after 1,000+ replays: split-K counts still right, same bits
        except Exception as e:
            r["skipped"].append(dict(row, why=f"timing: {type(e).__name__}: {e}"[:300]))
            continue
        row.update(us=round(us, 2), GBps=gbps(nbytes, us), same_after_replays=torch.equal(y, again))
        r["sweep"].append(row)
    good = [s for s in r["sweep"] if s["same_after_replays"]]
    if good:
        r["best"] = min(good, key=lambda s: s["us"])
    return r


def table(r: dict) -> str:
    """A compact text table of one shape's results."""
    lines = [f"--- out={r['out']} in={r['in']} ({r['nf4_MB']} MB nf4)"]
    bnb_us = r["peers"].get("bnb_gemv", {}).get("us")

    def line(name: str, d: dict) -> str:
        if "us" not in d:
            return f"{name:<34} {d.get('error', d.get('why', ''))[:90]}"
        vs = f"{bnb_us / d['us']:5.2f}x" if bnb_us else "   -  "
        return f"{name:<34} {d['us']:8.2f} us {d['GBps']:6d} GB/s  {vs} bnb  err {d['rel_err']:.1e}"

    for name, d in r["peers"].items():
        lines.append(line(name, d))
    for s in sorted(r["sweep"], key=lambda s: s["us"]):
        c = s["cfg"]
        name = "gemv n{BLOCK_N} nb{NB} sk{SPLIT_K} lut{LUT} w{num_warps} st{num_stages}".format(**c)
        lines.append(line(name, s) + ("" if s["same_after_replays"] else "  CHANGED after replays"))
    for s in r["skipped"]:
        lines.append(f"skipped {s['cfg']}: {s['why'][:80]}")
    if r["not_run"]:
        lines.append(f"not run (budget): {len(r['not_run'])} tiles")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=".bench/gemv")
    p.add_argument("--budget-s", type=float, default=120.0, help="stop sweeping after this")
    p.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    R: dict = {"bench": "nf4_gemv", "ok": False, "versions": qb.versions(), "configs_keys": KEYS,
               "calls_per_graph": CALLS, "replays": REPLAYS, "tol": TOL, "results": []}  # fmt: skip
    path = os.path.join(a.out, "nf4_gemv.json")
    with qb.record_errors(R), torch.no_grad():
        torch.manual_seed(0)
        for i in (int(s) for s in a.shapes.split(",")):
            r = run_shape(*SHAPES[i], t_start, a.budget_s)
            R["results"].append(r)
            print(table(r), flush=True)
            qb.write_json(path, R)
        R["ok"] = True
    R["wall_s"] = round(time.time() - t_start, 1)
    qb.write_json(path, R)
    best = {f"{r['out']}x{r['in']}": r.get("best", {}).get("us") for r in R["results"]}
    qb.log(json.dumps({"best_us": best, "wall_s": R["wall_s"], "json": path}))
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
