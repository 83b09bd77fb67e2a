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
without it everything is fp32 (a = 4). `--tp 2` runs on 2 gloo ranks (rank 0 reports); `--dp 2`
replicates over more (DDP).

`--compile` compiles the blocks (`qm.compile_blocks`, inductor) and compares with
`estimate_memory(compiled=True)`. The hooks still count what the blocks keep: a compiled block is
one autograd Function whose forward saves, through `save_for_backward`, what the min-cut partitioner
chose (the hooks cannot see inside the graph, and need not). `--graphs` prints, for each compiled
graph, the forward outputs beyond the user outputs as the partitioner returned them (the saved
activations, by name, shape and dtype; parameters and the adapters' bf16 weight copies left out).
Under DDP, dynamo splits each compiled block at DDP's bucket boundaries (by gradient bytes); the
scaled model's adapters are `--ddp-bucket-scale` (default 8 / `--width`: 7B's h 4096 over h) times
smaller than 7B's, so the caps are divided by it to split where 7B's blocks are split. `--width 2`
doubles the widths (h 1024, i 2752, 8 heads of 128, vocab 8000: the same proportions).

Usage:
    python benchmarks/memory_probe.py --autocast --by-shape
    python benchmarks/memory_probe.py --tp 2 --autocast
    python benchmarks/memory_probe.py --dropout 0.1
    python benchmarks/memory_probe.py --autocast --compile --graphs
    python benchmarks/memory_probe.py --autocast --compile --dp 2
    python benchmarks/memory_probe.py --autocast --compile --keep-elementwise
"""

from __future__ import annotations

import argparse
import json
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


def record_partitions(graphs: list, ddp_bucket_scale: float) -> None:
    """Make inductor's partitioner append, per compiled graph, the saved activations it returns
    from the forward; divide the DDPOptimizer's bucket caps by `ddp_bucket_scale`."""
    import torch._inductor.compile_fx as cfx

    orig = cfx.min_cut_rematerialization_partition

    def partition(joint, inputs, *a, num_fwd_outputs: int, **kw):
        fw, bw = orig(joint, inputs, *a, num_fwd_outputs=num_fwd_outputs, **kw)
        (out,) = fw.graph.find_nodes(op="output")
        saved = []
        for n in out.args[0][num_fwd_outputs:]:
            v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() < 3 and (
                n.op == "placeholder" or n.target == torch.ops.aten.permute.default
            ):
                continue  # parameters, quant states; the adapters' bf16 weight copies (transposed)
            nbytes = v.numel() * v.element_size()
            saved.append((n.name, tuple(v.shape), str(v.dtype).removeprefix("torch."), nbytes))
        graphs.append(saved)
        return fw, bw

    cfx.min_cut_rematerialization_partition = partition
    if ddp_bucket_scale != 1:
        import torch.distributed as dist
        from torch._dynamo.backends.distributed import DDPOptimizer

        init = DDPOptimizer.__init__

        def scaled(self, bucket_bytes_cap, backend_compile_fn, first_bucket_cap=None):
            init(self, int(bucket_bytes_cap / ddp_bucket_scale), backend_compile_fn)

        DDPOptimizer.__init__ = scaled
        # DDP's first bucket: read by DDP, DDPOptimizer and estimate_memory alike
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(dist._DEFAULT_FIRST_BUCKET_BYTES / ddp_bucket_scale)


def probe(rank: int, args: dict) -> dict:
    import quantmesh as qm
    from quantmesh.plan.memory import estimate_memory

    cfg = dict(SHAPE, **args["cfg"])
    autocast = args["autocast"]
    dtype = torch.bfloat16 if autocast else torch.float32
    quant = None if args["quant"] == "none" else args["quant"]
    graphs: list = []
    if args["compile"]:
        record_partitions(graphs, args["ddp_bucket_scale"])
    model, lora = build(cfg, args["tp"], quant, args["r"], args["dropout"], dtype)
    if args["compile"]:
        qm.compile_blocks(model, recompute_elementwise=not args["keep_elementwise"])
    seq, mb = args["seq"], args["mb"]
    ids = torch.randint(0, cfg["vocab_size"], (mb, seq), generator=torch.Generator().manual_seed(0))

    def step(saved: SavedBytes | None, body_only: bool):
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
            if saved is not None
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
            if body_only and args["dp"] > 1:  # through DDP's hooks on the root (see --compile)
                return model(input_ids=ids).logits  # no labels: the head saves nothing
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

        from quantmesh.testing import cpu_peak_bytes

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = step(None, body_only=False)
            loss.backward()
            del loss
        peak = cpu_peak_bytes(prof)
        model.zero_grad(set_to_none=True)

    meta = _meta(cfg)
    est = estimate_memory(
        meta, tp=args["tp"], dp=args["dp"], quant=quant, lora=lora, seq_len=seq, micro_batch=mb,
        dtype=dtype, compiled=args["compile"], recompute_elementwise=not args["keep_elementwise"],
    )  # fmt: skip
    res = {
        "rank": rank,
        "saved_body": body.total,
        "saved_step": whole.total,
        "est_activations": est.activations,
        "est_logits": est.logits,
        "peak_step": peak,
        "logits_elems": mb * seq * cfg["vocab_size"],
        "notes": est.notes,
    }
    if args["graphs"]:
        res["graphs"] = graphs
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
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (DDP)")
    p.add_argument("--compile", action="store_true", help="qm.compile_blocks (inductor)")
    p.add_argument("--graphs", action="store_true", help="saved activations of each compiled graph")
    p.add_argument(
        "--keep-elementwise",
        action="store_true",
        help="with --compile: compile_blocks(recompute_elementwise=False), torch's partitioner rule",
    )
    p.add_argument("--ddp-bucket-scale", type=float, help="divide DDP's bucket caps (8 / width)")
    p.add_argument("--width", type=int, default=1, help="hidden, MLP width, heads and vocab times")
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
        "cfg": {
            "num_hidden_layers": a.layers,
            **{k: SHAPE[k] * a.width for k in ("hidden_size", "intermediate_size", "vocab_size")},
            **{k: SHAPE[k] * a.width for k in ("num_attention_heads", "num_key_value_heads")},
        },
        "tp": a.tp,
        "dp": a.dp,
        "compile": a.compile,
        "keep_elementwise": a.keep_elementwise,
        "graphs": a.graphs,
        "ddp_bucket_scale": a.ddp_bucket_scale or 8 / a.width,
        "quant": a.quant,
        "autocast": a.autocast,
        "r": a.r,
        "dropout": a.dropout,
        "seq": a.seq,
        "mb": a.mb,
        "peak": not a.no_peak,
        "by_shape": a.by_shape,
    }
    if a.tp * a.dp == 1:
        res = [probe(0, args)]
    else:
        from quantmesh.testing import run_ranks

        res = run_ranks(probe, a.tp * a.dp, args, timeout=900)
    r0 = res[0]
    by_shape = r0.pop("by_shape", None)
    extra = r0.pop("by_shape_step_extra", None)
    graphs = r0.pop("graphs", None)
    for r in res[1:]:
        r.pop("graphs", None)
    print(json.dumps(res, indent=1))
    for k, g in enumerate(graphs or []):
        print(f"compiled graph {k}: saves {sum(x[-1] for x in g):,} B of activations")
        for name, shape, dt, n in g:
            print(f"  {n:>12,}  {shape} {dt}  ({name})")
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
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
