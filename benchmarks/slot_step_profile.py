"""Where a slot-engine decode step's time goes: the step through `SlotBatch.execute` (as the server
runs it, reading each step's greedy tokens back) against the compiled step's replays alone, and a
torch.profiler table of its GPU kernels, at 1 row and at --batch rows.

The model is `bench_serve.py`'s (random weights, a word-level tokenizer, N random r16 adapters,
built once under --models), loaded as `quantmesh serve` loads it (nf4 base, the bank in bf16), no
HTTP server: the difference between the two timings is the host's time per step.

Usage (one GPU):
    python benchmarks/slot_step_profile.py --batch 64 --cuda-graphs captured --out DIR
    python benchmarks/slot_step_profile.py --batch 64 --cuda-graphs none --out DIR  # ops named
    python benchmarks/slot_step_profile.py --shape 7b4 ...    # 7b's layers, 4 of them: quicker
    python benchmarks/slot_step_profile.py --smoke --out DIR       # tiny, CPU: checks the script
    python benchmarks/slot_step_profile.py --prefill --out DIR     # the eager prefill instead
Writes DIR/slot_step_<cuda graphs>.json and DIR/slot_step_<cuda graphs>_b<rows>.txt (the tables).

--prefill: where a prefill's time goes (no compiled step, no warm-up): 1, 8 and --batch - 1
rows of 32-token prompts (mixed adapters) prefilled through `execute` and dropped again, the
median wall time of 5 against the GPU time torch.profiler sees, with tables of the host's ops
and of the GPU's kernels: DIR/slot_prefill[_dense].json and DIR/slot_prefill[_dense]_r<rows>.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
import qmbench as qb  # noqa: E402

import quantmesh as qm  # noqa: E402
from quantmesh.config import CUDA_GRAPHS  # noqa: E402
from quantmesh.serve.bank import AdapterBank  # noqa: E402
from quantmesh.serve.engine import Admit, Plan, autocast_dtype  # noqa: E402
from quantmesh.serve.slots import SlotBatch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="the second measurement's rows")
    p.add_argument("--cuda-graphs", default=CUDA_GRAPHS[0], choices=(*CUDA_GRAPHS, "none"),
                   help="captured, trees, or none: the compiled step without CUDA graphs, whose "
                   "profile names the op (and input shapes) behind every kernel")  # fmt: skip
    p.add_argument("--shape", default="7b", choices=sorted(bench_serve.SHAPES),
                   help="bench_serve.py's model shape (7b4: 7b's layers, 4 of them)")  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--models", default=".bench/models")
    p.add_argument("--out", default=".bench/slot-step")
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--keep-dequantized",
        action="store_true",
        help="hold the 4-bit weights dequantized too (serve --keep-dequantized)",
    )
    p.add_argument("--prefill", action="store_true", help="profile the eager prefill instead")
    a = p.parse_args(argv)
    shape = bench_serve.parse(["--smoke"] if a.smoke else ["--shape", a.shape, "--quant", "nf4"])
    folder, adapters = bench_serve.build_model(shape, Path(a.models))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"cuda_graphs": a.cuda_graphs, "batch": a.batch, "shape": shape.shape}
    dense = "_dense" if a.keep_dequantized else ""
    path = out / (
        f"slot_prefill{dense}.json" if a.prefill else f"slot_step_{a.cuda_graphs}{dense}.json"
    )

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))

    t0 = time.perf_counter()
    mesh = qm.init_mesh(tp=1)
    dev = mesh.device
    model = qm.from_pretrained(
        str(folder), mesh, quant=None if a.smoke else "nf4", progress=False,
        lora=qm.LoraConfig(r=shape.rank, targets=bench_serve.TARGETS),
        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
    ).eval()  # fmt: skip
    if a.keep_dequantized:
        from quantmesh.parallel.held import keep_dequantized
        from quantmesh.tp.layers import sharded_modules

        layers = [m.local for m in sharded_modules(model).values()]
        res["dequantized_gib"] = keep_dequantized(layers, torch.bfloat16) / 2**30
    bank = AdapterBank(model, slots=len(adapters) + 1, dtype=autocast_dtype(dev))
    for i, ad in enumerate(adapters):
        bank.load(i + 1, str(ad))
    res["load_s"] = time.perf_counter() - t0
    b_max = 4 if a.smoke else a.batch
    if a.prefill:
        res.update(_prefills(model, bank, b_max, len(adapters), out, dense))
        save()
        print(json.dumps({k: v for k, v in res.items() if "top" not in k}, indent=1))
        return 0
    # none: the graph-trees path without its mode, i.e. inductor with no CUDA graphs at all
    how = (
        {"graphs": "trees", "mode": None} if a.cuda_graphs == "none" else {"graphs": a.cuda_graphs}
    )
    batch = SlotBatch(model, bank, max_batch=b_max, max_len=1024, ladder=(1, b_max), **how)
    t0 = time.perf_counter()
    batch.warm_up(print)
    res["warm_up_s"] = time.perf_counter() - t0
    save()
    g = torch.Generator().manual_seed(0)
    state: dict = {"order": [], "last": {}}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(plan: Plan) -> None:
        s, pre, _ = batch.execute(plan)
        rows = (list(s) if s is not None else []) + pre
        state["order"] = state["order"] + [x.rid for x in plan.admit]
        state["last"] = dict(zip(state["order"], [int(r.argmax()) for r in rows], strict=True))

    def steps(n: int) -> float:  # ms per step through execute, each reading its tokens back
        t = time.perf_counter()
        for _ in range(n):
            feed = batch.feed_tokens([state["last"][r] for r in state["order"]])
            run(Plan(order=list(state["order"]), feed=feed))
        sync()
        return (time.perf_counter() - t) / n * 1e3

    def replays(n: int, b: int) -> float:  # ms per compiled step alone, back to back
        with batch._running():
            batch.lo, batch.b, batch.le = 0, b, 256
            sync()
            t = time.perf_counter()
            for _ in range(n):
                batch.run()
            sync()
        return (time.perf_counter() - t) / n * 1e3

    def profile(n: int, tag: str) -> None:
        if dev.type != "cuda":
            return
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with torch_profile(activities=acts, record_shapes=True) as prof:
            steps(n)
        ka = prof.key_averages()
        top = sorted(((e.key, e.device_time_total / n, e.count / n) for e in ka
                      if e.device_time_total > 0), key=lambda x: -x[1])[:30]  # fmt: skip
        res[f"profile_{tag}"] = {
            "gpu_us_per_step": sum(e.self_device_time_total for e in ka if qb.is_kernel(e)) / n,
            "top": top,
        }  # fmt: skip
        table = ka.table(sort_by="self_device_time_total", row_limit=40)
        # by op and input shapes: names the matmul behind a kernel where no graph hides it
        shapes = prof.key_averages(group_by_input_shape=True).table(
            sort_by="device_time_total", row_limit=40
        )
        (out / f"slot_step_{a.cuda_graphs}{dense}_{tag}.txt").write_text(table + "\n\n" + shapes)

    def prompt() -> list[int]:
        return torch.randint(10, 1000, (32,), generator=g).tolist()

    with torch.no_grad():
        run(Plan(admit=[Admit(0, prompt(), 1)]))
        steps(4)
        res["b1_execute_ms"] = steps(a.steps)
        res["b1_replay_ms"] = replays(a.steps, 1)
        save()
        profile(10, "b1")
        save()
        if b_max > 1:
            adm = [Admit(i, prompt(), 1 + i % len(adapters)) for i in range(1, b_max)]
            last = state["last"]
            t0 = time.perf_counter()
            feed = batch.feed_tokens([last[r] for r in state["order"]])
            run(Plan(order=list(state["order"]), feed=feed, admit=adm))
            sync()
            res[f"prefill_{b_max - 1}_rows_ms"] = (time.perf_counter() - t0) * 1e3
            steps(3)
            res[f"b{b_max}_execute_ms"] = steps(max(4, a.steps // 2))
            res[f"b{b_max}_replay_ms"] = replays(max(4, a.steps // 2), b_max)
            save()
            profile(5, f"b{b_max}")
    save()
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("profile_")}, indent=1))
    return 0


def _prefills(model, bank, b_max: int, n_adapters: int, out: Path, dense: str) -> dict:
    """The eager prefill of 1, 8 and b_max - 1 rows of 32 tokens: median wall ms of 5 (each
    prefilled through `execute`, then dropped), and one profiled: GPU time against wall time,
    the host's top ops by their own time, the GPU's top kernels."""
    dev = bank.device
    batch = SlotBatch(model, bank, max_batch=b_max, max_len=1024, compile=False)
    g = torch.Generator().manual_seed(0)
    res: dict = {}
    rid = [0]

    def once(rows: int) -> float:
        adm = []
        for i in range(rows):
            ids = torch.randint(10, 1000, (32,), generator=g).tolist()
            adm.append(Admit(rid[0], ids, 1 + i % n_adapters))
            rid[0] += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        batch.execute(Plan(admit=adm))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        batch.execute(Plan(drop=[x.rid for x in adm]))
        return ms

    with torch.no_grad():
        for rows in sorted({1, min(8, b_max - 1), b_max - 1}):
            once(rows)  # cuBLAS and cuDNN choose their kernels for this shape
            res[f"prefill_{rows}_rows_ms"] = sorted(once(rows) for _ in range(5))[2]
            if dev.type != "cuda":
                continue
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                wall = once(rows)
            ka = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in ka if qb.is_kernel(e)) / 1e3
            res[f"prefill_{rows}_rows_profiled"] = {
                "wall_ms": wall, "gpu_ms": gpu, "launches": sum(
                    e.count for e in ka if e.key.startswith(("cudaLaunchKernel", "cuLaunch"))),
                "top_gpu": sorted(((e.key[:80], e.self_device_time_total / 1e3) for e in ka
                                   if e.self_device_time_total > 0), key=lambda x: -x[1])[:12],
                "top_host": sorted(((e.key[:80], e.self_cpu_time_total / 1e3) for e in ka),
                                   key=lambda x: -x[1])[:15],
            }  # fmt: skip
            tables = (ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n"
                      + ka.table(sort_by="self_device_time_total", row_limit=25))  # fmt: skip
            (out / f"slot_prefill{dense}_r{rows}.txt").write_text(tables)
    return res


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast

    exit_fast(main)
