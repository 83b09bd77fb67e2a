"""quantmesh's gemv (`quantmesh.quant.kernel4.launch_gemv`: the Triton kernels
`_triton4.qm_gemv_lines`, the lanes along K, and `qm_gemv_4bit`, one thread per output feature)
and, from 9 rows on, its tensor-core kernel (`launch_mma`: `_triton4.qm_mma_4bit`) against
bitsandbytes' own kernels and a bf16 matmul, on a GPU: a sweep of their tiles at one row (or, with
--rows, at each of a few row counts), then the best tile (the fastest on weights that do not fit
in L2) and bitsandbytes cold.

For each 7B shape (out, in) = 4096x4096, 11008x4096, 4096x11008 (nf4 with double quant, bf16 x,
random weights quantized by bitsandbytes' quantize_4bit), every tile of `CONFIGS` is first checked
against x @ dequantize_4bit(W)^T (bf16; relative error of the norms within `TOL`: the kernel sums
fp32 products of the unrounded weights, the reference rounds each weight and the output to bf16),
then timed as a CUDA graph of `CALLS` calls replayed `REPLAYS` times (microseconds per call). The
same weight every call stays in the H200's 50 MB L2 ("hot"); "cold" rotates over `COPIES` weights
(more bytes than L2 holds), as decoding does (each layer's weights read once a token). Every tile
is timed both ways and ranked cold. Tiles that
fail to compile or to launch, or give wrong results, are skipped with a note. Peers in the same
process: bitsandbytes' matmul_4bit ("bnb": its gemv kernel at one row, dequantize + matmul at
more), quantmesh's Triton dequantize + one matmul ("qm_dequant_mm", more than one row), the
bf16 weight (x @ w.t()) and torchao's int4 weight-only ("torchao_int4": its own format, group
128, so its error against the nf4 reference is not comparable; its bytes: codes and bf16
scales and zeros). At 2 to 8 rows the tiles are `ROW_CONFIGS` (the library's tile for that many
rows first); from 9 rows on `MMA_CONFIGS` (likewise), and the gemv's library tile where it takes
the rows (up to 16).
GB/s = the bytes read once (packed codes + 8-bit absmax + nested fp32 absmax; the bf16 weight for
bf16) / time. The PTX (and SASS where nvdisasm is found) of each shape's best tile at one row is
written beside the JSON (gemv.ptx, gemv.sass: every shape's in one file each), and of the best
tensor-core tile at the largest row count asked for (mma.ptx, mma.sass).

Usage (CUDA only, from the repository root, bitsandbytes importable):
    python3 benchmarks/nf4_gemv_bench.py [--out DIR] [--budget-s S] [--shapes 0,1,2] [--tiles JSON]
                                         [--rows 1,2,4,8,16,32,64]
Writes DIR/nf4_gemv.json (default DIR: .bench/gemv; with --rows, DIR/nf4_gemv_rows.json); stops
sweeping once --budget-s seconds
(default 150) have passed since the start, noting the tiles not run.
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
from nf4_rows_bench import torchao_int4  # noqa: E402

# (out, in): the 7B shapes, then q/k/v and gate/up joined (kernel4.JOIN_ENABLED: --shapes 3,4)
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (3 * 4096, 4096), (2 * 11008, 4096)]
CALLS, REPLAYS, COPIES = 16, 50, 8
TOL = 1e-2  # relative error of the norms against the bf16 reference
# Tiles (`kernel4.gemv_config`'s keys), the likeliest first (a budget cut keeps them). KERNEL
# "lines": `qm_gemv_lines` (lanes along K), BLOCK_N features a program, SB blocks a stride, WK
# warps splitting K (num_warps = WK), BLK blocks a share (None: gemv_config cuts K for about
# GEMV_WARPS warps, in whole strides), LUT 1 (code values and absmax shuffled from the lane that
# holds them). Else `qm_gemv_4bit` (one feature a thread). The first is the library's tile.
_L = dict(KERNEL="lines", LUT=1, SB=32, BLK=None, num_warps=1, num_stages=1)
CONFIGS = [
    dict(_L, BLOCK_N=2),
    dict(_L, BLOCK_N=1),  # twice the programs: about one wave at 4096 features (not yet timed)
    dict(_L, BLOCK_N=4),
    dict(_L, BLOCK_N=4, WK=2, num_warps=2),
    dict(_L, BLOCK_N=8, SB=16, BLK=16),
]
# At more than one row (--rows): the library's tile for that many rows is put first (run_shape);
# then these
ROW_CONFIGS = [
    dict(_L, BLOCK_N=2),
    dict(_L, BLOCK_N=4),
    dict(_L, BLOCK_N=4, SB=16),
    dict(_L, BLOCK_N=4, SB=8),
    dict(_L, BLOCK_N=4, SB=4),
    dict(_L, BLOCK_N=8, SB=8),
    dict(_L, BLOCK_N=8, SB=4),
    dict(_L, BLOCK_N=2, SB=16),
]
# The tensor-core kernel's tiles (`kernel4.mma_config`'s keys; KERNEL "mma"), from 9 rows on,
# after the library's tile for that many rows: BLOCK_N features a program, NB blocks of 64 codes
# a step, BLK blocks a share (None: mma_config cuts K for about MMA_PROGRAMS programs; 0: one
# share), num_stages (software pipelining of the code and x loads)
_M = dict(KERNEL="mma", LUT=1, BLK=None, num_warps=4, num_stages=3)
MMA_CONFIGS = [
    dict(_M, BLOCK_N=64, NB=2),
    dict(_M, BLOCK_N=64, NB=4),
    dict(_M, BLOCK_N=64, NB=2, num_stages=4),
    dict(_M, BLOCK_N=64, NB=2, num_stages=2),
    dict(_M, BLOCK_N=128, NB=2),
    dict(_M, BLOCK_N=128, NB=2, num_warps=8),
    dict(_M, BLOCK_N=64, NB=2, BLK=0),
    dict(_M, BLOCK_N=64, NB=2, BLK=16),
    dict(_M, BLOCK_N=128, NB=2, BLK=16),
    dict(_M, BLOCK_N=64, NB=1, num_stages=4),
    dict(_M, BLOCK_N=32, NB=4),
]


def bench_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one CUDA graph, replayed
    `replays` times (`qmbench.graph_us`)."""
    return qb.graph_us(fn, calls, replays)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in fp64."""
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def gbps(nbytes: int, us: float) -> int:
    return round(nbytes / (us * 1e-6) / 1e9)


def launch(cfg: dict):
    """The launcher of the tile `cfg`: `kernel4.launch_mma` for KERNEL "mma", the experiment
    `nf4_pairs.launch_pairs` (a CUDA kernel: code pairs looked up in shared memory) for
    "pairs", "pairs_k" and "pairs32" (its second and third layouts), the experiment
    `nf4_xtab.launch_xtab` (a CUDA kernel: the input's products looked up) for "xtab", else
    `launch_gemv`."""
    from quantmesh.quant import kernel4 as k4

    if cfg.get("KERNEL") in ("pairs", "pairs_k", "pairs32"):
        from nf4_pairs import launch_pairs

        return launch_pairs
    if cfg.get("KERNEL") == "xtab":
        from nf4_xtab import launch_xtab

        return launch_xtab
    return k4.launch_mma if cfg.get("KERNEL") == "mma" else k4.launch_gemv


def tiles_at(rows: int, out_f: int, in_f: int) -> list[dict]:
    """The tiles to time at `rows` rows, each once (the library's is often among the lists too),
    the likeliest first (a budget cut keeps them): CONFIGS at one row; up to the gemv's
    `GEMV_MAX_ROWS` its library tile and ROW_CONFIGS; from the tensor-core kernel's first row on,
    its library tile and MMA_CONFIGS, then the gemv's library tile alone where it takes the rows;
    K cut as the library cuts it where a tile leaves BLK None."""
    from quantmesh.quant import kernel4 as k4

    if rows == 1:
        tiles = [k4.gemv_config(1, out_f, in_f, 64, t) for t in CONFIGS]
    elif rows < k4.MMA_MIN_ROWS:
        gemv = [k4.gemv_config(rows, out_f, in_f, 64), *ROW_CONFIGS]
        tiles = [k4.gemv_config(rows, out_f, in_f, 64, t) for t in gemv]
    else:
        mma = [dict(k4.mma_config(rows, out_f, in_f), KERNEL="mma"), *MMA_CONFIGS]
        tiles = [k4.mma_config(rows, out_f, in_f, t) for t in mma]
        if rows <= k4.GEMV_ROWS_LIMIT:  # (its sweep at 16 rows: docs/benchmarks.md)
            tiles.append(k4.gemv_config(rows, out_f, in_f, 64))
    once: list[dict] = []
    for t in tiles:
        if t not in once:
            once.append(t)
    return once


def run_shape(out_f: int, in_f: int, t_start: float, budget_s: float, out_dir: str,
              rows: int = 1, mma_asm: bool = False) -> dict:  # fmt: skip
    """One shape at `rows` rows: the peers, every tile of `tiles_at`, checked, then timed, until
    the budget; then the best and bitsandbytes cold. PTX: the best tile's at one row, and the
    best tensor-core tile's with `mma_asm`."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    weights = []
    for _ in range(COPIES):
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, qs = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        flat = packed.reshape(-1).view(torch.uint8)
        stats = (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
        weights.append((w, packed, qs, flat, stats))
    w, packed, qs, flat, stats = weights[0]
    nbytes = flat.numel() + qs.absmax.numel() + 4 * qs.state2.absmax.numel()
    x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
    ref = x @ F.dequantize_4bit(packed, qs).t()  # bf16 weights, as bitsandbytes' multiply
    r: dict = {"out": out_f, "in": in_f, "rows": rows, "nf4_MB": round(nbytes / 1e6, 3),
               "peers": {}}  # fmt: skip
    peers = {
        "bnb": (partial(bnb.matmul_4bit, x, packed.t(), qs), nbytes),
        "bf16_mm": (partial(torch.matmul, x, w.t()), 2 * out_f * in_f),
    }
    ao = torchao_int4(w)  # torchao's int4 weight-only (its own format: group 128, asymmetric)
    if isinstance(ao, str):
        r["peers"]["torchao_int4"] = {"error": ao}
    else:
        peers["torchao_int4"] = (partial(ao, x), out_f * in_f // 2 + 4 * out_f * in_f // 128)
    if rows > 1:
        shape = (out_f, in_f)

        def dequant_mm():
            w = k4.dequantize_4bit(flat, *stats, 64, "nf4", shape, torch.bfloat16)
            return x @ w.t()

        peers["qm_dequant_mm"] = (dequant_mm, nbytes)
    for name, (fn, nb) in peers.items():
        try:
            err = rel_err(fn(), ref)
            us = bench_us(fn)
            r["peers"][name] = {"us": round(us, 2), "GBps": gbps(nb, us), "rel_err": err}
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            r["peers"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    r["sweep"], r["skipped"], r["not_run"] = [], [], []
    for cfg in tiles_at(rows, out_f, in_f):
        if time.time() - t_start > budget_s:
            r["not_run"].append(cfg)
            continue
        row = check_and_time(partial(launch(cfg), x, flat, *stats, 64, "nf4", out_f, cfg),
                             ref, nbytes, cfg, r["skipped"])  # fmt: skip
        if row is not None:
            c = cold(weights, x, out_f, cfg, nbytes, ("ours",))
            row.update(cold_us=c["ours_us"], cold_GBps=c["ours_GBps"])
            r["sweep"].append(row)
    good = sorted((s for s in r["sweep"] if s["same_after_replays"]), key=lambda s: s["cold_us"])
    if not good:
        return r
    r["best"] = best = good[0]  # the fastest on cold weights, as decoding reads them
    r["cold"] = cold(weights, x, out_f, best["cfg"], nbytes)
    asm = []  # (one row's, and one row count's of the tensor-core kernel: few files)
    if rows == 1:
        asm.append(("gemv", best["cfg"]))
    mma = [s for s in good if s["cfg"].get("KERNEL") == "mma"]
    if mma_asm and mma:
        asm.append(("mma", mma[0]["cfg"]))
    for stem, cfg in asm:
        keep: list = []
        launch(cfg)(x, flat, *stats, 64, "nf4", out_f, cfg, keep=keep)
        if keep:  # (a Triton kernel's; the CUDA experiment keeps none)
            dump_asm(keep[-1], os.path.join(out_dir, stem),
                     f"{out_f} x {in_f}, {rows} rows, {cfg}")  # fmt: skip
    return r


def check_and_time(fn, ref: torch.Tensor, nbytes: int, cfg: dict, skipped: list) -> dict | None:
    """One tile: run (compiling on first use), check against `ref`, time hot; None (and a note
    in `skipped`) when it fails or is wrong."""
    t0 = time.time()
    try:
        y = fn()
        torch.cuda.synchronize()
    except Exception as e:  # a tile the compiler or the launch refuses: skipped, noted
        skipped.append({"cfg": cfg, "why": f"{type(e).__name__}: {e}"[:300]})
        return None
    err = rel_err(y, ref)
    row = {
        "cfg": cfg,
        "rows": y.shape[0],
        "rel_err": err,
        "first_call_s": round(time.time() - t0, 2),
    }
    if not (err <= TOL and bool(torch.isfinite(y).all())):
        skipped.append(dict(row, why=f"wrong: relative error {err:.3g} > {TOL}"))
        return None
    try:
        us = bench_us(fn)
        again = fn()  # after 800+ replays: the counts still right, the same bits
    except Exception as e:
        skipped.append(dict(row, why=f"timing: {type(e).__name__}: {e}"[:300]))
        return None
    row.update(us=round(us, 2), GBps=gbps(nbytes, us), same_after_replays=torch.equal(y, again))
    return row


def cold(weights: list, x: torch.Tensor, out_f: int, cfg: dict, nbytes: int,
         names: tuple[str, ...] = ("ours", "bnb")) -> dict:  # fmt: skip
    """Microseconds per call with each call on the next of the COPIES weights (more bytes than L2
    holds), at x's rows: the tile `cfg` ("ours") and bitsandbytes' matmul_4bit ("bnb")."""
    import bitsandbytes as bnb

    out: dict = {"copies": COPIES, "MB_all": round(COPIES * nbytes / 1e6, 1)}
    for name in names:
        turn = [0]

        def fn(name=name, turn=turn):
            w, packed, qs, flat, stats = weights[turn[0] % COPIES]
            turn[0] += 1
            if name == "bnb":
                return bnb.matmul_4bit(x, packed.t(), qs)
            return launch(cfg)(x, flat, *stats, 64, "nf4", out_f, cfg)

        us = qb.graph_us(fn, CALLS, REPLAYS)  # CALLS a multiple of COPIES: each weight alike
        out[f"{name}_us"] = round(us, 2)
        out[f"{name}_GBps"] = gbps(nbytes, us)
    return out


def dump_asm(compiled, stem: str, title: str) -> None:
    """The compiled kernel's PTX (and SASS, where Triton finds nvdisasm) appended to stem.ptx and
    stem.sass beside the JSON, under a `// ---- title` line: two files for all the shapes, as few
    as possible to carry back."""
    for kind in ("ptx", "sass"):
        try:
            text = compiled.asm[kind]
        except Exception as e:  # no nvdisasm: the PTX alone
            text = f"not available: {type(e).__name__}: {e}"
        with open(f"{stem}.{kind}", "a") as f:
            text = text if isinstance(text, str) else text.decode(errors="replace")
            f.write(f"// ---- {title}\n{text.rstrip()}\n")


def table(r: dict) -> str:
    """A compact text table of one shape's results."""
    lines = [f"--- out={r['out']} in={r['in']} rows={r['rows']} ({r['nf4_MB']} MB nf4)"]
    bnb_us = r["peers"].get("bnb", {}).get("us")

    def line(name: str, d: dict) -> str:
        if "us" not in d:
            return f"{name:<34} {d.get('error', d.get('why', ''))[:90]}"
        vs = f"{bnb_us / d['us']:5.2f}x" if bnb_us else "   -  "
        cold = f"  cold {d['cold_us']:7.2f} us" if "cold_us" in d else ""
        return (f"{name:<40} {d['us']:8.2f} us {d['GBps']:6d} GB/s  {vs} bnb  "
                f"err {d['rel_err']:.1e}{cold}")  # fmt: skip

    for name, d in r["peers"].items():
        lines.append(line(name, d))
    for s in sorted(r["sweep"], key=lambda s: s["cold_us"]):
        c = s["cfg"]
        if c.get("KERNEL") in ("pairs", "pairs_k", "pairs32"):  # (nf4_pairs.py: fixed layouts)
            name = f"{c['KERNEL']} bps{c.get('BPS', 2)} (CUDA, shared-memory pair tables)"
        elif c.get("KERNEL") == "xtab":  # (nf4_xtab.py)
            name = "xtab sl{} tr{} t{} bps{} pf{} det{} (CUDA)".format(
                c.get("SL", 256), c.get("TR", 32), c.get("THREADS", 512), c.get("BPS", 1),
                c.get("PF", 0), c.get("DET", 0))  # fmt: skip
        elif c.get("KERNEL") == "mma":
            name = "mma n{BLOCK_N} m{BLOCK_M} nb{NB} blk{BLK} lut{LUT} w{num_warps} s{}".format(
                c.get("num_stages"), **c)  # fmt: skip
        else:
            name = "{} n{BLOCK_N} sb{} wk{} blk{BLK} lut{LUT} w{num_warps}".format(
                c.get("KERNEL", "gemv"), c.get("SB", "-"), c.get("WK", 1), **c)  # fmt: skip
        lines.append(line(name, s) + ("" if s["same_after_replays"] else "  CHANGED after replays"))
    for s in r["skipped"]:
        lines.append(f"skipped {s['cfg']}: {s['why'][:80]}")
    if r["not_run"]:
        lines.append(f"not run (budget): {len(r['not_run'])} tiles")
    if "cold" in r:
        lines.append(f"cold: {r['cold']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=".bench/gemv")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this")
    p.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
    p.add_argument("--tiles", default=None, help="a JSON list of tiles in place of CONFIGS")
    p.add_argument("--rows", default=None,
                   help="row counts (e.g. 1,2,4,8,16,32,64): each shape at each; ROW_CONFIGS "
                        "at 2-8, MMA_CONFIGS from 9")  # fmt: skip
    a = p.parse_args(argv)
    if a.tiles:  # each list keeps its own kind (mma tiles: KERNEL "mma")
        tiles = json.loads(a.tiles)
        CONFIGS[:] = [t for t in tiles if t.get("KERNEL") != "mma"]
        ROW_CONFIGS[:] = CONFIGS
        MMA_CONFIGS[:] = [t for t in tiles if t.get("KERNEL") == "mma"]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    R: dict = {"bench": "nf4_gemv", "ok": False, "versions": qb.versions(),
               "calls_per_graph": CALLS, "replays": REPLAYS, "tol": TOL, "results": []}  # fmt: skip
    path = os.path.join(a.out, "nf4_gemv_rows.json" if a.rows else "nf4_gemv.json")
    for stem in ("gemv", "mma"):  # dump_asm appends each shape's: this run's alone
        for kind in ("ptx", "sass"):
            if os.path.exists(os.path.join(a.out, f"{stem}.{kind}")):
                os.remove(os.path.join(a.out, f"{stem}.{kind}"))
    row_counts = [int(s) for s in a.rows.split(",")] if a.rows else [1]
    R["rows"] = row_counts
    os.makedirs(a.out, exist_ok=True)
    with qb.record_errors(R), torch.no_grad():
        torch.manual_seed(0)
        for rows in row_counts:
            for i in (int(s) for s in a.shapes.split(",")):
                r = run_shape(*SHAPES[i], t_start, a.budget_s, a.out, rows,
                              mma_asm=rows == max(row_counts))  # fmt: skip
                R["results"].append(r)
                print(table(r), flush=True)
                qb.write_json(path, R)
        R["ok"] = True
    R["wall_s"] = round(time.time() - t_start, 1)
    qb.write_json(path, R)
    best = {f"{r['out']}x{r['in']}x{r['rows']}": r.get("best", {}).get("cold_us")
            for r in R["results"]}  # fmt: skip
    qb.log(json.dumps({"best_cold_us": best, "wall_s": R["wall_s"], "json": path}))
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
