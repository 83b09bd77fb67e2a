"""Load benchmark of `quantmesh serve`: aggregate tokens/s and latency at several concurrencies.

It builds (once, seeded) a model folder of the chosen shape with random weights and a word-level
tokenizer, plus N random PEFT LoRA adapters, starts `quantmesh serve` on it, and then, for each
concurrency C, runs C client threads that each send --requests completions back to back
(a --prompt-tokens random-word prompt, --max-tokens to generate, greedy). Two adapter mixes:

  single   every request names adapter 0 (one adapter in every batch)
  mixed    request i names adapter i % N (every batch mixes the N adapters)

Reported per (mix, concurrency): generated tokens / wall time (aggregate tokens/s, the server's
usage counts, so an early EOS is not counted as generated), p50 / p99 request latency and time to
the first text (requests are streamed), the mean
rows per decode step (from the server's /health counters), and the ratios of the issue's targets:
tokens/s at the highest concurrency over concurrency 1 (target >= 10x) and mixed over single at the
highest concurrency (target >= 0.85); and the server's start (launch to healthy: load, quantize,
the slot engine's compiles). The client is the standard library only (urllib, threads).

Usage (one GPU; the lead's session):
    python benchmarks/bench_serve.py --shape smollm2 --out .bench/serve
    python benchmarks/bench_serve.py --shape 7b --quant nf4 --out .bench/serve
    python benchmarks/bench_serve.py --smoke --out .bench/smoke  # tiny, CPU, tp=2: checks the script
Writes OUT/result_serve_<shape>_<quant>_tp<N>_<engine>_<cuda graphs>[_dense][_mma][_tdq].json
(--keep-dequantized; QUANTMESH_MMA=1; QUANTMESH_TRITON_DEQUANT=1 in the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quantmesh.config import CUDA_GRAPHS

REPO = Path(__file__).resolve().parents[1]

# (hidden, intermediate, layers, heads, kv heads, vocab, tied) of each shape
SHAPES = {
    "tiny": (72, 96, 2, 9, 3, 2000, True),
    "smollm2": (576, 1536, 30, 9, 3, 49152, True),  # SmolLM2-135M
    "7b": (4096, 11008, 32, 32, 32, 32000, False),  # Llama-2-7B
    # its widths at 4 of its 32 layers: per-layer kernels as 7b's, a fraction of the compiling
    "7b4": (4096, 11008, 4, 32, 32, 32000, False),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quant", default="none", help="none, nf4, fp4, int8")
    p.add_argument("--adapters", type=int, default=4, help="random adapters served (N)")
    p.add_argument("--rank", type=int, default=16, help="their LoRA rank")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=4, help="requests per client per phase")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--mixes", default="single,mixed", help="comma-separated: single, mixed")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=".bench/serve")
    p.add_argument("--models", default=None, help="where model folders are built (default OUT)")
    p.add_argument("--engine", default="dynamic", help="the server's --engine: dynamic, slots")
    p.add_argument("--max-model-len", type=int, default=1024, help="the server's context length")
    p.add_argument("--cuda-graphs", default=CUDA_GRAPHS[0], choices=CUDA_GRAPHS,
                   help=f"the server's --cuda-graphs (default {CUDA_GRAPHS[0]}; passed with an "
                   "engine other than dynamic)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, tp=2, small phases")
    p.add_argument(
        "--keep-dequantized",
        action="store_true",
        help="the server's --keep-dequantized (4-bit weights held dequantized too)",
    )
    a = p.parse_args(argv)
    unknown = set(a.mixes.split(",")) - {"single", "mixed"}
    if unknown:
        p.error(f"--mixes {a.mixes}: unknown {sorted(unknown)}; expected single and/or mixed")
    if a.smoke:
        a.shape, a.tp, a.adapters, a.rank = "tiny", 2, 2, 4
        a.concurrency, a.requests, a.prompt_tokens, a.max_tokens = "1,4", 2, 8, 6
    return a


def log(*msg: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *msg, flush=True)


# ---- the model folder ------------------------------------------------------------------------------
def build_model(a: argparse.Namespace, root: Path) -> tuple[Path, list[Path]]:
    """A random Llama of the shape (bf16 safetensors), a word-level tokenizer, N adapters."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import quantmesh as qm

    folder = root / f"model-{a.shape}"
    adapters = [root / f"adapter-{a.shape}-r{a.rank}-{i}" for i in range(a.adapters)]
    if (folder / "config.json").is_file() and all((p / "adapter_config.json").is_file()
                                                 for p in adapters):  # fmt: skip
        return folder, adapters
    h, inter, layers, heads, kv, vocab, tied = SHAPES[a.shape]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = [f"w{i}" for i in range(vocab - len(specials))] + ["user", "assistant", "system"]
    words = words[: vocab - len(specials)]
    tk = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>")
    )
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<unk>")  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=4096, tie_word_embeddings=tied,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, dtype="bfloat16")  # fmt: skip
    log(f"building {folder} (random weights, seed {a.seed})")
    with qm.empty_model():
        model = LlamaForCausalLM(cfg)
    # drawn on the GPU where there is one (a 7B shape on one CPU thread takes minutes)
    dev = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    state = {}
    t0 = time.perf_counter()
    for name, p in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue
        std = 0.02 if p.dim() == 2 else 0.0
        t = torch.empty(p.shape, dtype=torch.float32, device=dev)
        t = t.normal_(0.0, std, generator=gen) if p.dim() == 2 else t.fill_(1.0)
        state[name] = t.to(torch.bfloat16).cpu()
    gen = torch.Generator().manual_seed(a.seed)  # the adapters: small, on the CPU
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    log(f"weights drawn ({dev}) and written in {time.perf_counter() - t0:.0f} s")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for path in adapters:
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for t_name in TARGETS:
                part = "self_attn" if t_name in TARGETS[:4] else "mlp"
                fqn = f"model.layers.{layer}.{part}.{t_name}"
                out_f, in_f = shapes[f"{fqn}.weight"]
                a_t = torch.randn(a.rank, in_f, generator=gen) / in_f**0.5
                b_t = torch.randn(out_f, a.rank, generator=gen) * 0.01
                tensors[f"base_model.model.{fqn}.lora_A.weight"] = a_t
                tensors[f"base_model.model.{fqn}.lora_B.weight"] = b_t
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.rank,
            "lora_alpha": 2 * a.rank, "lora_dropout": 0.0, "target_modules": TARGETS,
            "bias": "none", "base_model_name_or_path": str(folder), "fan_in_fan_out": False,
        }))  # fmt: skip
    return folder, adapters


# ---- the server ------------------------------------------------------------------------------------
def start_server(a: argparse.Namespace, folder: Path, adapters: list[Path], max_batch: int):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    if a.smoke:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "quantmesh.cli.main", "serve", str(folder), "--tp", str(a.tp),
           "--quant", a.quant, "--port", "0", "--max-batch", str(max_batch),
           "--max-adapters", str(max(1, len(adapters))), "--engine", a.engine,
           "--max-model-len", str(a.max_model_len)]  # fmt: skip
    if a.engine != "dynamic":
        cmd += ["--cuda-graphs", a.cuda_graphs]
    if a.keep_dequantized:
        cmd += ["--keep-dequantized"]
    for i, p in enumerate(adapters):
        cmd += ["--adapter", f"ad{i}={p}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("quantmesh serve:"):
        proc.kill()
        raise RuntimeError(f"the server did not start (exit {proc.wait()}): {line!r}")
    url = line.split(" on ", 1)[1].split()[0]
    for _ in range(600):
        try:
            if get(url, "/health")["status"] == "ok":
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server never became healthy")


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def complete(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def complete_streamed(url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first text, seconds to the end, generated tokens) of one streamed request."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    total = time.perf_counter() - t0
    return (total if first is None else first), total, tokens


# ---- phases -------------------------------------------------------------------------------------
def phase(a: argparse.Namespace, url: str, names: list[str], conc: int, mixed: bool) -> dict:
    rng = random.Random(a.seed + conc)
    vocab = SHAPES[a.shape][5] - 8

    def client(c: int) -> list[tuple[float, float, int]]:
        out = []
        for k in range(a.requests):
            i = c * a.requests + k
            prompt = " ".join(f"w{rng.randrange(vocab)}" for _ in range(a.prompt_tokens))
            body = {"model": names[i % len(names)] if mixed else names[0], "prompt": prompt,
                    "max_tokens": a.max_tokens, "temperature": 0}  # fmt: skip
            out.append(complete_streamed(url, body))
        return out

    before = get(url, "/health")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        results = [x for part in pool.map(client, range(conc)) for x in part]
    wall = time.perf_counter() - t0
    after = get(url, "/health")
    steps = after["decode_steps"] - before["decode_steps"]
    mean_batch = (after["decoded_rows"] - before["decoded_rows"]) / max(steps, 1)
    # the server's own clock: its loop's time per decode step, and the part of it its host was
    # busy (not waiting for a step's tokens); where the two meet, the GPU waits for the host
    step_ms = (after["step_s"] - before["step_s"]) * 1e3 / max(steps, 1)
    host_ms = (after["host_s"] - before["host_s"]) * 1e3 / max(steps, 1)
    lat = sorted(x for _, x, _ in results)
    ttft = sorted(x for x, _, _ in results)
    tokens = sum(n for _, _, n in results)
    # a stream's time per token after its first (the decode rate a client sees)
    itl = sorted((t - f) / (n - 1) for f, t, n in results if n > 1)

    def pct(xs: list[float]) -> list[float]:
        return statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99

    q, qf = pct(lat), pct(ttft)
    return {"concurrency": conc, "mix": "mixed" if mixed else "single", "requests": len(lat),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "p50_s": q[49], "p99_s": q[98], "ttft_p50_s": qf[49], "ttft_p99_s": qf[98],
            "decode_steps": steps,
            "itl_p50_ms": statistics.median(itl) * 1e3 if itl else None,
            "mean_batch": mean_batch, "server_step_ms": step_ms,
            "server_host_ms": host_ms}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    folder, adapters = build_model(a, Path(a.models or out))
    concs = [int(c) for c in a.concurrency.split(",")]
    t0 = time.perf_counter()
    proc, url = start_server(a, folder, adapters, max(concs))
    start_s = time.perf_counter() - t0  # load, quantize, and the slot engine's compiles
    graphs = "eager" if a.engine == "dynamic" else a.cuda_graphs
    names = [f"ad{i}" for i in range(len(adapters))] or [folder.name]
    res: dict = {"shape": a.shape, "tp": a.tp, "quant": a.quant, "adapters": len(adapters),
                 "rank": a.rank, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                 "requests_per_client": a.requests, "engine": a.engine,
                 "cuda_graphs": graphs, "keep_dequantized": a.keep_dequantized,
                 "triton_dequant": os.environ.get("QUANTMESH_TRITON_DEQUANT", ""),
                 "mma": os.environ.get("QUANTMESH_MMA", ""),
                 "gemv": os.environ.get("QUANTMESH_GEMV", ""),
                 "server_start_s": start_s,
                 "max_model_len": a.max_model_len, "phases": []}  # fmt: skip
    tag = "_dense" if a.keep_dequantized else ""
    tag += "_mma" if os.environ.get("QUANTMESH_MMA") == "1" else ""
    tag += "_tdq" if os.environ.get("QUANTMESH_TRITON_DEQUANT") == "1" else ""
    path = out / f"result_serve_{a.shape}_{a.quant}_tp{a.tp}_{a.engine}_{graphs}{tag}.json"
    path.write_text(json.dumps(res, indent=1))  # the start's time, should a phase be cut off
    try:
        log(f"server {url} started in {start_s:.0f} s; warm-up")
        for name in names:
            t0 = time.perf_counter()
            # the phases' prompt length: the first prefill of a shape pays one-off costs
            prompt = " ".join(f"w{i + 1}" for i in range(a.prompt_tokens))
            complete(url, {"model": name, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            log(f"warm-up request ({name}): {time.perf_counter() - t0:.1f} s")
        for mix in a.mixes.split(","):
            for conc in concs:
                r = phase(a, url, names, conc, mix == "mixed")
                log(json.dumps(r))
                res["phases"].append(r)
                path.write_text(json.dumps(res, indent=1))
        by = {(p["mix"], p["concurrency"]): p["tokens_per_s"] for p in res["phases"]}
        lo, hi = min(concs), max(concs)
        if ("single", lo) in by and ("single", hi) in by:
            res["scaling_hi_over_lo"] = by[("single", hi)] / by[("single", lo)]
        if ("single", hi) in by and ("mixed", hi) in by:
            res["mixed_over_single_at_hi"] = by[("mixed", hi)] / by[("single", hi)]
        path.write_text(json.dumps(res, indent=1))
        log(f"wrote {path}")
    finally:
        proc.terminate()
        proc.wait(120)
    return 0


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
