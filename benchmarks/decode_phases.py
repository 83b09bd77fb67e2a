"""Where a decode call's time goes outside its replayed steps: the 7B nf4 + LoRA shape at batch 1
(bench_decode.py's qlora model), one process.

A call of `qm.fast_decode` is the prefill (the prompt's forward), the first step (the compiled
function run from the host, which checks the step's recording), then replays of the recorded
step. New tokens/s counts the whole call, so a fixed cost per call weighs on a 256-token reply as
much as its steps' speed does. This probe times each part of three warm calls: the prefill and
the first step each between two synchronizations, the rest as the call's time less those. Then,
with `--check-phase`, the same with `step_graph.CHECK_REPLAYS` flipped (a call's first step
checks the recording without launching the step; read at each call, so no recompile), with
`--compiled-prefill`, the same with the prefill compiled (`decode.PREFILL_COMPILED`, opt-in:
its compile time is reported as the first call's), and with `--graphs-phase` with the prefill
graphs (`prefill_graph.ENABLED`, on by default) flipped; with `--release-phase` then with the
recordings dropped, the allocator's cached memory given back and the prefills eager.
`--neighbor-phase` (CUDA) records a graph of 700 tiny kernels that the decoder never reads, times
the calls while it is kept, then after it is released. `--side-phase` (CUDA), right after the
defaults: the prompt's forward run once on a side stream (as the prefill graphs' warm-up ran it
until the forty-third sitting; nothing recorded), then the calls timed. With any phase, the
defaults are timed again at the end. Last, the eager prefill of one call under cProfile (the
prefill graphs off for it): its top functions by own and by cumulative time.

Usage: python benchmarks/decode_phases.py --mode qlora --out DIR [--check-phase] [--compiled-prefill]
[--graphs-phase [--release-phase]] [--neighbor-phase] [--side-phase] [--profile-prefill]
(--smoke: CPU, tiny; no CUDA graphs)
Writes DIR/result_decode_phases.json.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
import qmbench as qb  # noqa: E402


class Phases:
    """Wraps a decoder's prefill and step: the prefill's time and the first step's of each call,
    each between two synchronizations (the rest of the call is not synchronized)."""

    def __init__(self, dec, dev: torch.device) -> None:
        self.dec, self.dev = dec, dev
        self.prefill, self.run, self.begin = dec.prefill, dec.run, dec.begin
        self.prefill_ms: list[float] = []
        self.first_ms: list[float] = []
        self.first = False
        self.host_run_s = 0.0  # host time inside the replayed steps' calls (not synchronized)
        self.host_runs = 0
        self.profile: cProfile.Profile | None = None
        dec.prefill, dec.run, dec.begin = self._prefill, self._run, self._begin

    def _prefill(self, *args, **kw):
        qb.sync(self.dev)
        t0 = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        out = self.prefill(*args, **kw)
        qb.sync(self.dev)
        if self.profile is not None:
            self.profile.disable()
        self.prefill_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def _begin(self):
        self.first = True
        return self.begin()

    def _run(self, *args):
        if not self.first:
            t0 = time.perf_counter()
            out = self.run(*args)
            self.host_run_s += time.perf_counter() - t0
            self.host_runs += 1
            return out
        self.first = False
        qb.sync(self.dev)
        t0 = time.perf_counter()
        out = self.run(*args)
        qb.sync(self.dev)
        self.first_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def undo(self) -> None:
        self.dec.prefill, self.dec.run, self.dec.begin = self.prefill, self.run, self.begin


def timed_calls(model, ids, a, dev, mode, R: dict, name: str, runs: int = 3) -> list[int]:
    """A first call (it compiles where new), then `runs` timed calls split into their phases."""
    import quantmesh as qm

    t0 = time.perf_counter()
    qm.fast_decode(model, ids, a.new, mode=mode)
    first_s = time.perf_counter() - t0
    ph = Phases(bd.decoder(model), dev)
    rows, tokens = [], []
    try:
        for _ in range(runs):
            qb.sync(dev)
            t0 = time.perf_counter()
            out = qm.fast_decode(model, ids, a.new, mode=mode)
            tokens = out[0].tolist()
            ms = (time.perf_counter() - t0) * 1e3
            pre, first = ph.prefill_ms[-1], ph.first_ms[-1] if ph.first_ms else 0.0
            rest = ms - pre - first
            steps = max(1, a.new - 2)  # the replays (the last token's step included)
            rows.append(
                {
                    "call_ms": round(ms, 2),
                    "new_tokens_per_s": round(a.new / ms * 1e3, 1),
                    "prefill_ms": round(pre, 2),
                    "first_step_ms": round(first, 2),
                    "rest_ms": round(rest, 2),
                    "rest_ms_per_step": round(rest / steps, 4),
                    "fixed_share": round((pre + first) / ms, 4),
                    "new_tokens_per_s_without_fixed": round((a.new - 1) / rest * 1e3, 1),
                }
            )
            qb.log(f"{name}: {rows[-1]}")
        if a.profile_prefill:
            from quantmesh.infer import prefill_graph

            ph.profile = cProfile.Profile()
            with qb.switched(prefill_graph, "ENABLED", False):  # the eager prefill
                qm.fast_decode(model, ids, a.new, mode=mode)  # (only its prefill is profiled)
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(ph.profile, stream=s).sort_stats(key).print_stats(35)
                R.setdefault(name + "_prefill_cprofile", {})[key] = s.getvalue().splitlines()[:75]
    finally:
        ph.undo()
    state = step_state(model, ph)
    R[name] = {"first_call_s": round(first_s, 2), "runs": rows, **state}
    qb.log(f"{name}: {state}")
    return tokens


def step_state(model, ph: Phases) -> dict:
    """What a phase left: the decoder's step recordings so far, dynamo's compiled graphs, graph
    breaks and recompiles so far, and the host's time inside a replayed step's call (the GPU
    idles between steps only where that nears a step's GPU time)."""
    from torch._dynamo.utils import counters

    sg = getattr(bd.decoder(model), "step_graph", None)
    return {
        "step_records": None if sg is None else sg.records,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
        "host_run_us_per_step": round(ph.host_run_s / max(1, ph.host_runs) * 1e6, 1),
    }


def neighbor_graph(dev: torch.device, kernels: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `kernels` tiny kernels (an add each on a buffer of 1,024 floats that nothing
    else reads), recorded as the prefill graphs were until the forty-third sitting (a warm-up on a
    side stream, then the capture in a private pool), replayed once and returned: kept alive by
    the caller.

    Example:
        >>> g = neighbor_graph(torch.device("cuda"), 700)  # doctest: +SKIP
    """
    buf = torch.zeros(1024, device=dev)
    on_side_stream(lambda: buf.add_(1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            buf.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    graph.buf = buf  # type: ignore[attr-defined]  # (kept with the graph)
    return graph


def on_side_stream(fn) -> None:
    """`fn()` run on a fresh side stream, ordered after the current stream's work and before its
    next (as a recording's warm-up on a side stream runs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


def released(dev: torch.device) -> None:
    """Python's collector run and the allocator's cached blocks given back."""
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    extra = {"--compiled-prefill": "compiled_prefill", "--graphs-phase": "graphs_phase",
             "--profile-prefill": "profile_prefill", "--check-phase": "check_phase",
             "--neighbor-phase": "neighbor_phase", "--release-phase": "release_phase",
             "--side-phase": "side_phase"}  # fmt: skip
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {v: k in argv for k, v in extra.items()}
    argv = [x for x in argv if x not in extra]
    a = bd.parse(argv)
    for k, v in flags.items():
        setattr(a, k, v)
    out_path = os.path.join(a.out, "result_decode_phases.json")
    R: dict = {"bench": "decode_phases", "args": vars(a), "versions": qb.versions()}
    from quantmesh.infer import decode, prefill_graph, step_graph

    dev, ids, model = bd.qlora_ready(a)
    mode = "reduce-overhead" if dev.type == "cuda" else None
    R["prefill_compiled_at_start"] = decode.PREFILL_COMPILED
    R["prefill_graphs_at_start"] = prefill_graph.ENABLED
    R["check_replays_at_start"] = step_graph.CHECK_REPLAYS
    with torch.no_grad():
        ref = timed_calls(model, ids, a, dev, mode, R, "defaults")
        qb.write_json(out_path, R)
        if a.side_phase and dev.type == "cuda":
            # the prompt's forward once on a side stream (no cache, nothing recorded), as a
            # prefill graph's warm-up runs it: do the steps slow down after it alone?
            on_side_stream(lambda: model(input_ids=ids, use_cache=False))
            torch.cuda.synchronize()
            with qb.record_errors(R, "side_stream_forward_error"):
                timed_calls(model, ids, a, dev, mode, R, "side_stream_forward")
            qb.write_json(out_path, R)
        for want, module, flag, name in (
            (a.check_phase, step_graph, "CHECK_REPLAYS", "check_replays"),
            (a.compiled_prefill, decode, "PREFILL_COMPILED", "compiled_prefill"),
            (a.graphs_phase, prefill_graph, "ENABLED", "prefill_graphs"),
        ):
            if not want:
                continue
            before = getattr(module, flag)
            phase = f"no_{name}" if before else name
            with qb.switched(module, flag, not before), qb.record_errors(R, f"{name}_error"):
                got = timed_calls(model, ids, a, dev, mode, R, phase)
                R[phase]["tokens_agree"] = bd.agree(got, ref)
            if name == "prefill_graphs" and a.release_phase:
                # the decoder's recorded prefills dropped and their memory given back, the
                # prefills eager: do the steps of this process run as they did without the
                # recordings? (whichever phase recorded them: the defaults, or the flipped one)
                graphs = bd.decoder(model).graphs
                if graphs is not None:
                    graphs.entries.clear()
                released(dev)
                with (
                    qb.switched(prefill_graph, "ENABLED", False),
                    qb.record_errors(R, "prefill_graphs_released_error"),
                ):
                    timed_calls(model, ids, a, dev, mode, R, "prefill_graphs_released")
            qb.write_json(out_path, R)
        if a.neighbor_phase and dev.type == "cuda":
            # a CUDA graph of 700 tiny kernels (about a step's count) that the decoder never
            # reads, kept, then released: does another recorded graph slow the step's replays?
            graph = neighbor_graph(dev, 700)
            with qb.record_errors(R, "neighbor_graph_kept_error"):
                timed_calls(model, ids, a, dev, mode, R, "neighbor_graph_kept")
            graph.reset()
            del graph
            released(dev)
            with qb.record_errors(R, "neighbor_graph_released_error"):
                timed_calls(model, ids, a, dev, mode, R, "neighbor_graph_released")
            qb.write_json(out_path, R)
        if any(flags.values()):
            timed_calls(model, ids, a, dev, mode, R, "defaults_again")
    qb.write_json(out_path, R)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
