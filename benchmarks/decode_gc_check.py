"""Does the compiled decode step read memory nothing keeps alive? (A check for a GPU.)

`torch.cuda.graph` runs `gc.collect()` and `torch.cuda.empty_cache()` as it starts recording, and
the 7B decode faulted ("an illegal memory access") in the compiled step right after the prefill
graphs recorded a prefill (docs/benchmarks.md, twenty-seventh sitting). If a step's CUDA graph
reads a tensor that nothing references, its memory stays mapped in the allocator's cache until an
`empty_cache()` returns it; then the next replay faults, or reads whatever took the memory.

This runs the decode path with the prefill graphs off (they are on by default) on the 7B nf4 +
LoRA shape: two calls, then (by default) `gc.collect()` and `empty_cache()`, then a third call,
and says whether the third faulted and whether its tokens are the first call's. `--layers` takes fewer layers. `--between` says what
happens between the second call and the third:

  gc        gc.collect() and torch.cuda.empty_cache() (what torch.cuda.graph does first)
  empty     torch.cuda.empty_cache() alone
  capture   a one-op CUDA graph recorded by capture_begin/capture_end, without either of them
  prefill   nothing: the third call records its prefill as a CUDA graph (prefill_graph.ENABLED)
  one       a one-token call (another cache length: a new decoder replaces the model's), then
            gc.collect() and torch.cuda.empty_cache(); the third call makes a decoder again
  prefill_one  prefill_graph.ENABLED, then the one-token call (whose prefill is recorded):
            what bench_decode.py's flag phases do before their runs

Each in its own process: a fault leaves the CUDA context unusable.

Usage (CUDA, bitsandbytes importable):
    python3 benchmarks/decode_gc_check.py [--layers 32] [--new 256] [--between gc]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))
import bench_decode as bd  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--new", type=int, default=256)  # (the one-token call: another cache length)
    p.add_argument(
        "--between",
        choices=("gc", "empty", "capture", "prefill", "one", "prefill_one"),
        default="gc",
    )
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import quantmesh as qm
    from quantmesh.infer import prefill_graph

    prefill_graph.ENABLED = False  # the path before any recorded prefill (on by default now)
    args = bd.parse(["--mode", "qlora", "--layers", str(a.layers)])
    dev, ids, model = bd.qlora_ready(args)
    R: dict = {"layers": a.layers, "new": a.new, "between": a.between}

    def call() -> torch.Tensor:
        out = qm.fast_decode(model, ids, a.new, seed=0, mode="reduce-overhead")
        torch.cuda.synchronize()
        return out.cpu()

    t0 = time.time()
    one, two = call(), call()
    R["two_calls_equal"] = bool(torch.equal(one, two))
    R["reserved_MiB_before"] = torch.cuda.memory_reserved() >> 20
    if a.between == "gc":
        gc.collect()
        torch.cuda.empty_cache()
    elif a.between == "empty":
        torch.cuda.empty_cache()
    elif a.between == "capture":  # a recording without torch.cuda.graph's gc and empty_cache
        x = torch.ones(4, device=dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            g.capture_begin()
            y = x * 2
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        R["capture_ok"] = bool(torch.equal(y, x * 2))
    elif a.between == "one":
        qm.fast_decode(model, ids, 1)
        gc.collect()
        torch.cuda.empty_cache()
    else:
        prefill_graph.ENABLED = True
        if a.between == "prefill_one":
            qm.fast_decode(model, ids, 1)
    R["reserved_MiB_after"] = torch.cuda.memory_reserved() >> 20
    graphs = dict(torch._dynamo.utils.counters["stats"])
    try:
        three = call()
        R["third_call"] = "ran"
        R["third_equals_first"] = bool(torch.equal(three, one))
    except Exception as e:  # the fault this checks for: said, not raised
        R["third_call"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    R["dynamo_stats_before_third"] = graphs
    R["dynamo_stats_after"] = dict(torch._dynamo.utils.counters["stats"])
    R["s"] = round(time.time() - t0, 1)
    print(json.dumps(R))
    return 0


if __name__ == "__main__":
    sys.exit(main())
