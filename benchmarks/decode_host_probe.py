"""Where a decode step's host time goes: the 7B nf4 + LoRA shape at batch 1 (bench_decode.py's
qlora model), one process.

  1. qm.fast_decode with its step replayed by inductor's CUDA graph trees (mode
     "reduce-overhead", `step_graph.ENABLED` off): three timed runs, the host's time in each call
     of the step (no sync: the time the host spends before it can queue the next step), then one
     run under cProfile (the top functions by own time).
  2. the same with the step recorded by hand as one CUDA graph (`quantmesh.infer.step_graph`, the
     default): the same three runs, the host's time per step, the tokens' agreement with (1), and
     the recordings made.
  3. (1) again, in the process that ran (2).

A step the host launches faster than the GPU runs it costs the GPU's time alone; where the host
takes longer, the GPU waits. (The thirty-first sitting's run of this probe, in docs/benchmarks.md,
recorded a prototype in (2): the step recorded once, with no checks; `step_graph` replaced it.)

Usage: python benchmarks/decode_host_probe.py --mode qlora --out DIR   (--smoke: CPU, tiny: (1)
only, without CUDA graphs)
Writes DIR/result_decode_host.json.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import qmbench as qb  # noqa: E402


class HostClock:
    """Wraps the decoder's step: the host's time in each call."""

    def __init__(self, fn):
        self.fn = fn
        self.us: list[float] = []

    def __call__(self, *args):
        t0 = time.perf_counter()
        out = self.fn(*args)
        self.us.append((time.perf_counter() - t0) * 1e6)
        return out


def run(model, ids, a, dev, mode, R, name, ref=None, profile=True):
    import quantmesh as qm

    t0 = time.perf_counter()
    qm.fast_decode(model, ids, a.new, mode=mode)  # compiles where new
    R[f"{name}_first_s"] = round(time.perf_counter() - t0, 2)
    dec = bd.decoder(model)
    clock = HostClock(dec.run)
    dec.run = clock
    runs = []
    tokens = None
    for _ in range(3):
        clock.us.clear()
        qb.sync(dev)
        t0 = time.perf_counter()
        out = qm.fast_decode(model, ids, a.new, mode=mode)
        tokens = out[0].tolist()
        dt = time.perf_counter() - t0
        us = sorted(clock.us)
        runs.append(
            {
                "ms_per_token": round(dt / a.new * 1e3, 3),
                "new_tokens_per_s": round(a.new / dt, 1),
                "host_us_per_step_median": round(statistics.median(us), 1),
                "host_us_per_step_p90": round(us[int(0.9 * (len(us) - 1))], 1),
                "host_us_per_step_max": round(us[-1], 1),
            }
        )
        qb.log(f"{name}: {runs[-1]}")
    R[name] = {"runs": runs}
    if dec.step_graph is not None:
        R[name]["recordings"] = dec.step_graph.records
        R[name]["last_change"] = dec.step_graph.changed
    if ref is not None:
        R[name]["tokens_agree"] = bd.agree(tokens, ref)
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        qm.fast_decode(model, ids, a.new, mode=mode)
        qb.sync(dev)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        R[name]["cprofile_tottime"] = s.getvalue().splitlines()[:60]
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        R[name]["cprofile_cumulative"] = s.getvalue().splitlines()[:70]
    dec.run = clock.fn
    return tokens


def main(argv=None) -> int:
    a = bd.parse(argv)
    out_path = os.path.join(a.out, "result_decode_host.json")
    R: dict = {"bench": "decode_host", "args": vars(a), "versions": qb.versions()}
    from quantmesh.infer import step_graph

    dev, ids, model = bd.qlora_ready(a)
    cuda = dev.type == "cuda"
    mode = "reduce-overhead" if cuda else None
    on = step_graph.ENABLED
    with torch.no_grad():
        step_graph.ENABLED = False  # (a decoder's key holds the switch: each phase its own)
        ref = run(model, ids, a, dev, mode, R, "trees")
        qb.write_json(out_path, R)
        if cuda:
            step_graph.ENABLED = True
            run(model, ids, a, dev, mode, R, "step_graph", ref=ref)
            qb.write_json(out_path, R)
            step_graph.ENABLED = False
            run(model, ids, a, dev, mode, R, "trees_again", ref=ref, profile=False)
    step_graph.ENABLED = on
    qb.write_json(out_path, R)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
