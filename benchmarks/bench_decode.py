"""Decoding speed of a Llama-2-7B-shaped model: quantmesh against transformers (and peft + bnb).

  --mode single   plain transformers on one device: `generate` with the dynamic cache, then (unless
                  --no-compile) with cache_implementation="static", which transformers compiles
                  (torch.compile, mode reduce-overhead) on CUDA; the compile time is reported apart.
  --mode tp       under torchrun: the model built on meta, qm.parallelize(tp=world size, bf16), then
                  transformers' `generate` on the parallelized model (dynamic cache); with
                  --compile also the static cache (compiled by transformers as above).
  --mode qlora    one device, nf4 base + LoRA r16 on the seven projections (A and B both random, so
                  the adapters change every token): the peer is peft over bitsandbytes NF4 (double
                  quant, bf16 compute) with `generate`, dynamic cache, then the static cache
                  (compiled by transformers); ours is qm.parallelize(quant="nf4", lora=r16) with the
                  same base and adapter values, decoded by qm.fast_decode (--greedy and/or
                  --temperature). The peer's sampled run reuses its compiled forward.
  --greedy        (any mode) also quantmesh's own loop, qm.greedy_decode: static cache, the step
                  compiled with CUDA graphs, no per-token read-back. In single mode it is reported
                  for reference only: the peer is the best transformers setup.
  --temperature T [--top-p P]
                  also sampled decoding: qm.fast_decode with T and P (sampling inside the compiled
                  step) and, in single mode, its peer transformers `generate(do_sample=True)` with
                  the static cache (compiled by transformers; top_k off).

Both fill the same seeded random weights (drawn on the device, so single and tp hold equal
values); batch 1, a 32-token random prompt, 256 new tokens, no EOS (exactly 256 are generated).
New tokens/s = 256 / generate's wall time (prefill included), after a warm-up generate. With
--ref-json (the single run's result) the tp run reports how many leading tokens agree with one
GPU's.

Usage:
    python benchmarks/bench_decode.py --mode single --out DIR
    python benchmarks/bench_decode.py --mode qlora --greedy --temperature 0.8 --top-p 0.95 --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_decode.py --mode tp --out DIR \
        --ref-json DIR/result_decode_single.json
Writes DIR/result_decode_<mode>.json (rank 0), rewritten after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmbench as qb  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    qb.shape_args(p)
    p.add_argument("--mode", required=True, choices=["single", "tp", "qlora"])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--no-compile", action="store_true", help="single: skip the static+compile run")
    p.add_argument("--compile", action="store_true", help="tp: also the static cache + compile")
    p.add_argument(
        "--greedy", action="store_true", help="also qm.greedy_decode (static cache, compiled step)"
    )
    p.add_argument(
        "--ref-json", default=None, help="tp: the single run's JSON, for token agreement"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: also sampled decoding")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled runs")
    p.add_argument(
        "--no-peer", action="store_true", help="qlora: quantmesh's runs only (the peer's are known)"
    )
    p.add_argument(
        "--peer-only",
        action="store_true",
        help="qlora: the peer's runs only, none of quantmesh's: with a --no-peer run in another "
        "process of the same call, neither pays for what the other left on the GPU (the peer's "
        "compiled static cache warms its CUDA graphs up on a side stream, which slowed the "
        "replayed steps of everything after it in the process: docs/benchmarks.md, forty-second "
        "and forty-third sittings)",
    )
    p.add_argument("--batch", type=int, default=1, help="rows decoded at once (random prompts)")
    p.add_argument(
        "--kernel",
        action="store_true",
        help="qlora: also greedy with quantmesh's opt-in 4-bit kernel for few rows "
        "(quant/kernel4.py) in place of bitsandbytes' matmul_4bit, in the same process",
    )
    p.add_argument(
        "--gemv",
        action="store_true",
        help="qlora: also greedy with kernel4.GEMV_ENABLED flipped (quantmesh's gemv, 1 to "
        "GEMV_MAX_ROWS rows, on by default, against bitsandbytes' matmul_4bit), in the same "
        "process (profiled too with --profile): qm_greedy_bnb when the gemv is on at the start, "
        "else qm_greedy_gemv",
    )
    p.add_argument(
        "--mma",
        action="store_true",
        help="qlora: also greedy with kernel4.MMA_ENABLED flipped (quantmesh's tensor-core "
        "kernel, 9 to 64 rows, on by default), in the same process (profiled too with --profile): "
        "qm_greedy_mma when it is off at the start, else qm_greedy_no_mma",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="qlora: also greedy with kernel4.JOIN_ENABLED flipped (the sibling layers' 4-bit "
        "codes read as one weight, on by default on a GPU), in the same process (profiled too "
        "with --profile): qm_greedy_join when it is off at the start, else qm_greedy_no_join",
    )
    p.add_argument(
        "--prefill",
        action="store_true",
        help="qlora: also greedy with infer.decode.PREFILL_COMPILED flipped (the prefill compiled, "
        "opt-in), in the same process (profiled too with --profile): qm_greedy_compiled_prefill "
        "when it is off at the start, else qm_greedy_eager_prefill",
    )
    p.add_argument(
        "--dequant",
        action="store_true",
        help="qlora: also greedy with kernel4.DEQUANT_ENABLED flipped (Triton's dequantize + "
        "one matmul from DEQUANT_MIN_ROWS rows, opt-in), in the same process (profiled too "
        "with --profile): qm_greedy_dequant when it is off at the start, else "
        "qm_greedy_no_dequant",
    )
    p.add_argument(
        "--timed-runs",
        type=int,
        default=1,
        help="timed runs of each phase after its warm-up; its new_tokens_per_s is the best, "
        "every run's in runs_new_tokens_per_s (peft's compiled static cache ran at 54-103 new "
        "tokens/s in four calls of one command on an H100: docs/benchmarks.md)",
    )
    p.add_argument(
        "--again",
        action="store_true",
        help="greedy: time the defaults once more after the flipped runs (qm_greedy_again), and "
        "each flipped run's speed over that run too (over_default_again): the first timed run "
        "of a process was far slower than its GPU time on an H100 (docs/benchmarks.md)",
    )
    p.add_argument(
        "--gemv-lora",
        action="store_true",
        help="qlora: also greedy with kernel4.GEMV_LORA_ENABLED flipped (the adapters' B "
        "products inside the gemv's launch, opt-in), in the same process (profiled too with "
        "--profile): qm_greedy_gemv_lora when it is off at the start, else qm_greedy_no_gemv_lora",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="qlora: also greedy with infer.prefill_graph.ENABLED flipped (the prefill replayed as "
        "a CUDA graph per length bucket, on by default), in the same process: qm_greedy_prefill_graphs "
        "when it is off at the start, else qm_greedy_no_prefill_graphs",
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="qlora: also greedy with quantmesh.infer.attention.ENABLED flipped (the split-KV "
        "decode attention kernel in place of sdpa for one query token, on by default), in the same "
        "process (profiled too with --profile): "
        "qm_greedy_attention when it is off at the start, else qm_greedy_no_attention",
    )
    p.add_argument(
        "--gemv-tile",
        default=None,
        help="the gemv's tile for the batch's rows as JSON (kernel4.gemv_config's keys), else "
        "the library's (kernel4.GEMV_ROW_TILES)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="qlora: GPU kernel time per decode step by kind (torch.profiler, 32 steps)",
    )
    p.add_argument(
        "--matmul-adapters",
        action="store_true",
        help="qlora: also greedy with the adapters' one-row products as matmuls "
        "(lora.adapter.LEAN_ROWS off), in the same process (profiled too with --profile)",
    )
    p.add_argument(
        "--peer-static-only",
        action="store_true",
        help="qlora: the peer's compiled static cache alone (its dynamic cache, ~9 tokens/s on a "
        "7B, left out)",
    )
    p.add_argument(
        "--step-graph",
        action="store_true",
        help="qlora: also greedy with step_graph.ENABLED flipped (the step recorded by hand as one "
        "CUDA graph, on by default; off: inductor's CUDA graph trees), in the same process",
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help="qlora: also greedy with fuse_adapters=False (each adapter its own two matmuls)",
    )
    a = qb.finish_args(p.parse_args(argv))
    if a.peer_only and (a.no_peer or a.mode != "qlora"):
        p.error("--peer-only runs the qlora peer: it takes --mode qlora and not --no-peer")
    if a.smoke:
        a.new, a.prompt = 16, 8
    return a


def prepare_generation(model) -> None:
    gc = model.generation_config
    gc.eos_token_id = None  # random weights: never stop early, always a.new tokens
    gc.pad_token_id = 0
    gc.do_sample = False
    model.config.use_cache = True
    model.eval()


def prompt_ids(a, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, a.vocab, (a.batch, a.prompt), generator=g).to(device)


@torch.no_grad()
def timed_generate(model, ids, new: int, device, **kw) -> tuple[float, list[int]]:
    kw.setdefault("do_sample", False)
    qb.sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, use_cache=True, **kw)
    qb.sync(device)
    dt = time.perf_counter() - t0
    got = out.shape[1] - ids.shape[1]
    if got != new:
        raise RuntimeError(f"generate returned {got} new tokens, expected {new}")
    return dt, out[0, ids.shape[1] :].tolist()


def timed_qm(
    model,
    ids,
    new: int,
    device,
    temperature: float = 0.0,
    top_p: float = 1.0,
    fuse_adapters: bool = True,
) -> tuple[float, list[int]]:
    """qm.fast_decode (static cache, compiled step, no per-token read-back; greedy at temperature
    0), timed until its tokens are read back on the host, as generate's return is."""
    import quantmesh as qm

    qb.sync(device)
    t0 = time.perf_counter()
    out = qm.fast_decode(
        model, ids, new, temperature=temperature, top_p=top_p, seed=0,
        mode=None if device.type == "cpu" else "reduce-overhead", fuse_adapters=fuse_adapters,
    )  # fmt: skip
    tokens = out[0].tolist()
    dt = time.perf_counter() - t0
    if len(tokens) != new:
        raise RuntimeError(f"fast_decode returned {len(tokens)} new tokens, expected {new}")
    return dt, tokens


def phase(model, a, ids, device, R: dict, name: str, *, qm: dict | None = None, **kw) -> list[int]:
    """One warm-up run (short, or full length when it compiles), then the timed ones
    (`--timed-runs`, the best counts): transformers' `generate` with `kw`, or qm.fast_decode with
    `qm` (temperature, top_p) when given."""
    compiles = qm is not None or "cache_implementation" in kw
    timed = timed_generate if qm is None else timed_qm
    args = kw if qm is None else qm
    qb.reset_peaks(device)
    t0 = time.perf_counter()
    timed(model, ids, a.new if compiles else min(16, a.new), device, **args)
    warm = time.perf_counter() - t0
    runs = [timed(model, ids, a.new, device, **args) for _ in range(max(1, a.timed_runs))]
    dts, tokens = [r[0] for r in runs], runs[0][1]  # (the best run counts; the first's tokens)
    dt = min(dts)
    R[name] = {
        "new_tokens_per_s": round(a.batch * a.new / dt, 2),  # all rows together
        "runs_new_tokens_per_s": [round(a.batch * a.new / d, 2) for d in dts],
        "batch": a.batch,
        "ms_per_token": round(dt / a.new * 1000, 3),
        "warmup_generate_s": round(warm, 2),
        "compiled": qm is not None or getattr(model, "_compiled_call", None) is not None,
        "mem": qb.gpu_mem(device),
    }
    qb.log(f"{name}: {a.batch * a.new / dt:.1f} new tokens/s (warm-up {warm:.1f} s)")
    return tokens


def flag_phase(model, a, ids, dev, R: dict, out_path: str, g: list[int], name: str,
               module, flag: str, value) -> None:  # fmt: skip
    """One more greedy run in the same process with `module.flag = value` (a global the compiled
    step is guarded on: it compiles again), profiled too with --profile (`qm_profile_*`); then
    its tokens' agreement with the default run's `g` and its speed over the default run's."""
    with qb.record_errors(R, f"{name}_error"):
        with qb.switched(module, flag, value):
            # a flag may change the model at a loop's first prefill (JOIN_ENABLED joins the
            # siblings' codes; its prefill's kernels then compile for the joined shapes): one
            # prefill first, so that the warm-up and the timed run start from the same model
            import quantmesh as qm

            qm.fast_decode(model, ids, 1)  # (one token: no step, nothing compiled)
            v = phase(model, a, ids, dev, R, name, qm={})
            if a.profile and dev.type == "cuda":
                R[name.replace("qm_greedy", "qm_profile")] = profile_decode(model, ids, a)
        if "qm_greedy" in R:
            R[name]["tokens_agree_with_default"] = agree(v, g)
            R[name]["over_default"] = round(
                R[name]["new_tokens_per_s"] / R["qm_greedy"]["new_tokens_per_s"], 3
            )
    qb.write_json(out_path, R)


def agree(x: list[int], y: list[int]) -> int:
    """How many leading tokens are equal."""
    same = 0
    for u, v in zip(x, y, strict=False):  # lengths may differ: the common prefix
        if u != v:
            break
        same += 1
    return same


def run_single(a, R: dict, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    dev = torch.device("cpu" if a.cpu else "cuda:0")
    t0 = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(
            qb.llama_config(a, use_cache=True), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    R["build"] = qb.fill_random(model, seed=a.seed)
    R["build"]["build_s"] = round(time.perf_counter() - t0, 2)
    prepare_generation(model)
    ids = prompt_ids(a, dev)
    R["tokens"] = phase(model, a, ids, dev, R, "dynamic_cache")
    qb.write_json(out_path, R)
    if not a.no_compile:
        with qb.record_errors(R, "static_compile_error"):
            phase(model, a, ids, dev, R, "static_compile", cache_implementation="static")
    runs = [R[k]["new_tokens_per_s"] for k in ("dynamic_cache", "static_compile") if k in R]
    R["best_new_tokens_per_s"] = max(runs)  # the best *transformers* setup: the peer
    qb.write_json(out_path, R)
    if a.greedy:  # quantmesh's loop on the same single GPU, for reference (not the peer)
        with qb.record_errors(R, "qm_greedy_error"):
            g = phase(model, a, ids, dev, R, "qm_greedy", qm={})
            R["qm_greedy"]["tokens_agree_with_generate"] = agree(g, R["tokens"])
    if a.temperature > 0:  # sampled: transformers' best setup (the peer), then ours
        sample = {"temperature": a.temperature, "top_p": a.top_p}
        if not a.no_compile:
            with qb.record_errors(R, "static_compile_sampled_error"):
                phase(model, a, ids, dev, R, "static_compile_sampled",
                      cache_implementation="static", do_sample=True, top_k=0, **sample)  # fmt: skip
        with qb.record_errors(R, "qm_sampled_error"):
            phase(model, a, ids, dev, R, "qm_sampled", qm=sample)
        qb.write_json(out_path, R)


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def fill_adapters(model, seed: int) -> int:
    """Every LoRA A and B of `model` (peft's or quantmesh's) gets N(0, 0.02) values that are a
    function of (seed, layer, projection, A/B) only, so the two libraries hold equal adapters."""
    n = 0
    for name, p in model.named_parameters():
        if "lora_A" not in name and "lora_B" not in name:
            continue
        key = name.removeprefix("base_model.model.").replace(".default", "")
        p.copy_(qb.full_value(key, p.shape, seed=seed, gen_device=p.device, dtype=torch.float32))
        n += 1
    return n


def bnb_nf4_peft(model, r: int):
    """The peer's model: each decoder nn.Linear replaced by bitsandbytes' Linear4bit (nf4, double
    quant, bf16 compute) quantized from its own bf16 weight, then peft LoRA on the seven
    projections."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                new = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=False, device="meta",
                    compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                )  # fmt: skip
                w = child.weight.data
                new.weight = bnb.nn.Params4bit(
                    w, requires_grad=False, quant_type="nf4", compress_statistics=True, module=new
                ).to(w.device)
                setattr(parent, name, new)
    model.is_loaded_in_4bit = True
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(TARGETS))
    return get_peft_model(model, lcfg)


def run_qlora_peer(a, R: dict, out_path: str, dev, ids, sample: dict) -> None:
    """The peer of the qlora mode: peft + bnb NF4 with transformers' `generate`."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    with torch.device(dev):
        peer = AutoModelForCausalLM.from_config(
            qb.llama_config(a, use_cache=True), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    qb.fill_random(peer, seed=a.seed)
    peer = bnb_nf4_peft(peer, 16)
    R["build_peer"] = {
        "adapters": fill_adapters(peer, a.seed),
        "s": round(time.perf_counter() - t0, 2),
    }
    prepare_generation(peer)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if not a.peer_static_only:
        R["tokens"] = phase(peer, a, ids, dev, R, "peft_dynamic_cache")
        qb.write_json(out_path, R)
    if not a.no_compile:
        with qb.record_errors(R, "peft_static_compile_error"):
            R["tokens_static"] = phase(
                peer, a, ids, dev, R, "peft_static_compile", cache_implementation="static"
            )
            R.setdefault("tokens", R["tokens_static"])
        qb.write_json(out_path, R)
    if a.temperature > 0 and not a.no_compile:
        with qb.record_errors(R, "peft_static_compile_sampled_error"):
            phase(peer, a, ids, dev, R, "peft_static_compile_sampled",
                  cache_implementation="static", do_sample=True, top_k=0, **sample)  # fmt: skip
    runs = [
        R[k]["new_tokens_per_s"] for k in ("peft_dynamic_cache", "peft_static_compile") if k in R
    ]
    R["best_new_tokens_per_s"] = max(runs, default=None)  # the peer: peft's best greedy setup
    qb.write_json(out_path, R)
    del peer
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def qlora_model(a, mesh):
    """quantmesh's nf4 + LoRA r16 model of `a`'s shape on `mesh`, random weights (seed `a.seed`);
    its adapters still zero (`fill_adapters`)."""
    import quantmesh as qm

    model = qb.skeleton(qb.llama_config(a, use_cache=True))
    qm.parallelize(
        model, mesh, quant="nf4", lora=qm.LoraConfig(r=16, alpha=32), dtype=torch.bfloat16
    )
    qb.fill_random(model, seed=a.seed)
    return model


def qlora_ready(a) -> tuple[torch.device, torch.Tensor, Any]:
    """What the decode probes run on: the device of `a`, its prompt and `qlora_model`'s model
    with its adapters filled and its generation config set."""
    import quantmesh as qm

    dev = torch.device("cpu" if a.cpu else "cuda:0")
    model = qlora_model(a, qm.init_mesh(backend="gloo" if a.cpu else None))
    fill_adapters(model, a.seed)
    prepare_generation(model)
    return dev, prompt_ids(a, dev), model


def decoder(model) -> Any:
    """The `fast_decode` decoder kept on `model` (after a first call)."""
    return model.__dict__["_quantmesh_decoder"]


def run_qlora(a, R: dict, out_path: str) -> None:
    """nf4 + LoRA on one device: peft + bnb with transformers' `generate` (the peer), then
    qm.fast_decode on quantmesh's nf4 + LoRA model holding the same values."""

    import quantmesh as qm

    dev = torch.device("cpu" if a.cpu else "cuda:0")
    ids = prompt_ids(a, dev)
    sample = {"temperature": a.temperature, "top_p": a.top_p}
    if not a.no_peer:
        run_qlora_peer(a, R, out_path, dev, ids, sample)
    if a.peer_only:
        return

    t0 = time.perf_counter()
    model = qlora_model(a, qm.init_mesh(backend="gloo" if a.cpu else None))
    from quantmesh.infer import attention, decode, prefill_graph, step_graph
    from quantmesh.lora import adapter
    from quantmesh.quant import kernel4

    R["gemv_enabled_at_start"] = kernel4.GEMV_ENABLED  # QUANTMESH_GEMV=0: off in every run
    R["mma_enabled_at_start"] = kernel4.MMA_ENABLED  # QUANTMESH_MMA=1: on in every run
    R["dequant_enabled_at_start"] = kernel4.DEQUANT_ENABLED  # QUANTMESH_TRITON_DEQUANT=1
    R["join_enabled_at_start"] = kernel4.JOIN_ENABLED  # QUANTMESH_JOIN_CODES=0: off
    R["gemv_lora_enabled_at_start"] = kernel4.GEMV_LORA_ENABLED  # QUANTMESH_GEMV_LORA=1: on
    R["prefill_compiled_at_start"] = decode.PREFILL_COMPILED  # QUANTMESH_COMPILED_PREFILL=1
    R["attention_enabled_at_start"] = attention.ENABLED  # QUANTMESH_DECODE_ATTENTION
    R["step_graph_enabled_at_start"] = step_graph.ENABLED  # QUANTMESH_STEP_GRAPH=0: trees
    # the tile of the batch's rows (the decode steps'), where the gemv takes them
    tile = None
    if a.batch <= kernel4.GEMV_MAX_ROWS:
        tile = kernel4.GEMV_ROW_TILES[kernel4._pow2(a.batch)]
    if a.gemv_tile:  # every run that takes the gemv
        if tile is None:
            raise SystemExit(f"--gemv-tile: the gemv does not take batch {a.batch}'s rows")
        tile.update(json.loads(a.gemv_tile))
    R["gemv_tile"] = None if tile is None else dict(tile)
    R["build_qm"] = {
        "adapters": fill_adapters(model, a.seed),
        "s": round(time.perf_counter() - t0, 2),
    }
    prepare_generation(model)
    g: list[int] = []
    if a.greedy:
        with qb.record_errors(R, "qm_greedy_error"):
            g = phase(model, a, ids, dev, R, "qm_greedy", qm={})
            if not a.no_peer and R.get("best_new_tokens_per_s"):
                R["qm_greedy"]["tokens_agree_with_peft"] = agree(g, R["tokens"])
                R["qm_greedy"]["over_peft_best"] = round(
                    R["qm_greedy"]["new_tokens_per_s"] / R["best_new_tokens_per_s"], 3
                )
        qb.write_json(out_path, R)
    if a.greedy and a.kernel:  # quantmesh's kernel in every quantized linear, <= 64 rows
        flag_phase(model, a, ids, dev, R, out_path, g, "qm_greedy_kernel", kernel4, "ENABLED", True)
    if a.greedy and a.profile and dev.type == "cuda":
        with qb.record_errors(R, "qm_profile_error"):
            R["qm_profile"] = profile_decode(model, ids, a)
        qb.write_json(out_path, R)
    # an opt-in path of quantmesh's against the default one: (asked, module, its switch, the
    # run's name when the run turns it on, when it turns it off)
    for want, module, flag, on_name, off_name in (
        (a.gemv, kernel4, "GEMV_ENABLED", "gemv", "bnb"),  # against bitsandbytes' kernels
        (a.mma, kernel4, "MMA_ENABLED", "mma", "no_mma"),
        (a.dequant, kernel4, "DEQUANT_ENABLED", "dequant", "no_dequant"),
        (a.join, kernel4, "JOIN_ENABLED", "join", "no_join"),
        (a.gemv_lora, kernel4, "GEMV_LORA_ENABLED", "gemv_lora", "no_gemv_lora"),
        (a.prefill, decode, "PREFILL_COMPILED", "compiled_prefill", "eager_prefill"),
        (a.attention, attention, "ENABLED", "attention", "no_attention"),
        (a.graphs, prefill_graph, "ENABLED", "prefill_graphs", "no_prefill_graphs"),
        (a.step_graph, step_graph, "ENABLED", "step_graph", "trees"),
    ):
        if a.greedy and want:
            on = getattr(module, flag)
            flag_phase(model, a, ids, dev, R, out_path, g,
                       f"qm_greedy_{off_name if on else on_name}", module, flag,
                       not on)  # fmt: skip
    if a.greedy and a.again:  # the defaults again, in a process that has run everything else
        with qb.record_errors(R, "qm_greedy_again_error"):
            v = phase(model, a, ids, dev, R, "qm_greedy_again", qm={})
            R["qm_greedy_again"]["tokens_agree_with_default"] = agree(v, g)
            again = R["qm_greedy_again"]["new_tokens_per_s"]
            for name, run in list(R.items()):
                if (
                    name.startswith("qm_greedy_")
                    and isinstance(run, dict)
                    and "over_default" in run
                ):
                    run["over_default_again"] = round(run["new_tokens_per_s"] / again, 3)
        qb.write_json(out_path, R)
    if a.greedy and a.matmul_adapters:  # the adapters' one-row products as matmuls
        flag_phase(model, a, ids, dev, R, out_path, g, "qm_greedy_matmul_adapters", adapter,
                   "LEAN_ROWS", False)  # fmt: skip
    if a.greedy and a.unfused:
        with qb.record_errors(R, "qm_greedy_unfused_error"):
            u = phase(model, a, ids, dev, R, "qm_greedy_unfused", qm={"fuse_adapters": False})
            if "qm_greedy" in R:
                R["qm_greedy_unfused"]["tokens_agree_with_fused"] = agree(u, g)
                R["stacked_over_unfused"] = round(
                    R["qm_greedy"]["new_tokens_per_s"] / R["qm_greedy_unfused"]["new_tokens_per_s"],
                    3,
                )
        qb.write_json(out_path, R)
    if a.temperature > 0:
        with qb.record_errors(R, "qm_sampled_error"):
            phase(model, a, ids, dev, R, "qm_sampled", qm=sample)
            peer_s = R.get("peft_static_compile_sampled", {}).get("new_tokens_per_s")
            if peer_s:
                R["qm_sampled"]["over_peft_sampled"] = round(
                    R["qm_sampled"]["new_tokens_per_s"] / peer_s, 3
                )
        qb.write_json(out_path, R)


KINDS = (  # kernel name fragments -> kind, first match wins
    ("qm_gemv", "quantmesh gemv"),
    ("qm_mma", "quantmesh tensor-core 4-bit matmul"),
    ("dequant_4bit", "quantmesh dequantize"),
    ("rows_4bit", "quantmesh 4-bit kernel"),
    ("gemm_4bit", "bitsandbytes 4-bit matmul"),  # gemm_4bit_simt: its 1-row gemv
    ("gemv_4bit", "bitsandbytes 4-bit matmul"),
    ("dequantize", "bitsandbytes dequantize"),
    ("qm_decode_attn", "quantmesh decode attention"),
    ("flash", "attention"),
    ("attention", "attention"),
    ("fmha", "attention"),
    ("gemm", "matmul (adapters, head, dequantized)"),
    ("nvjet", "matmul (adapters, head, dequantized)"),
    ("cutlass", "matmul (adapters, head, dequantized)"),
    ("triton_", "inductor fused elementwise / reductions"),
    ("memcpy", "copies"),
    ("copy", "copies"),
)


def kernel_gaps(kernels: list[tuple[float, float, str]], steps: int) -> dict:
    """The GPU's idle time between kernels, a step: `kernels` (start us, end us, kind), each gap
    (from the latest end so far to the next start) counted against the kind of kernel it follows
    and the kind it precedes. A step replayed as one CUDA graph idles only between its nodes.

    Example:
        >>> kernel_gaps([(0, 2, "a"), (5, 6, "b"), (6, 9, "a")], steps=1)["idle_us_per_step"]
        3.0
    """
    after: dict[str, float] = {}
    before: dict[str, float] = {}
    ks = sorted(kernels)
    if not ks:
        return {}
    end, last = ks[0][1], ks[0][2]
    for start, stop, kind in ks[1:]:
        gap = start - end
        if gap > 0:
            after[last] = after.get(last, 0.0) + gap
            before[kind] = before.get(kind, 0.0) + gap
        if stop >= end:
            end, last = stop, kind

    def per_step(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v / steps, 1) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {
        "span_us_per_step": round((end - ks[0][0]) / steps, 1),
        "idle_us_per_step": round(sum(after.values()) / steps, 1),
        "idle_after_kind": per_step(after),
        "idle_before_kind": per_step(before),
    }


def kind_of_kernel(name: str) -> str:
    """The kind (KINDS) of a kernel's name."""
    low = name.lower()
    return next((k for frag, k in KINDS if frag in low), "other")


def _short(name: str) -> str:
    """A kernel's name in at most 90 characters, its end kept: inductor's names share long
    prefixes and differ in their last words and number.

    Example:
        >>> _short("k" * 100)[55:65]
        'kkk...kkkk'
    """
    return name if len(name) <= 90 else f"{name[:58]}...{name[-29:]}"


@torch.no_grad()
def profile_decode(model, ids, a, steps: int = 32) -> dict:
    """GPU kernel time of `steps` compiled decode steps, by kind, and the top kernels (the step is
    already compiled: fast_decode ran before with the same shapes); the host's launches per
    step: CUDA graph replays against single kernel launches (a step replayed as a graph launches
    no kernel of its own); and the GPU's idle time between kernels (`kernel_gaps`) from the first
    graph replay on (the eager prefill before it left out; with no replay, everything)."""
    from torch.profiler import ProfilerActivity, profile

    import quantmesh as qm

    qm.fast_decode(model, ids, steps + 1)  # the same compiled step, warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        qm.fast_decode(model, ids, steps + 1)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    count: dict[str, int] = {}
    for ev in prof.events():
        if qb.is_kernel(ev):
            per_kernel[ev.name] = per_kernel.get(ev.name, 0.0) + ev.device_time_total
            count[ev.name] = count.get(ev.name, 0) + 1
    kinds: dict[str, float] = {}
    for name, us in per_kernel.items():
        kind = kind_of_kernel(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    graph_at = [
        ev.time_range.start
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CPU and "GraphLaunch" in ev.name
    ]
    first = min(graph_at, default=0.0)  # the steps' kernels: from the first replay on
    starts = [ev.time_range.start for ev in prof.events()]
    ends = [ev.time_range.end for ev in prof.events()]
    call = {  # where the profiled call's wall time goes: before its first replay, and after
        "call_ms": round((max(ends) - min(starts)) / 1e3, 2),
        "before_first_replay_ms": round((first - min(starts)) / 1e3, 2) if graph_at else None,
        "from_first_replay_ms": round((max(ends) - first) / 1e3, 2) if graph_at else None,
    }
    timed = [
        (ev.time_range.start, ev.time_range.end, kind_of_kernel(ev.name))
        for ev in prof.events()
        if qb.is_kernel(ev) and ev.time_range.start >= first
    ]
    # the host's time before the first replay (the prefill, the setup) by op, self time: where
    # a call's first ~0.2 s go, which the steps' kernels do not say
    before: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.time_range.start < first:
            before[ev.name] = before.get(ev.name, 0.0) + ev.self_cpu_time_total
    total = sum(per_kernel.values())
    host = [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CPU]
    launches = {
        "graph_launches": sum(1 for n in host if "GraphLaunch" in n),
        "kernel_launches": sum(1 for n in host if "LaunchKernel" in n),
    }
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:60]
    return {
        "steps": steps,
        "gpu_us_per_step": round(total / steps, 1),
        "kinds_us_per_step": {
            k: round(v / steps, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_us_per_step": {_short(n): round(v / steps, 1) for n, v in top},
        # (launches a step, microseconds a launch) of the same kernels: many small kernels a
        # layer cost more than their own time (each one's start and end in the graph)
        "top_kernels_launches_per_step": {
            _short(n): (round(count[n] / steps, 1), round(v / max(count[n], 1), 2)) for n, v in top
        },
        "host_per_step": {k: round(v / steps, 1) for k, v in launches.items()},
        "gaps": kernel_gaps(timed, max(1, len(graph_at))),
        "replays": len(graph_at),
        "call": call,
        "host_before_first_replay_us": {
            n[:90]: round(v, 1) for n, v in sorted(before.items(), key=lambda kv: -kv[1])[:25]
        },
        "kernels_per_step": round(
            sum(1 for ev in prof.events() if qb.is_kernel(ev)) / steps,
            1,
        ),
    }


def run_tp(a, R: dict, out_path: str) -> None:
    import torch.distributed as dist

    import quantmesh as qm

    mesh = qm.init_mesh(tp=-1, dp=1, backend="gloo" if a.cpu else None)
    dev = mesh.device
    R.update(tp=mesh.tp, gpus=mesh.world_size)
    t0 = time.perf_counter()
    model = qb.skeleton(qb.llama_config(a, use_cache=True))
    qm.parallelize(model, mesh, dtype=torch.bfloat16)
    R["build"] = qb.fill_random(model, seed=a.seed)
    R["build"]["build_s"] = round(time.perf_counter() - t0, 2)
    prepare_generation(model)
    ids = prompt_ids(a, dev)
    R["tokens"] = phase(model, a, ids, dev, R, "dynamic_cache")
    ref = []
    if a.ref_json and os.path.exists(a.ref_json):
        import json

        with open(a.ref_json) as f:
            ref = json.load(f).get("tokens") or []
        R["tokens_agree_with_single"] = agree(R["tokens"], ref)
    if mesh.rank == 0:
        qb.write_json(out_path, R)
    if a.compile:
        with qb.record_errors(R, "static_compile_error"):
            phase(model, a, ids, dev, R, "static_compile", cache_implementation="static")
        if mesh.rank == 0:
            qb.write_json(out_path, R)
    if a.greedy:
        with qb.record_errors(R, "qm_greedy_error"):
            g = phase(model, a, ids, dev, R, "qm_greedy", qm={})
            R["qm_greedy"]["tokens_agree_with_dynamic"] = agree(g, R["tokens"])
            if ref:
                R["qm_greedy"]["tokens_agree_with_single"] = agree(g, ref)
    runs = [
        R[k]["new_tokens_per_s"]
        for k in ("dynamic_cache", "static_compile", "qm_greedy")
        if k in R and "new_tokens_per_s" in R[k]
    ]
    R["best_new_tokens_per_s"] = max(runs)
    if a.temperature > 0:
        with qb.record_errors(R, "qm_sampled_error"):
            phase(model, a, ids, dev, R, "qm_sampled",
                  qm={"temperature": a.temperature, "top_p": a.top_p})  # fmt: skip
        if mesh.rank == 0:
            qb.write_json(out_path, R)
    dist.barrier()


def main(argv=None) -> int:
    a = parse(argv)
    R = {
        "bench": "decode",
        "mode": a.mode,
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "ref_json")},
        "versions": qb.versions(),
        "ok": False,
    }
    out_path = os.path.join(a.out, f"result_decode_{a.mode}{a.tag}.json")
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.time()
    with qb.record_errors(R):
        {"single": run_single, "tp": run_tp, "qlora": run_qlora}[a.mode](a, R, out_path)
        R["ok"] = True
    R["wall_s"] = round(time.time() - t0, 1)
    if rank == 0:
        qb.write_json(out_path, R)
    if a.mode == "tp" and torch.cuda.is_available():
        # NCCL communicators used inside captured CUDA graphs: destroy_process_group hung for
        # minutes at exit on 2x H200 (torch 2.11), after everything was written. Leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if R["ok"] else 1)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
