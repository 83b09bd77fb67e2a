"""Bundle benchmark results and turn them into the markdown tables of docs/benchmarks.md.

    python benchmarks/summarize.py --bundle WORK_DIR --json results.json --md summary.md
        collect WORK_DIR/*.json and WORK_DIR/steps.jsonl (what run_gpu.sh leaves) into one JSON
    python benchmarks/summarize.py results.json [more.json ...] > tables.md
        merge bundles (e.g. of two GPU calls) and print the tables

Ratios are quantmesh / peer from the same bundle (the same machine, the same call). Nothing here
imports torch: it runs anywhere.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

TARGETS = {
    "tp2_vs_D": 1.8,
    "dp2_vs_E": 1.1,
    "mfu": 0.45,
    "mem_vs_estimate": 0.10,
    "load_vs_read": 0.70,
    "decode_tp2_vs_single": 1.3,
}


# ---- bundling ------------------------------------------------------------------------------------
def bundle(work: str) -> dict:
    out: dict = {"steps": [], "files": {}}
    steps = os.path.join(work, "steps.jsonl")
    if os.path.exists(steps):
        with open(steps) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out["steps"].append(json.loads(line))
                    except json.JSONDecodeError:
                        out["steps"].append({"raw": line})
    for path in sorted(glob.glob(os.path.join(work, "*.json"))):
        try:
            with open(path) as f:
                out["files"][os.path.basename(path)] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            out["files"][os.path.basename(path)] = {"unreadable": str(e)}
    return out


def merge(bundles: list[dict]) -> dict:
    out: dict = {"steps": [], "files": {}}
    for b in bundles:
        out["steps"] += b.get("steps", [])
        out["files"].update(b.get("files", {}))
    return out


# ---- formatting helpers --------------------------------------------------------------------------
def num(x, fmt="{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def ratio(a, b) -> float | None:
    return None if not a or not b else a / b


def verdict(value, target, higher_is_better=True) -> str:
    if value is None:
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "NOT met"


def mem_cols(rec: dict) -> tuple[str, str]:
    """'peak alloc' and 'peak reserved' GiB per GPU, as 'a / b' over ranks or devices."""
    mem = rec.get("mem") or {}
    alloc = [m.get("peak_alloc_GiB") for m in mem.values() if isinstance(m, dict)]
    res = [m.get("peak_reserved_GiB") for m in mem.values() if isinstance(m, dict)]
    f = lambda xs: " / ".join(f"{x:.1f}" for x in xs if x is not None) or "–"  # noqa: E731
    return f(alloc), f(res)


def max_alloc(rec: dict) -> float | None:
    vals = [m.get("peak_alloc_GiB") for m in (rec.get("mem") or {}).values() if isinstance(m, dict)]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def mfu(rec: dict, peak: dict | None, kind="burst") -> float | None:
    if rec.get(f"mfu_vs_{kind}") is not None:
        return rec[f"mfu_vs_{kind}"]
    tf = (peak or {}).get(f"{kind}_tflops")
    tok, fpt, gpus = rec.get("tokens_per_s"), rec.get("flops_per_token"), rec.get("gpus")
    if not (tf and tok and fpt and gpus):
        return None
    return tok * fpt / (gpus * tf * 1e12)


# ---- finding records ----------------------------------------------------------------------------
def find(files: dict, pred) -> dict | None:
    hits = [v for v in files.values() if isinstance(v, dict) and pred(v)]
    return hits[-1] if hits else None


def peer(files: dict, config: str) -> dict | None:
    return find(files, lambda r: r.get("config") == config and "tokens_per_s" in r or (
        r.get("config") == config and r.get("ok") is False))  # fmt: skip


def qm_train(files: dict, tp: int, dp: int, compiled: bool = False) -> dict | None:
    return find(
        files,
        lambda r: (
            r.get("bench") == "train"
            and r.get("tp") == tp
            and r.get("dp") == dp
            and bool(r.get("compiled")) == compiled
            and r.get("pp", 1) == 1
        ),
    )


def qm_pipelines(files: dict) -> list[dict]:
    """bench_train.py records at pp > 1 (qm.train_step schedules), by schedule and micro-batches."""
    recs = [
        v
        for v in files.values()
        if isinstance(v, dict) and v.get("bench") == "train" and v.get("pp", 1) > 1
    ]
    return sorted(recs, key=lambda r: (r.get("pp_schedule", ""), r.get("microbatches", 1)))


# ---- tables --------------------------------------------------------------------------------------
def tables(b: dict) -> str:
    files = b["files"]
    env = files.get("env.json") or {}
    peak_rec = files.get("matmul_peak.json") or {}
    peak = peak_rec.get("summary")
    L: list[str] = []
    v = env.get("versions") or {}
    L.append("### Machine and software (from the run)\n")
    if env:
        L.append(f"- GPUs: {(env.get('gpus') or '–').replace(chr(10), '; ')}")
        L.append(
            "- "
            + ", ".join(
                f"{k} {v.get(k)}"
                for k in (
                    "torch",
                    "cuda",
                    "nccl",
                    "transformers",
                    "peft",
                    "bitsandbytes",
                    "accelerate",
                    "python",
                )
                if v.get(k)
            )  # fmt: skip
        )
    else:
        L.append("- not yet run")
    if peak:
        L.append(
            f"- bf16 {peak_rec.get('n')}^3 matmul: {peak['burst_tflops']} TFLOP/s burst, "
            f"{peak['sustained_tflops']} sustained (mean over GPUs)"
        )
    L.append("")

    # training
    D, E = peer(files, "D"), peer(files, "E")
    T2, P2 = qm_train(files, 2, 1), qm_train(files, 1, 2)
    T2c, P2c = qm_train(files, 2, 1, True), qm_train(files, 1, 2, True)
    L.append("### Training throughput (same call, same micro-batch)\n")
    L.append(
        "| system | layout | GPUs | micro-batch | tokens/s (job) | tokens/s/GPU | "
        "peak alloc GiB/GPU | peak reserved GiB/GPU | MFU (burst) | MFU (sustained) |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    PP = qm_pipelines(files)
    rows = [
        ("peer D: accelerate layer split, NF4 + peft LoRA", "2-GPU layer split", D),
        ("quantmesh", "tp=2 nf4 + LoRA", T2),
        *[
            (
                "quantmesh, pipeline",
                f"pp={r['pp']} {r.get('pp_schedule')} M={r.get('microbatches')} nf4 + LoRA"
                f" (bubble {pct(r.get('bubble_theory'))} in theory)",
                r,
            )
            for r in PP
        ],
        ("quantmesh, compiled blocks", "tp=2 nf4 + LoRA", T2c),
        ("peer E: DDP of peft + bnb NF4", "dp=2 (torchrun)", E),
        ("quantmesh", "dp=2 nf4 + LoRA", P2),
        ("quantmesh, compiled blocks", "dp=2 nf4 + LoRA", P2c),
    ]
    for name, layout, r in rows:
        if r is None and "compiled" in name:
            continue
        if r is None:
            L.append(f"| {name} | {layout} | 2 | – | not yet run | | | | | |")
            continue
        if not r.get("ok", True) or r.get("tokens_per_s") is None:
            err = (r.get("error") or "failed")[:80].replace("|", "/")
            L.append(f"| {name} | {layout} | 2 | {r.get('mb', '–')} | failed: {err} | | | | | |")
            continue
        a, res = mem_cols(r)
        mb = r.get("mb", (r.get("args") or {}).get("mb"))
        L.append(
            f"| {name} | {layout} | {r.get('gpus', 2)} | {mb} | {num(r['tokens_per_s'])} | "
            f"{num(r.get('tokens_per_s_per_gpu'))} | {a} | {res} | {pct(mfu(r, peak))} | "
            f"{pct(mfu(r, peak, 'sustained'))} |"
        )
    L.append("")

    def best_ratio(recs, peer_rec):
        rs = [
            ratio((r or {}).get("tokens_per_s"), (peer_rec or {}).get("tokens_per_s")) for r in recs
        ]
        shown = (
            " / ".join(num(x, "{:.2f}x") for x, r in zip(rs, recs, strict=True) if r is not None)
            or "–"
        )
        return max([x for x in rs if x is not None], default=None), shown

    t2d, t2d_s = best_ratio([T2, T2c], D)
    p2e, p2e_s = best_ratio([P2, P2c], E)
    best = max(
        [x for r in (T2, T2c, P2, P2c) if (x := mfu(r or {}, peak)) is not None], default=None
    )
    both = " (eager / compiled blocks)" if (T2c or P2c) else ""
    L.append(f"| target | measured{both} | verdict |")
    L.append("|---|---|---|")
    L.append(f"| tp=2 nf4+LoRA >= 1.8x peer D | {t2d_s} | {verdict(t2d, 1.8)} |")
    L.append(f"| dp=2 nf4+LoRA >= 1.1x peer E | {p2e_s} | {verdict(p2e, 1.1)} |")
    for r in PP:
        if r.get("pp") == 2 and r.get("pp_schedule") == "1f1b" and r.get("microbatches") == 8:
            x = ratio(r.get("tokens_per_s"), (D or {}).get("tokens_per_s"))
            L.append(
                f"| pp=2 1F1B M=8 nf4+LoRA >= 1.7x peer D (same global batch: mb "
                f"{(r.get('args') or {}).get('mb')} vs {(D or {}).get('mb', '–')}) | "
                f"{num(x, '{:.2f}x')} | {verdict(x, 1.7)} |"
            )
    L.append(
        f"| MFU of the best 2-GPU layout >= 45% (vs burst peak) | {pct(best)} | "
        f"{verdict(best, 0.45)} |"
    )
    L.append("")

    # memory vs estimate
    L.append("### Peak memory against `quantmesh plan`'s estimate\n")
    L.append("| layout | estimate GiB/GPU | peak alloc GiB (max over GPUs) | deviation | verdict |")
    L.append("|---|---|---|---|---|")
    mem_rows = [("tp=2 nf4 + LoRA", T2), ("dp=2 nf4 + LoRA", P2)]
    mem_rows += [(f"{n}, compiled blocks", r) for n, r in (("tp=2", T2c), ("dp=2", P2c)) if r]
    for layout, r in mem_rows:
        est = ((r or {}).get("memory_estimate") or {}).get("total_GiB")
        got = max_alloc(r or {})
        dev = None if not (est and got) else abs(got - est) / est
        if r is None:
            L.append(f"| {layout} | not yet run | | | |")
        else:
            why = ((r or {}).get("memory_estimate") or {}).get("error")
            L.append(
                f"| {layout} | {num(est, '{:.1f}') if est else why or '–'} | {num(got, '{:.1f}')} "
                f"| {pct(dev)} | {verdict(dev, 0.10, higher_is_better=False)} |"
            )
    L.append("")

    # loss check
    L.append("### NCCL losses against the CPU fp32 reference (small model, same call)\n")
    L.append("| layout | mesh losses | CPU fp32 losses | max rel. diff | tolerance | verdict |")
    L.append("|---|---|---|---|---|---|")
    for layout, r in mem_rows:
        c = (r or {}).get("check")
        if not c:
            L.append(f"| {layout} | not yet run | | | | |")
        elif "error" in c:
            L.append(f"| {layout} | error: {c['error'][:80]} | | | | |")
        else:
            L.append(
                f"| {layout} | {c.get('mesh_losses')} | {c.get('cpu_fp32_losses')} | "
                f"{c.get('max_rel_diff')} | {c.get('tol')} | "
                f"{'passed' if c.get('passed') else 'FAILED'} |"
            )
    L.append("")

    # variants and profile
    if T2 and T2.get("variants"):
        base = T2.get("tokens_per_s")
        L.append("### Prototype speed-ups on tp=2 (same model, same call)\n")
        L.append("| variant | tokens/s | vs main run | peak alloc GiB/GPU |")
        L.append("|---|---|---|---|")
        for name, V in T2["variants"].items():
            if "tokens_per_s" not in V:
                why = V.get("skipped") or V.get("error", "–")
                L.append(f"| {name} | {why[:80]} | | |")
                continue
            rel = num(ratio(V["tokens_per_s"], base), "{:.3f}x")
            L.append(f"| {name} | {num(V['tokens_per_s'])} | {rel} | {mem_cols(V)[0]} |")
        L.append("")
    named = (("tp=2", T2), ("tp=2 compiled", T2c), ("dp=2", P2), ("dp=2 compiled", P2c))
    prof = [(n, r.get("profile")) for n, r in named if r and r.get("profile")]
    if prof:
        L.append("### Where the GPU time goes (2 profiled steps, rank 0, share of kernel time)\n")
        cats = list(next((p["shares"] for _, p in prof if "shares" in p), {}))
        L.append("| layout | wall ms/step | kernel ms/step | " + " | ".join(cats) + " |")
        L.append("|---|---|---|" + "---|" * len(cats))
        for n, p in prof:
            if "shares" not in p:
                L.append(f"| {n} | error: {str(p.get('error'))[:80]} |")
                continue
            sh = p["shares"]
            L.append(
                f"| {n} | {p.get('wall_ms_per_step')} | {p.get('timed_ms_per_step')} | "
                + " | ".join(pct(sh.get(c)) for c in cats)
                + " |"
            )
        L.append("")

    coll = [(n, r["tp_collectives_per_step"]) for n, r in (("tp=2", T2), ("dp=2", P2))
            if r and r.get("tp_collectives_per_step")]  # fmt: skip
    if coll:
        L.append(
            "### quantmesh's tp collectives in one training step (rank 0, forward + backward)\n"
        )
        L.append("| layout | collective | calls | MB |")
        L.append("|---|---|---|---|")
        for n, c in coll:
            for op, x in c.items():
                if isinstance(x, dict):
                    L.append(f"| {n} | {op} | {x.get('calls')} | {x.get('MB')} |")
        L.append("")

    # decode
    S = find(files, lambda r: r.get("bench") == "decode" and r.get("mode") == "single")
    TP = find(files, lambda r: r.get("bench") == "decode" and r.get("mode") == "tp")
    L.append("### Decoding, bf16, batch 1, 32-token prompt, 256 new tokens, greedy\n")
    L.append("| setup | GPUs | new tokens/s | ms/token | warm-up generate s | peak alloc GiB |")
    L.append("|---|---|---|---|---|---|")
    for name, r, key, g in (
        ("transformers generate (dynamic cache)", S, "dynamic_cache", 1),
        ("transformers generate, static cache + torch.compile", S, "static_compile", 1),
        ("quantmesh tp=2, transformers generate (dynamic cache)", TP, "dynamic_cache", 2),
        ("quantmesh tp=2, static cache + torch.compile", TP, "static_compile", 2),
        ("quantmesh tp=2, qm.greedy_decode (CUDA graphs, no per-token read-back)", TP,
         "qm_greedy", 2),
        ("reference, not the peer: qm.greedy_decode on one GPU", S, "qm_greedy", 1),
    ):  # fmt: skip
        x = (r or {}).get(key)
        if x is None and key == "qm_greedy" and not (r or {}).get("qm_greedy_error"):
            continue
        if x is None:
            err = (
                (r or {}).get("error")
                or (r or {}).get(f"{key}_error")
                or (r or {}).get("static_compile_error")
            )
            L.append(
                f"| {name} | {g} | {('failed: ' + err[:80]) if err else 'not yet run'} | | | |"
            )
            continue
        L.append(
            f"| {name} | {g} | {num(x['new_tokens_per_s'], '{:.1f}')} | {x['ms_per_token']} | "
            f"{x['warmup_generate_s']} | {(x.get('mem') or {}).get('peak_alloc_GiB', '–')} |"
        )
    dr = ratio((TP or {}).get("best_new_tokens_per_s"), (S or {}).get("best_new_tokens_per_s"))
    agree = (TP or {}).get("tokens_agree_with_single")
    g_agree = ((TP or {}).get("qm_greedy") or {}).get("tokens_agree_with_dynamic")
    n_tok = len((TP or {}).get("tokens") or [])
    L.append("")
    L.append(
        f"tp=2 best / one GPU best: {num(dr, '{:.2f}x')} (target >= 1.3x: {verdict(dr, 1.3)}); "
        f"leading tokens equal to one GPU's: {num(agree, '{}')} of {n_tok or '–'}."
        + (
            f" qm.greedy_decode's tokens equal tp=2 generate's for the first {g_agree}."
            if g_agree is not None
            else ""
        )
    )
    L.append("")

    # load
    LD = find(files, lambda r: r.get("bench") == "load")
    L.append("### Loading a 7B-shaped bf16 safetensors checkpoint into tp=2 nf4\n")
    if LD is None:
        L.append("not yet run\n")
    elif not LD.get("ok"):
        L.append(f"failed: {str(LD.get('error'))[:300]}\n")
    else:
        gb = LD.get("checkpoint_bytes", 0) / 1e9
        L.append("| quantity | value |")
        L.append("|---|---|")
        L.append(f"| checkpoint | {gb:.2f} GB in {LD.get('files')} files ({LD.get('fs_type')}) |")
        L.append(f"| page cache dropped | {LD.get('drop_caches')} |")
        L.append(f"| disk read rate (64 MiB reads) | {LD.get('read_GBps')} GB/s |")
        L.append(f"| load time (slowest rank) | {LD.get('load_s')} s |")
        rel = pct(LD.get("load_vs_read"))
        L.append(f"| load throughput | {LD.get('load_GBps')} GB/s = {rel} of the read rate |")
        L.append(
            f"| host RssAnon peak (max over ranks) | {LD.get('rss_anon_peak_GiB')} GiB "
            f"(growth during load {LD.get('rss_anon_growth_GiB')} GiB) |"
        )
        L.append(
            f"| largest slice + 1 GiB | {LD.get('rss_bound_GiB')} GiB "
            f"(largest slice {LD.get('largest_slice_GiB')} GiB) |"
        )
        L.append(f"| loader | {LD.get('loader')} |")
        L.append(f"| loaded values spot-checked | {LD.get('spot_check_ok')} |")
        L.append("")
        rss_ok = verdict(LD.get("rss_within_bound"), True)
        L.append(
            f"Targets: RssAnon <= largest slice + 1 GiB: {rss_ok}; "
            f"throughput >= 70% of read: {verdict(LD.get('load_vs_read'), 0.7)}."
        )
        L.append("")

    # steps
    if b.get("steps"):
        L.append("### Steps of the run\n")
        L.append("| step | status | seconds | timeout s |")
        L.append("|---|---|---|---|")
        for s in b["steps"]:
            L.append(
                f"| {s.get('step')} | {s.get('status')} {s.get('why', '')} | "
                f"{num(s.get('seconds'), '{}')} | {num(s.get('timeout_s'), '{}')} |"
            )
        L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("inputs", nargs="*", help="bundles (results.json) to merge and print")
    p.add_argument("--bundle", help="a work folder of result JSONs and steps.jsonl to bundle")
    p.add_argument("--json", help="write the bundle here")
    p.add_argument("--md", help="write the tables here (default: stdout)")
    a = p.parse_args(argv)
    parts = []
    if a.bundle:
        parts.append(bundle(a.bundle))
    for path in a.inputs:
        with open(path) as f:
            parts.append(json.load(f))
    if not parts:
        p.error("give --bundle DIR or one or more results.json")
    b = merge(parts)
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(b, f, indent=1, default=str)
        os.replace(tmp, a.json)
    text = tables(b)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    elif not a.json:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
