"""The host's time for one eager launch of quantmesh's 4-bit matmuls, on a GPU: where an eager
prefill's time goes when its kernels are short (a 7B batch-1 call spends about 0.2 s before its
first CUDA graph replay, most of it on the host: docs/benchmarks.md).

One 4096 x 4096 nf4 weight (double quant, bf16), 32 rows (the tensor-core kernel) and 1 row (the
gemv). Each path is called `--calls` times back to back without a synchronization inside, so
the loop runs at the host's pace wherever that is slower than the GPU's (the kernels take 10-25
us): the wall time a call is the host's cost of it. Paths:
- "op": the custom op (`kernel4.matmul_4bit_mma` / `matmul_4bit_gemv`), as an eager forward calls it;
- "launch": `launch_mma` / `launch_gemv` with the config looked up once: the custom op's
  dispatch left out;
- "bnb": bitsandbytes' `matmul_4bit` (dequantize + matmul at 32 rows, its gemv at 1);
- "mm": one bf16 matmul of the same shape, the floor of one aten launch.

Usage (CUDA only, from the repository root):
    python3 benchmarks/launch_host_bench.py [--calls 2000] [--out DIR]
Writes DIR/launch_host.json (default DIR: .bench/launch-host).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))  # this tree's kernels first


def _host_us(fn, calls: int) -> float:
    """Microseconds a call of `fn`, `calls` calls back to back (after 50 untimed)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(host / calls * 1e6, 2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=".bench/launch-host")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_host_bench.py needs a CUDA device")
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from quantmesh.quant import kernel4 as k4

    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    q, qs = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True, blocksize=64)
    flat = q.reshape(-1).view(torch.uint8)
    stats = k4._statistics(qs, dev)
    out: dict = {"calls": a.calls, "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__}  # fmt: skip
    with torch.no_grad():
        for rows, op, launch, config in (
            (32, k4.matmul_4bit_mma, k4.launch_mma, lambda: k4.mma_config(32, 4096, 4096)),
            (1, k4.matmul_4bit_gemv, k4.launch_gemv, lambda: k4.gemv_config(1, 4096, 4096, 64)),
        ):
            x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
            cfg = config()
            case = {
                "op": _host_us(functools.partial(op, x, q, qs), a.calls),
                "launch": _host_us(
                    functools.partial(launch, x, flat, *stats, 64, "nf4", 4096, cfg), a.calls
                ),
                "bnb": _host_us(
                    functools.partial(bnb.matmul_4bit, x, q.t(), quant_state=qs), a.calls
                ),
                "mm": _host_us(functools.partial(torch.matmul, x, w.t()), a.calls),
            }
            out[f"rows_{rows}_us_per_call"] = case
            print(rows, "rows:", json.dumps(case), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "launch_host.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
