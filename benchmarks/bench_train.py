"""quantmesh LoRA training throughput for one layout (tp from --tp, dp = world size / tp).

The model is transformers' Llama built on meta, parallelized (TP + quantization + LoRA + DP) and
then filled with seeded random weights one tensor at a time: each rank draws the full tensor of one
parameter on its own device, keeps its slice and quantizes it there, so no device ever holds the
whole bf16 model. Training: bf16 autocast, AdamW on the LoRA parameters, `--warmup` + `--steps`
steps on a fixed random batch (the same on the ranks of a tp group, different per dp rank).

Reports tokens/s of the whole job (all dp replicas), peak GPU memory per rank, MFU against a matmul
peak (--peak-json from matmul_peak.py), the first losses, `quantmesh plan`'s memory estimate for the
layout, the tp collectives of one step; optionally (--check) the losses of a small model on this
mesh against a tp=1 fp32 CPU reference computed in the same process, (--profile) a GPU time
breakdown of two steps, (--variants) prototype speed-ups timed on the same model.

Usage:
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --tp 2 --quant nf4 --mb 2 --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --tp 1 --quant nf4 --mb 2 --out DIR
        (dp=2: dp is the world size over tp)
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --pp 2 --microbatches 8 --quant nf4 \
        --mb 8 --out DIR   (2 pipeline stages, 1F1B over 8 micro-batches of 1 row: qm.train_step)
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --smoke --tp 2 --check --out DIR
        (tiny shapes on 2 CPU ranks)
    torchrun --nproc-per-node 1 benchmarks/bench_train.py --quant nf4 --quant-backend torchao \
        --fsdp --mb 2 --out DIR   (FSDP2 on a 1-rank mesh; without --fsdp: the plain baseline)
Writes DIR/result_qm_<layout><tag>.json (rank 0); a failure is recorded there, not raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from quantmesh.config import PP_SCHEDULES
from quantmesh.quant.names import BACKENDS, QUANTS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmbench as qb  # noqa: E402

VARIANTS = (
    "default", "cuda_graphs", "pdl", "vp_ce", "triton_dequant", "keep_elementwise", "keep_dequantized", "fused_adamw", "lora_bf16", "inductor",
)  # fmt: skip


def split_variant(v: str) -> tuple[dict[str, str], list[str]]:
    """A variant's parts ({name: argument}) and its inductor options ("KEY=VALUE" of each
    "inductor:KEY=VALUE" part, checked against torch._inductor.config). Raises ValueError (or
    SystemExit for an inductor option) naming what is wrong."""
    parts: dict[str, str] = {}
    pairs: list[str] = []
    for part in v.split("+"):
        name, _, arg = part.partition(":")
        if name == "inductor" and "=" in arg:
            pairs.append(arg)
            continue
        if (
            name not in VARIANTS
            or name == "inductor"
            or (arg and (name != "keep_dequantized" or not arg.isdigit()))
        ):
            raise ValueError(
                f"unknown variant {part!r}; known: {', '.join(VARIANTS)} (keep_dequantized:K "
                "holds the first K layers' weights; inductor:KEY=VALUE compiles the blocks again "
                "with a torch._inductor.config option; join variants with '+' to time them "
                "together)"
            )
        if name in parts:
            raise ValueError(f"variant {v!r} names {name!r} twice")
        parts[name] = arg
    qb.inductor_options(pairs)
    return parts, pairs


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    qb.shape_args(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (qm.train_step schedules)")
    p.add_argument(
        "--microbatches", type=int, default=1, help="micro-batches per step (qm.train_step)"
    )
    # one stage per rank here (no PipelineConfig(virtual=...)): every schedule but interleaved
    p.add_argument(
        "--pp-schedule", default="1f1b", choices=[s for s in PP_SCHEDULES if s != "interleaved1f1b"]
    )
    p.add_argument("--quant", default="nf4", choices=QUANTS)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-autocast", action="store_true", help="no bf16 autocast (bf16 weights)")
    p.add_argument("--check", action="store_true", help="small-model losses vs a CPU reference")
    p.add_argument("--check-tol", type=float, default=2e-2, help="relative loss tolerance")
    p.add_argument(
        "--variants",
        default="",
        help="comma list of prototype speed-ups to time after the main run: "
        f"{','.join(VARIANTS)} (keep_dequantized:K: the first K layers' weights held; "
        "inductor:KEY=VALUE: the blocks compiled again with that torch._inductor.config option; "
        "a+b: timed together)",
    )
    p.add_argument("--variant-steps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="GPU time breakdown of 2 steps")
    p.add_argument(
        "--compile",
        action="store_true",
        help="qm.compile_blocks(model) before training (the compile happens in the warm-up steps)",
    )
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode for --compile (e.g. reduce-overhead: CUDA graphs of the blocks)",
    )
    p.add_argument(
        "--checkpointing", action="store_true", help="qm.checkpoint_blocks(model) before training"
    )
    p.add_argument("--offload", action="store_true", help="with --checkpointing: offload=True")
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        default=None,
        help="with --checkpointing: only N blocks recomputed (checkpoint_blocks(blocks=N))",
    )
    p.add_argument(
        "--tile-tokens",
        type=int,
        default=None,
        help="with --checkpointing: the MLP N tokens at a time",
    )
    p.add_argument(
        "--loss-chunk", type=int, default=0, help="qm.chunked_loss_sum with N tokens per chunk"
    )
    p.add_argument("--peak-json", default=None, help="matmul_peak.py's JSON, for MFU")
    p.add_argument(
        "--quant-backend", default=BACKENDS[0], choices=BACKENDS,
        help="library of the quantized base (torchao: the nf4 that --fsdp shards)",
    )  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="parallelize(fsdp=True): FSDP2 over dp")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) on CUDA")
    p.add_argument(
        "--offload-base", action="store_true", help="with --fsdp: the base's shards on the host"
    )
    a = qb.finish_args(p.parse_args(argv))
    for v in (v for v in a.variants.split(",") if v):  # every variant checked before anything runs
        try:
            split_variant(v)
        except ValueError as e:
            p.error(str(e))
    return a


def layout_name(a, dp: int) -> str:
    q = a.quant if a.quant != "none" else "bf16"
    pp = f"pp{a.pp}_{a.pp_schedule}_" if a.pp > 1 else ""
    m = f"m{a.microbatches}_" if a.microbatches > 1 else ""
    q += "_ao" if a.quant != "none" and a.quant_backend == "torchao" else ""
    name = f"tp{a.tp}_{pp}{m}dp{dp}_{q}_lora" + ("_compiled" if a.compile else "")
    name += ("_fsdp" if a.fsdp else "") + ("_offbase" if a.offload_base else "")
    name += ("_ckpt" if a.checkpointing else "") + ("_offload" if a.offload else "")
    name += f"_tile{a.tile_tokens}" if a.tile_tokens else ""
    name += f"_ckpt{a.checkpoint_blocks}" if a.checkpoint_blocks else ""
    name += "_fusedadamw" if a.fused_adamw else ""
    return name + (f"_chunk{a.loss_chunk}" if a.loss_chunk else "")


def build(a, mesh, cfg, *, dtype, gen_device=None):
    """Skeleton on meta -> parallelize (TP, quant, LoRA, DP) -> seeded random base weights."""
    import quantmesh as qm

    t0 = time.perf_counter()
    model = qb.skeleton(cfg)
    lora = qm.LoraConfig(r=a.lora_r, alpha=a.lora_alpha, dropout=0.0, targets=qb.TARGETS, seed=0)
    quant = quant_config(a)
    qm.parallelize(model, mesh, quant=quant, lora=lora, dtype=dtype, fsdp=a.fsdp,
                   offload_base=a.offload_base)  # fmt: skip
    t1 = time.perf_counter()
    info = qb.fill_random(model, seed=a.seed, gen_device=gen_device)
    if a.fsdp:  # filled outside load_checkpoint (which would shard it): shard it here
        from quantmesh.parallel.fsdp import apply_fsdp

        apply_fsdp(model, mesh, offload=a.offload_base)
    qb.sync(mesh.device)
    info["parallelize_s"] = round(t1 - t0, 2)
    model.train()
    return model, info


def quant_config(a):
    """The QuantConfig of --quant / --quant-backend (None for --quant none)."""
    import quantmesh as qm

    return None if a.quant == "none" else qm.QuantConfig(format=a.quant, backend=a.quant_backend)


def memory_estimate(a, mesh, cfg) -> dict:
    """`quantmesh plan`'s bytes per GPU for this layout (quantmesh.plan.memory), where it exists."""
    R: dict = {}
    with qb.record_errors(R):
        import quantmesh as qm
        from quantmesh.plan.memory import estimate_memory

        lora = qm.LoraConfig(r=a.lora_r, alpha=a.lora_alpha, targets=qb.TARGETS)
        est = estimate_memory(
            qb.skeleton(cfg), tp=mesh.tp, dp=mesh.dp, quant=quant_config(a),
            lora=lora, seq_len=a.seq, micro_batch=a.mb, dtype=torch.bfloat16, compiled=a.compile,
            checkpointing=a.checkpointing, offload_activations=a.offload,
            loss_chunk_tokens=a.loss_chunk, tile_tokens=a.tile_tokens, fsdp=a.fsdp,
            checkpointed_blocks=a.checkpoint_blocks,
            offload_base=a.offload_base,
        )  # fmt: skip
        R["total_GiB"] = round(est.total / 2**30, 3)
        R["parts_GiB"] = {
            k: round(getattr(est, k) / 2**30, 3)
            for k in ("weights", "lora", "grads", "optimizer", "ddp", "activations", "logits",
                      "transient", "gathered", "host")
        }  # fmt: skip
    return R


def batch(a, vocab: int, seq: int, rows: int, row0: int, device) -> torch.Tensor:
    """Rows [row0, row0 + rows) of a fixed random global batch (same on every tp rank)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (row0 + rows, seq), generator=g)
    return ids[row0:].to(device)


def hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def make_vp_loss(model, mesh):
    """Loss through vocab_parallel_ce: the head's logits stay split (no gather)."""
    from vocab_parallel_ce import vocab_parallel_cross_entropy

    head = model.lm_head
    ((start, _),) = head.split.ranges(head.tp_rank)

    def loss_fn(m, ids):
        logits = m(input_ids=ids).logits  # (B, T, V_local)
        return vocab_parallel_cross_entropy(
            logits[:, :-1], ids[:, 1:], start, mesh.tp_group if mesh.tp > 1 else None
        )

    return loss_fn


def pipelined(microbatches: int, schedule: str, chunk_tokens: int = 0):
    """A step through qm.train_step (pipelined at pp > 1; the chunked loss with `chunk_tokens` at
    pp = 1): forward and backward of `ids` in `microbatches` parts; returns the loss, already
    backpropagated (train() then skips backward)."""
    import quantmesh as qm

    def step(model, ids):
        return qm.train_step(
            model, {"input_ids": ids}, microbatches=microbatches, schedule=schedule,
            chunk_tokens=chunk_tokens,
        )  # fmt: skip

    step.backpropagated = True
    return step


def train(model, opt, ids, *, warmup, steps, device, autocast, loss_fn=hf_loss):
    """Run warmup + steps optimizer steps; returns (timed seconds, losses as floats).

    `train.warmup_s` holds the last call's warm-up wall time (it includes any compile)."""
    done = getattr(loss_fn, "backpropagated", False)  # qm.train_step ran backward already
    qb.reset_peaks(device)
    losses = []
    t0 = None
    tw = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            qb.sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            train.warmup_s = t0 - tw
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, ids)
        if not done:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no sync here: read at the end
    qb.sync(device)
    dt = time.perf_counter() - t0
    return dt, [round(float(x), 5) for x in losses]


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- the loss check: this mesh vs a tp=1 fp32 CPU reference, same seed ------------------------
CHECK_SHAPE = dict(layers=2, hidden=256, inter=512, heads=4, vocab=1024, seq=128, mb=2)
CHECK_SHAPE_SMOKE = dict(layers=2, hidden=64, inter=128, heads=4, vocab=256, seq=32, mb=2)
# SGD with momentum, not AdamW: Adam's first steps are sign-like (g / |g|), so a gradient element at
# rounding level would flip its whole step between the two sides and the check would test Adam
CHECK_STEPS, CHECK_LR = 4, 0.5


def local_cpu_mesh():
    """A world-size-1 view for the CPU reference inside a distributed job (tp=1 uses no group)."""
    import quantmesh as qm

    cpu = torch.device("cpu")
    return qm.Mesh(
        dp=1, pp=1, tp=1, rank=0, world_size=1, dp_rank=0, pp_rank=0, tp_rank=0,
        devices=[cpu], backend="gloo", device_mesh=None,
    )  # fmt: skip


def run_check(a, mesh, R):
    """Losses of CHECK_STEPS SGD steps on a small model: this mesh (bf16 autocast on its devices)
    against tp=1 fp32 on CPU (rank 0, same process, same seeded weights and global batch)."""
    shape = CHECK_SHAPE_SMOKE if a.smoke else CHECK_SHAPE
    s = SimpleNamespace(**{**vars(a), **shape, "lr": CHECK_LR})
    cfg = qb.llama_config(s)
    dev = mesh.device
    t0 = time.perf_counter()
    # weights drawn on CPU by both sides, rounded to bf16: identical values before quantization
    model, _ = build(s, mesh, cfg, dtype=torch.bfloat16, gen_device="cpu")
    if a.compile:  # the compiled blocks are what the check is about
        import quantmesh as qm

        qm.compile_blocks(model)
    ids = batch(s, s.vocab, s.seq, s.mb, mesh.dp_rank * s.mb, dev)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=s.lr, momentum=0.9)
    losses = []
    for _ in range(CHECK_STEPS):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = hf_loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = loss.detach().float().reshape(1)
        if mesh.dp > 1:  # equal token counts per replica: the global loss is the mean
            dist.all_reduce(lt, group=mesh.dp_group)
            lt /= mesh.dp
        losses.append(float(lt))
    del model, opt
    if a.compile:  # forget the small shapes: the big model must not be compiled as dynamic
        torch._dynamo.reset()
    R["mesh_losses"] = [round(x, 6) for x in losses]
    R["mesh_s"] = round(time.perf_counter() - t0, 2)
    if mesh.rank == 0:
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
        try:
            ref, _ = build(s, local_cpu_mesh(), cfg, dtype=torch.float32, gen_device="cpu")
            ids_all = batch(s, s.vocab, s.seq, s.mb * mesh.dp, 0, "cpu")
            opt = torch.optim.SGD(
                [p for p in ref.parameters() if p.requires_grad], lr=s.lr, momentum=0.9
            )
            ref_losses = []
            for _ in range(CHECK_STEPS):
                loss = hf_loss(ref, ids_all)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                ref_losses.append(float(loss.detach()))
        finally:
            torch.set_num_threads(threads)
        rel = [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses, strict=True)]
        R.update(
            compiled=a.compile,
            cpu_fp32_losses=[round(x, 6) for x in ref_losses],
            max_rel_diff=round(max(rel), 6),
            tol=a.check_tol,
            passed=max(rel) <= a.check_tol,
            cpu_s=round(time.perf_counter() - t0, 2),
            what=(
                f"{CHECK_STEPS} SGD steps (lr {CHECK_LR}, momentum 0.9) of a {s.layers}-layer "
                f"h={s.hidden} Llama, quant={a.quant}, LoRA r={a.lora_r}: this mesh (tp={mesh.tp}, "
                f"dp={mesh.dp}, {mesh.backend}, bf16 autocast) vs tp=1 fp32 on CPU, global batch "
                f"{mesh.dp * s.mb}x{s.seq}"
            ),
        )
        qb.log(f"check: mesh {R['mesh_losses']} cpu {R['cpu_fp32_losses']} rel {R['max_rel_diff']}")
    dist.barrier()


# ---- tp collectives of one step --------------------------------------------------------------
@contextlib.contextmanager
def counting_collectives(out: dict):
    """Count the Python-level collectives (quantmesh's tp ops) and their bytes; DDP's own bucket
    all-reduces run in C++ and are not seen here."""
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(n, fn):
        def counted(t, *args, **kwargs):
            ts = t if isinstance(t, (list, tuple)) else [t]
            c = out.setdefault(n, {"calls": 0, "MB": 0.0})
            c["calls"] += 1
            c["MB"] += sum(x.numel() * x.element_size() for x in ts) / 2**20
            return fn(t, *args, **kwargs)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield out
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        for c in out.values():
            c["MB"] = round(c["MB"], 1)


def collectives_per_step(model, opt, ids, device, autocast, loss_fn=None) -> dict:
    """The tp collectives of one forward + backward (no optimizer step) with the run's own loss
    (`loss_fn`, default the plain one: the chunked loss keeps long runs inside their memory)."""
    out: dict = {}
    with counting_collectives(out):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = (loss_fn or hf_loss)(model, ids)
        loss.backward()
    opt.zero_grad(set_to_none=True)
    qb.sync(device)
    return out


# ---- the GPU time breakdown -------------------------------------------------------------------
CATEGORIES = [
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("nf4_dequant", ("dequant", "kdequantize")),
    ("gemm", ("gemm", "cutlass", "sm90", "xmma", "matmul", "cublas", "nvjet", "splitk")),
    ("loss_softmax", ("softmax", "cross_entropy", "nll_loss", "log_softmax")),
    ("fused_triton", ("triton_",)),  # torch.compile's generated kernels (before copy/cast names)
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy_cast", ("copy", "cast", "to_copy", "cat", "fill")),
]


def profile_steps(model, opt, ids, device, autocast, loss_fn):
    """Two profiled steps: the share of GPU kernel time per category (kernels only; NCCL runs on
    its own stream, so the shares are of summed kernel time, which can exceed the wall time) and
    the op table. On CPU the same over self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    qb.sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(2):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(model, ids)
            if not getattr(loss_fn, "backpropagated", False):  # qm.train_step ran backward
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        qb.sync(device)
        wall = time.perf_counter() - t0
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = prof.key_averages()
    if cuda:  # kernel rows only: CPU ops report their kernels' time too (double counting), and
        # user annotations (the optimizer's step) span their kernels
        timed = [r for r in rows if qb.is_kernel(r)]
    else:
        timed = list(rows)
    shares = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    for r in timed:
        t = getattr(r, key, 0) or 0
        name = r.key.lower()
        cat = next((c for c, pats in CATEGORIES if any(p in name for p in pats)), "other")
        shares[cat] += t
    tot = sum(shares.values()) or 1
    table = rows.table(sort_by=key, row_limit=30, max_name_column_width=70)
    return {
        "wall_ms_per_step": round(wall / 2 * 1000, 2),
        "timed_ms_per_step": round(tot / 2 / 1000, 2),
        "time_key": key,
        "shares": {k: round(v / tot, 4) for k, v in shares.items()},
        "top_ops": table[-12000:],
    }


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    a = parse(argv)
    import quantmesh as qm

    R = {
        "bench": "train",
        "system": "quantmesh",
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "peak_json")},
        "flops_per_token": qb.flops_per_token(a),
        **qb.param_counts(a),
        "versions": qb.versions(),
        "ok": False,
    }
    t_start = time.time()
    mesh = qm.init_mesh(tp=a.tp, pp=a.pp, backend="gloo" if a.cpu else None)
    dev = mesh.device
    R.update(layout=layout_name(a, mesh.dp), tp=mesh.tp, dp=mesh.dp, gpus=mesh.world_size)
    R.update(pp=mesh.pp, microbatches=a.microbatches, pp_schedule=a.pp_schedule)
    if mesh.pp > 1:  # the theoretical bubble of one-stage-per-rank GPipe / 1F1B
        R["bubble_theory"] = round((mesh.pp - 1) / (a.microbatches + mesh.pp - 1), 4)
    R["tokens_per_step"] = mesh.dp * a.mb * a.seq
    out_path = os.path.join(a.out, f"result_qm_{R['layout']}{a.tag}.json")
    autocast = not a.no_autocast
    try:
        if a.check and (a.pp > 1 or a.microbatches > 1):
            raise ValueError("--check compares plain steps; run it without --pp/--microbatches")
        if a.check:
            R["check"] = {}
            with qb.record_errors(R["check"]):
                run_check(a, mesh, R["check"])
            if "error" in R["check"]:
                dist.barrier()
        cfg = qb.llama_config(a)
        model, R["build"] = build(a, mesh, cfg, dtype=torch.bfloat16)
        R["build"]["mem_after_build"] = qb.gpu_mem(dev)
        R["memory_estimate"] = (
            memory_estimate(a, mesh, cfg)
            if a.pp == 1
            else {"skipped": "estimate_memory knows nothing of pipeline stages yet"}
        )
        qb.log(f"built {R['layout']}: {R['build']}")
        params = qm.trainable_parameters(model)
        R["trainable_params_per_rank"] = sum(p.numel() for p in params)
        R["lora_dtype"] = sorted({str(p.dtype) for p in params})
        fused = a.fused_adamw and dev.type == "cuda"
        opt = torch.optim.AdamW(params, lr=a.lr, fused=fused or None)
        R["adamw"] = "fused" if fused else "default (foreach on CUDA)"
        ids = batch(a, a.vocab, a.seq, a.mb, mesh.dp_rank * a.mb, dev)
        R["compiled"] = a.compile
        loss_fn = hf_loss
        if a.checkpointing:
            R["checkpointed_blocks"] = qm.checkpoint_blocks(
                model, offload=a.offload, tile_tokens=a.tile_tokens, blocks=a.checkpoint_blocks
            )
        if a.loss_chunk:

            def loss_fn(m, ids, _n=a.loss_chunk):
                total, count = qm.chunked_loss_sum(m, ids, ids, chunk_tokens=_n)
                return total / count

        if a.pp > 1 or a.microbatches > 1:
            if a.loss_chunk or a.variants or a.profile:
                raise ValueError("--pp/--microbatches use qm.train_step's plain loss only")
            loss_fn = pipelined(a.microbatches, a.pp_schedule)
        if a.compile:
            R["compile_mode"] = a.compile_mode
            R["compiled_blocks"] = qm.compile_blocks(model, mode=a.compile_mode)
        dt, losses = train(
            model, opt, ids, warmup=a.warmup, steps=a.steps, device=dev, autocast=autocast,
            loss_fn=loss_fn,
        )  # fmt: skip
        R["warmup_s"] = round(train.warmup_s, 2)
        if a.compile:
            from torch._dynamo.utils import counters

            R["graph_breaks"] = {k: int(v) for k, v in counters["graph_break"].items()}
        dts = gather(dt)
        mems = gather(qb.gpu_mem(dev) or {"host_rss_anon_GiB": qb.rss_anon_bytes() / 2**30})
        if a.tile_tokens:  # which block children were proven position-wise and tiled
            R["tiled_children"] = model.get_decoder().layers[0].__dict__.get("_quantmesh_tiled")
        tok = R["tokens_per_step"] * a.steps / max(dts)
        R.update(
            tokens_per_s=round(tok, 1),
            tokens_per_s_per_gpu=round(tok / mesh.world_size, 1),
            step_s=round(max(dts) / a.steps, 4),
            rank_times=[round(x, 3) for x in dts],
            losses_first=losses[: min(5, len(losses))],
            loss_last=losses[-1],
            mem={str(r): m for r, m in enumerate(mems)},
        )
        qb.log(f"{R['layout']}: {tok:,.0f} tokens/s, step {R['step_s']} s, mem {mems[0]}")
        if a.peak_json and os.path.exists(a.peak_json):
            with open(a.peak_json) as f:
                peak = json.load(f)
            R["matmul_peak"] = peak.get("summary")
            for kind in ("burst", "sustained"):
                tf = (peak.get("summary") or {}).get(f"{kind}_tflops")
                if tf:
                    R[f"mfu_vs_{kind}"] = round(
                        tok * R["flops_per_token"] / (mesh.world_size * tf * 1e12), 4
                    )
        R["ok"] = True
        if mesh.rank == 0:  # a first copy, in case the profile or a variant hangs
            qb.write_json(out_path, R)

        R["tp_collectives_per_step"] = {}
        if a.compile:  # compiled blocks call functional collectives: nothing to count here
            R["tp_collectives_per_step"] = {"skipped": "compiled blocks (functional collectives)"}
        elif a.pp > 1:
            R["tp_collectives_per_step"] = {"skipped": "pp > 1 (the stages run through train_step)"}
        else:
            with qb.record_errors(R["tp_collectives_per_step"]):
                R["tp_collectives_per_step"] = collectives_per_step(
                    model, opt, ids, dev, autocast, loss_fn
                )
        if a.profile:
            R["profile"] = {}
            with qb.record_errors(R["profile"]):
                R["profile"] = profile_steps(model, opt, ids, dev, autocast, hf_loss)
                if mesh.rank == 0:
                    qb.log("profile shares", R["profile"]["shares"])
            if mesh.rank == 0:
                qb.write_json(out_path, R)
            dist.barrier()

        # ---- prototype speed-ups, timed on the same model ----
        wanted = [v for v in a.variants.split(",") if v]
        if wanted:
            R["variants"] = {}
            for v in wanted:
                key, n = v, 1
                while key in R["variants"]:  # a variant named again: timed again, kept apart
                    n += 1
                    key = f"{v}#{n}"
                V = R["variants"][key] = {}
                with qb.record_errors(V):
                    run_variant(v, a, mesh, model, params, ids, autocast, V)
                if mesh.rank == 0:  # each variant kept as it ends (a later one may hang)
                    qb.write_json(out_path, R)
                dist.barrier()
                if "lora_bf16" in v.split("+"):
                    break  # it changes the model: nothing may follow it
    except Exception as e:
        R["ok"] = False
        R["error"] = f"{type(e).__name__}: {e}"[:2000]
        import traceback

        R["traceback"] = traceback.format_exc()[-4000:]
        qb.log("FAILED", R["error"])
        print(R["traceback"], flush=True)
        if dev.type == "cuda":
            R["mem_at_error"] = qb.gpu_mem(dev)
    R["wall_s"] = round(time.time() - t_start, 1)
    if mesh.rank == 0:
        qb.write_json(out_path, R)
        short = {k: R.get(k) for k in ("layout", "ok", "tokens_per_s", "mfu_vs_burst", "error")}
        qb.log("RESULT", json.dumps(short, default=str))
    dist.destroy_process_group()
    return 0 if R["ok"] else 1


def run_variant(v, a, mesh, model, params, ids, autocast, V):
    """Time one prototype on the model already built: `default` changes nothing (the main run's
    configuration timed as a variant is, beside the others, the measure of their noise); `vp_ce` keeps the head's logits split and
    uses vocab_parallel_ce.py (tp > 1); `triton_dequant` turns on quantmesh's Triton dequantize in
    the 4-bit linears' forward and backward (kernel4.DEQUANT_ENABLED; compiled blocks compile
    again); `keep_elementwise` compiles the blocks again with `recompute_elementwise=False` (torch's
    own partitioner rules: the norms' outputs, SiLU(gate) * up and the adapters' bf16 weight copies
    kept, not recomputed in backward; --compile only), then back; `cuda_graphs` compiles them again
    in mode "reduce-overhead" (each block's forward and backward replayed from CUDA graphs; --compile
    on a GPU), then back; `pdl` compiles them again with inductor's programmatic dependent launch
    (`torch._inductor.config.triton.enable_pdl`: a Hopper kernel may start while the one before it
    ends; --compile on a GPU), then back; `keep_dequantized` holds the
    4-bit weights dequantized in bf16 (`qm.keep_dequantized`: no dequantization in any matmul, for
    about 4x the codes' memory; nf4/fp4 only; `keep_dequantized:K`: the first K decoder layers'
    alone), then drops them; `fused_adamw` steps a fresh AdamW(fused=True) (one kernel for every
    parameter, where the default runs a multi-tensor kernel per arithmetic step); `lora_bf16` casts
    the adapters
    to bf16, which measures what the fp32 adapters' input casts cost (dp = 1 only: DDP's buckets
    are built for fp32). A variant's peak memory includes the main run's AdamW states, which stay
    alive beside the variant's own (2 x 4 bytes per adapter parameter). Variants joined by '+'
    (`triton_dequant+fused_adamw`) are timed together."""
    dev = mesh.device
    parts, pairs = split_variant(v)
    if pairs:
        parts["inductor"] = ",".join(pairs)
    if "lora_bf16" in parts and len(parts) > 1:
        raise ValueError("lora_bf16 changes the model: time it alone, last")
    held_blocks = int(parts["keep_dequantized"]) if parts.get("keep_dequantized") else None
    import torch._inductor.config as inductor_config

    from quantmesh.config import compile_options

    skipped = {
        "vp_ce": "needs tp > 1" if mesh.tp == 1 else None,
        "keep_elementwise": "needs --compile" if not a.compile else None,
        "cuda_graphs": "needs --compile on a GPU" if not a.compile or dev.type != "cuda" else None,
        "pdl": "needs --compile on a GPU"
        if not a.compile or dev.type != "cuda"
        else "this torch's inductor has no triton.enable_pdl"
        if not hasattr(inductor_config.triton, "enable_pdl")
        else None,
        "keep_dequantized": "needs --quant nf4 or fp4 (bitsandbytes)"
        if a.quant not in ("nf4", "fp4") or a.quant_backend != "bitsandbytes"
        else None,
        "lora_bf16": "changes parameter dtypes under DDP" if mesh.dp > 1 else None,
        "inductor": "needs --compile"
        if not a.compile
        else f"the blocks compile with {backend!r}, which reads no inductor option"
        if (backend := compile_options()["backend"]) != "inductor"
        else None,
    }
    for name in parts:
        if skipped.get(name):
            V["skipped"] = f"{name}: {skipped[name]}"
            return
    loss_fn = hf_loss
    head_style = getattr(model.lm_head, "style", None)
    if "vp_ce" in parts:
        loss_fn = make_vp_loss(model, mesh)
        model.lm_head.style = "colwise"  # keep the logits split
    if "lora_bf16" in parts:
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    from quantmesh.quant import kernel4

    dequant_before = kernel4.DEQUANT_ENABLED
    if "triton_dequant" in parts:
        kernel4.DEQUANT_ENABLED = True
    recompiled = {"keep_elementwise", "cuda_graphs", "pdl", "inductor"} & parts.keys()
    if "pdl" in parts:  # inductor's option, by name
        pairs = [*pairs, "triton.enable_pdl=True"]
    patched = contextlib.ExitStack()
    patched.enter_context(qb.inductor_patched(pairs))  # given back before the blocks compile back
    if recompiled:
        kw: dict = {"recompute_elementwise": False} if "keep_elementwise" in parts else {}
        recompile_blocks(model, a, mode="reduce-overhead" if "cuda_graphs" in parts else None, **kw)
    if "keep_dequantized" in parts:
        import quantmesh as qm

        cd = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the 4-bit compute dtype
        held = qm.keep_dequantized(model, cd, blocks=held_blocks)
        V["held_GiB"], V["held_bytes"] = round(held / 2**30, 3), held
    try:
        fused = "fused_adamw" in parts
        opt = torch.optim.AdamW(params, lr=a.lr, fused=True if fused else None)
        V["adamw"] = "fused" if fused else "default (foreach on CUDA)"
        warm = min(3, a.warmup)
        dt, losses = train(
            model, opt, ids, warmup=warm, steps=a.variant_steps, device=dev, autocast=autocast,
            loss_fn=loss_fn,
        )  # fmt: skip
    finally:
        kernel4.DEQUANT_ENABLED = dequant_before
        patched.close()
        if recompiled:
            recompile_blocks(model, a)
        if "keep_dequantized" in parts:
            import quantmesh as qm

            qm.keep_dequantized(model, None)
        if head_style is not None:
            model.lm_head.style = head_style
    dts = gather(dt)
    mems = gather(qb.gpu_mem(dev))
    tok = mesh.dp * a.mb * a.seq * a.variant_steps / max(dts)
    V.update(
        tokens_per_s=round(tok, 1),
        step_s=round(max(dts) / a.variant_steps, 4),
        losses_first=losses[:3],
        mem={str(r): m for r, m in enumerate(mems)},
    )
    if not all(math.isfinite(x) for x in losses):
        V["warning"] = "non-finite loss"
    qb.log(f"variant {v}: {tok:,.0f} tokens/s")


def recompile_blocks(model, a, mode=None, **kw):
    """Compile the blocks again from scratch (in `mode`, default --compile-mode): dynamo's caches
    are cleared first, or an equal torch.compile of the same code would reuse the graphs (and the
    partitioner's choices) already made."""
    import quantmesh as qm

    torch._dynamo.reset()
    qm.compile_blocks(model, mode=mode or a.compile_mode, **kw)


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
