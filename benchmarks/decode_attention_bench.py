"""quantmesh's decode attention (`quantmesh.infer.attention`: one query token, a split-KV Triton
kernel that skips the key blocks the mask hides) against torch's SDPA, on a GPU.

Shapes: a 7B decode step's attention (32 query heads of 128, --kv-heads kv heads: 32, MHA, by
default), bf16, a static cache of L slots of which the first `filled` are written (a bool mask
(batch, 1, 1, L) as transformers' sdpa path makes it for a compiled step, expanded from one row),
for each (L, filled) of `CASES` and each batch of --batches. Timed:
- "ours": the op `quantmesh::decode_attention` at the library's tiles (`decode_config`);
- "sdpa": torch's SDPA with its default backends on the whole cache and the mask, the kv heads
  repeated as transformers does for grouped-query attention under a mask;
- "sdpa_filled": SDPA on the written slots alone, no mask: what reading only those would cost
  with torch's kernel;
- with --sweep, the kernel at each tile of `TILES` too (BLOCK_L keys a block, SPLIT keys a
  split, num_warps).
Each is first checked against SDPA's math backend in fp32 (relative error of the norms at most
`TOL`; a tile that fails is reported, not timed), then timed as a CUDA graph of `calls` calls
replayed --replays times (microseconds per call), each call on another copy of the cache so that
together they hold more than --cold-mb megabytes (a decode step reads each layer's cache once:
L2 does not hold it). GB/s: the written slots' K and V bytes over the time.

Usage (CUDA only, from the repository root):
    python3 benchmarks/decode_attention_bench.py [--out DIR] [--batches 1,32] [--kv-heads 32]
                                                  [--sweep] [--replays 50]
Writes DIR/decode_attention.json (default DIR: .bench/attention), rewritten after each case.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))  # this tree's kernels first
import qmbench as qb  # noqa: E402

CASES = [(512, 288), (2048, 300), (2048, 2000)]  # (cache slots L, written slots)
TOL = 1e-2  # relative error of the norms against SDPA's math backend in fp32
TILES = [
    dict(BLOCK_L=bl, SPLIT=bl * per, num_warps=w)
    for bl in (16, 32, 64)
    for per in (1, 2, 4)
    for w in (2, 4, 8)
]  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=".bench/attention", help="folder for the result JSON")
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=32, help="kv heads (8: grouped-query)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--replays", type=int, default=50, help="replays of each CUDA graph")
    p.add_argument("--cold-mb", type=float, default=256.0,
                   help="the caches a graph's calls rotate over hold at least this many MB")  # fmt: skip
    p.add_argument("--max-calls", type=int, default=64, help="at most this many calls a graph")
    p.add_argument("--sweep", action="store_true", help="also the kernel at each tile of TILES")
    return p.parse_args(argv)


def reference(q, k, v, mask, scaling) -> torch.Tensor:
    """SDPA's math backend in fp32, (batch, 1, heads, head_dim)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(groups, 1)
    vv = v.float().repeat_interleave(groups, 1)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, attn_mask=mask,
                                                               scale=scaling)  # fmt: skip
    return out.transpose(1, 2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def run_case(a, R: dict, batch: int, L: int, filled: int, dtype, out_path: str) -> None:
    from quantmesh.infer import attention as A

    name = f"b{batch}_L{L}_f{filled}"
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    groups = hq // hkv
    scaling = d**-0.5
    cache_bytes = 2 * batch * hkv * L * d * torch.finfo(dtype).bits // 8  # K and V
    calls = max(2, min(a.max_calls, math.ceil(a.cold_mb * 2**20 / cache_bytes)))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    ks = [torch.randn(batch, hkv, L, d, device="cuda", generator=g).to(dtype) for _ in range(calls)]
    vs = [torch.randn(batch, hkv, L, d, device="cuda", generator=g).to(dtype) for _ in range(calls)]
    row = (torch.arange(L, device="cuda") < filled)[None, None, None, :]
    mask = row.expand(batch, 1, 1, L)  # transformers' decode mask: one row, expanded
    ref = reference(q, ks[0], vs[0], mask, scaling)
    rec: dict = {"batch": batch, "L": L, "filled": filled, "heads": hq, "kv_heads": hkv,
                 "head_dim": d, "calls_per_graph": calls, "cfg": A.decode_config(batch, hkv,
                                                                                 groups, d, L)}  # fmt: skip
    filled_bytes = cache_bytes * filled / L

    def timed(key: str, one, check: torch.Tensor | None = None) -> None:
        """Check `one(k, v)` (unless it reads other slots: `check` given), then time it."""
        with qb.record_errors(rec, f"{key}_error"):
            out = one(ks[0], vs[0])
            err = rel_err(out if check is None else check, ref)
            rec[f"{key}_err"] = round(err, 6)
            if err > TOL:
                rec[f"{key}_error"] = f"relative error {err:.3g} > {TOL}: not timed"
                return
            it = iter(range(10**9))

            def call() -> None:
                i = next(it) % calls
                one(ks[i], vs[i])

            us = qb.graph_us(call, calls=calls, replays=a.replays)
            rec[f"{key}_us"] = round(us, 2)
            rec[f"{key}_gbps"] = round(filled_bytes / us / 1e3, 1)

    def sdpa(k, v, m=mask):
        if groups > 1:  # transformers repeats the kv heads under a mask
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                scale=scaling).transpose(1, 2)  # fmt: skip

    timed("ours", lambda k, v: A.decode_attention_op(q, k, v, mask, scaling))
    timed("sdpa", sdpa)
    sub = reference(q, ks[0][:, :, :filled], vs[0][:, :, :filled], None, scaling)
    timed("sdpa_filled", lambda k, v: sdpa(k[:, :, :filled], v[:, :, :filled], None), sub)
    if "ours_us" in rec and "sdpa_us" in rec:
        rec["sdpa_over_ours"] = round(rec["sdpa_us"] / rec["ours_us"], 3)
    if a.sweep:
        rec["tiles"] = []
        for cfg in TILES:
            t: dict = {"cfg": cfg}
            with qb.record_errors(t):
                out = A.launch_decode_attention(q, ks[0], vs[0], mask, scaling, cfg)
                t["err"] = round(rel_err(out, ref), 6)
                if t["err"] <= TOL:
                    it = iter(range(10**9))

                    def call(cfg=cfg, it=it) -> None:
                        i = next(it) % calls
                        A.launch_decode_attention(q, ks[i], vs[i], mask, scaling, cfg)

                    t["us"] = round(qb.graph_us(call, calls=calls, replays=a.replays), 2)
            rec["tiles"].append(t)
        best = min((t for t in rec["tiles"] if "us" in t), key=lambda t: t["us"], default=None)
        rec["best_tile"] = best
    R["cases"][name] = rec
    qb.log(f"{name}: ours {rec.get('ours_us')} us, sdpa {rec.get('sdpa_us')} us, sdpa on the "
           f"written slots {rec.get('sdpa_filled_us')} us"
           + (f", best tile {rec['best_tile']}" if rec.get("best_tile") else ""))  # fmt: skip
    qb.write_json(out_path, R)


def main(argv=None) -> int:
    a = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention_bench.py needs a CUDA device")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    out_path = os.path.join(a.out, "decode_attention.json")
    R: dict = {"bench": "decode_attention", "args": vars(a), "versions": qb.versions(),
               "device": torch.cuda.get_device_name(), "cases": {}, "ok": False}  # fmt: skip
    t0 = time.time()
    with qb.record_errors(R):
        for batch in [int(b) for b in a.batches.split(",") if b]:
            for L, filled in CASES:
                run_case(a, R, batch, L, filled, dtype, out_path)
        R["ok"] = True
    R["wall_s"] = round(time.time() - t0, 1)
    qb.write_json(out_path, R)
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
