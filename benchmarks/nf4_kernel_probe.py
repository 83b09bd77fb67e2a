"""One call of each 4-bit kernel on the 7B q_proj shape (4096 x 4096, nf4 with double quant,
bf16; PROBE_SHAPE=OUTxIN another, e.g. 22016x4096 for gate and up joined), for a
hardware-counter profiler to read (Nsight Compute: `ncu --section SpeedOfLight ...
python benchmarks/nf4_kernel_probe.py`): bitsandbytes' 1-row kernel and its dequantize,
quantmesh's block kernel at 1 row, its gemv (the tile in the environment's GEMV_TILE, JSON, else
`gemv_config`'s) and its dequantize (PROBE_ONLY=a,b: those of these names alone). Each runs
twice (the first compiles).

    PROBE_SHAPE=22016x4096 ncu --section WarpStateStats --section InstructionStats \
        -k regex:qm_gemv python3 benchmarks/nf4_kernel_probe.py
"""

from __future__ import annotations

import json
import os
from functools import partial

import torch


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    out_f, in_f = (int(n) for n in os.environ.get("PROBE_SHAPE", "4096x4096").split("x"))
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    flat = packed.reshape(-1).view(torch.uint8)
    stats = (qs.absmax, qs.state2.absmax, qs.state2.code, qs.offset.float())
    x = torch.randn(1, in_f, device="cuda", dtype=torch.bfloat16)
    # the gemv at the tile the sweep found best (GEMV_TILE, JSON), else the library's
    gemv_tile = json.loads(os.environ.get("GEMV_TILE") or "null") or k4.gemv_config(
        1, out_f, in_f, 64
    )
    one = dict(KERNEL="blocks", BLOCK_N=16, NB=8, SPLIT_K=1, DOT=0, ROUND=0, num_warps=4,
               num_stages=3)  # fmt: skip
    calls = {
        "bnb_gemv": partial(bnb.matmul_4bit, x, packed.t(), qs),
        "bnb_dequant": partial(F.dequantize_4bit, packed, qs),
        "ours_blocks_1row": partial(k4._launch, x, flat, *stats, 64, "nf4", out_f, one),
        "ours_gemv": partial(k4.launch_gemv, x, flat, *stats, 64, "nf4", out_f, gemv_tile),
        "ours_dequant": partial(
            k4.dequantize_4bit, flat, *stats, 64, "nf4", (out_f, in_f), torch.bfloat16
        ),  # fmt: skip
    }
    only = [n for n in os.environ.get("PROBE_ONLY", "").split(",") if n]
    if unknown := sorted(set(only) - set(calls)):
        raise SystemExit(f"PROBE_ONLY names {unknown}; the calls are {sorted(calls)}")
    with torch.no_grad():
        for name, fn in calls.items():
            if only and name not in only:
                continue
            for _ in range(2):
                torch.cuda.nvtx.range_push(name)
                fn()
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(name, "ran")


if __name__ == "__main__":
    main()
