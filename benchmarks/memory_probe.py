"""What one LoRA training step really holds, on CPU: saved tensors and the peak, against the estimate.

Builds transformers' Llama at small shapes, parallelizes it with quantmesh (nf4 base, LoRA on every
linear) and runs one forward + loss + backward. It reports:

  saved     the bytes autograd keeps for backward (every tensor packed by a saved-tensors hook,
            counted once per storage, parameters and buffers excluded), for the model body and for
            the whole step (body + head + loss), next to `estimate_memory`'s `activations`;
  peak      the highest live CPU bytes above the step's start, read from the profiler's memory
            events (alloc/free of every tensor), next to `activations + logits`;
  by shape  the saved bytes grouped by shape and dtype (--by-shape).

`--autocast` runs under torch.autocast("cpu", bf16) with bf16 weights (the GPU recipe: a = 2);
without it everything is fp32 (a = 4). `--tp 2` runs on 2 gloo ranks (rank 0 reports).

Usage:
    python benchmarks/memory_probe.py --autocast --by-shape
    python benchmarks/memory_probe.py --tp 2 --autocast
    python benchmarks/memory_probe.py --dropout 0.1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

SHAPE = dict(  # Llama-2-7B's proportions, scaled down: h 512, i 1376, 4 heads of 128
    vocab_size=4000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def build(cfg: dict, tp: int, quant, r: int, dropout: float, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm

    mesh = qm.init_mesh(tp=tp)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    lora = qm.LoraConfig(r=r, alpha=2 * r, dropout=dropout)
    qm.parallelize(model, mesh, quant=quant, lora=lora, dtype=dtype)
    model.train()
    return model, lora


class SavedBytes:
    """Storages packed for backward (not parameters or buffers): bytes in total and by shape."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.bytes: dict[int, int] = {}
        self.by_shape: dict[str, int] = defaultdict(int)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.own and ptr not in self.bytes:
            self.bytes[ptr] = st.nbytes()
            self.by_shape[f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += st.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def cpu_peak(prof) -> int:
    """Highest sum of CPU allocations minus frees, in event order, over the profiled region."""
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type().name == "CPU":
            events.append((e.start_ns(), e.nbytes()))
    live = peak = 0
    for _, n in sorted(events):
        live += n
        peak = max(peak, live)
    return peak


def probe(rank: int, args: dict) -> dict:
    from quantmesh.memory import estimate_memory

    cfg = dict(SHAPE, **args["cfg"])
    autocast = args["autocast"]
    dtype = torch.bfloat16 if autocast else torch.float32
    quant = None if args["quant"] == "none" else args["quant"]
    model, lora = build(cfg, args["tp"], quant, args["r"], args["dropout"], dtype)
    seq, mb = args["seq"], args["mb"]
    ids = torch.randint(0, cfg["vocab_size"], (mb, seq), generator=torch.Generator().manual_seed(0))

    def step(saved: SavedBytes | None, body_only: bool):
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
            if saved is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
            if body_only:
                return model.model(input_ids=ids).last_hidden_state
            return model(input_ids=ids, labels=ids).loss

    body = SavedBytes(model)
    out = step(body, body_only=True)
    del out
    whole = SavedBytes(model)
    loss = step(whole, body_only=False)
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)

    peak = None
    if args["peak"]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = step(None, body_only=False)
            loss.backward()
            del loss
        peak = cpu_peak(prof)
        model.zero_grad(set_to_none=True)

    meta = _meta(cfg)
    est = estimate_memory(
        meta, tp=args["tp"], quant=quant, lora=lora, seq_len=seq, micro_batch=mb, dtype=dtype
    )
    res = {
        "rank": rank,
        "saved_body": body.total,
        "saved_step": whole.total,
        "est_activations": est.activations,
        "est_logits": est.logits,
        "peak_step": peak,
        "logits_elems": mb * seq * cfg["vocab_size"],
    }
    if args["by_shape"]:
        res["by_shape"] = dict(sorted(body.by_shape.items(), key=lambda kv: -kv[1]))
        res["by_shape_step_extra"] = {
            k: v - body.by_shape.get(k, 0)
            for k, v in whole.by_shape.items()
            if v != body.by_shape.get(k)
        }
    return res


def _meta(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        return LlamaForCausalLM(LlamaConfig(**cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quant", default="nf4", choices=["nf4", "int8", "none"])
    p.add_argument("--autocast", action="store_true", help="bf16 autocast, bf16 weights (a = 2)")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mb", type=int, default=2)
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--no-peak", action="store_true", help="skip the profiled peak")
    p.add_argument("--by-shape", action="store_true", help="saved bytes by shape and dtype")
    a = p.parse_args(argv)
    args = {
        "cfg": {"num_hidden_layers": a.layers},
        "tp": a.tp,
        "quant": a.quant,
        "autocast": a.autocast,
        "r": a.r,
        "dropout": a.dropout,
        "seq": a.seq,
        "mb": a.mb,
        "peak": not a.no_peak,
        "by_shape": a.by_shape,
    }
    if a.tp == 1:
        res = [probe(0, args)]
    else:
        from quantmesh.testing import run_ranks

        res = run_ranks(probe, a.tp, args, timeout=600)
    r0 = res[0]
    by_shape = r0.pop("by_shape", None)
    extra = r0.pop("by_shape_step_extra", None)
    print(json.dumps(res, indent=1))
    est_body = r0["est_activations"]
    print(
        f"saved body {r0['saved_body']:,} B; estimate {est_body:,} B ({est_body / r0['saved_body']:.3f}x)"
    )
    if r0["peak_step"] is not None:
        est = r0["est_activations"] + r0["est_logits"]
        print(
            f"peak above start {r0['peak_step']:,} B; activations + logits {est:,} B "
            f"({est / r0['peak_step']:.3f}x); peak - saved body = "
            f"{(r0['peak_step'] - r0['saved_body']) / r0['logits_elems']:.2f} B per logit"
        )
    if by_shape:
        print("saved by shape (body):")
        for k, v in by_shape.items():
            print(f"  {v:>12,}  {k}")
        print("saved by shape (head + loss, beyond the body):")
        for k, v in (extra or {}).items():
            print(f"  {v:>12,}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
