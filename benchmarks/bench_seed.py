"""The seed scenario: 8-bit (or nf4) base + LoRA, data-parallel replicas, on 4 GPUs.

One layout per run, started by torchrun (or `quantmesh run --nproc N`):

    --layout split   init_mesh(dp=-1, devices_per_rank=2): every rank's replica is split over its
                     own 2 devices (in-process layer split), DDP over the replicas
    --layout tp      init_mesh(tp=2, dp=-1): tp=2 groups, dp = world size / 2
    --layout dp      init_mesh(dp=-1): one whole replica per device

The model is built on meta (qm.empty_model), parallelized with the quantized base and LoRA, and
filled with seeded random weights one tensor at a time on the devices (benchmarks/qmbench.py's
fill_random, as bench_train.py does). --model opt is transformers' OPTForCausalLM in OPT-6.7B's
shape (hidden 4096, 32 layers, 32 heads, ffn 16384, vocabulary 50272, tied head) with LoRA r=16 on
q_proj and v_proj; --model llama7b is Llama-2-7B's shape with LoRA on every projection. Training:
bf16 autocast on CUDA (fp32 on CPU unless --autocast on), AdamW on the adapters, `--warmup` +
`--steps` steps on a fixed random batch.

Reports tokens/s of the job (all replicas), peak memory of every device of every rank
(torch.cuda.max_memory_allocated; host RssAnon on CPU), `quantmesh plan`'s estimate, and the
losses of a small model of the same family on this layout against a tp=1 fp32 CPU reference
computed in the same process (as bench_train.py --check).

--layout accelerate: the peers' fallback, one process (no torchrun): transformers + bitsandbytes
(Linear8bitLt / Linear4bit) + peft LoRA, dispatched by accelerate's dispatch_model over every
visible GPU (--peer-devices N for fewer), the same seeded weights, batch and steps.

--accelerate-refusal: instead of training, a tiny OPT loaded in 8-bit with peft LoRA on q/v, its
layers spread over 2 devices of the rank the way accelerate's dispatch records it, and handed to
accelerate's Accelerator().prepare on every rank; the exceptions are recorded verbatim.

Usage (a 4-GPU host):
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_seed.py --layout split --out DIR
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_seed.py --layout tp --out DIR
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_seed.py --layout dp --out DIR
    python benchmarks/bench_seed.py --layout accelerate --out DIR
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_seed.py --accelerate-refusal --out DIR
CPU ranks (gloo), tiny shapes: add --smoke (a shape flag given with it still wins). Writes DIR/result_seed_<name>.json (rank 0); a
failure is recorded there, not raised.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402
import qmbench as qb  # noqa: E402

OPT_TARGETS = ["q_proj", "v_proj"]
MODELS = {
    # OPT-6.7B: hidden 4096, 32 layers, 32 heads, ffn 16384, vocabulary 50272, head tied
    "opt": dict(layers=32, hidden=4096, heads=32, inter=16384, vocab=50272),
    # Llama-2-7B: hidden 4096, 32 layers, 32 heads (no grouped KV), 11008, vocabulary 32000
    "llama7b": dict(layers=32, hidden=4096, heads=32, inter=11008, vocab=32000),
}
RUN = dict(seq=2048, mb=2, warmup=5, steps=10)
SMOKE = dict(layers=2, hidden=128, heads=4, inter=256, vocab=512, seq=64, mb=1, warmup=1, steps=2)
CHECK_SHAPE = dict(layers=2, hidden=256, heads=4, inter=1024, vocab=1024, seq=128, mb=2)
CHECK_SHAPE_SMOKE = dict(layers=2, hidden=64, heads=4, inter=128, vocab=256, seq=32, mb=2)
# SGD with momentum for the check, as bench_train.py (AdamW's first steps are sign-like)
CHECK_STEPS, CHECK_LR = 4, 0.5


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layout", choices=["split", "tp", "dp", "accelerate"], default="split")
    p.add_argument(
        "--peer-devices", type=int, default=0,
        help="--layout accelerate: devices to dispatch over (default: every visible GPU)",
    )  # fmt: skip
    p.add_argument("--quant", choices=["int8", "nf4"], default="int8")
    p.add_argument("--model", choices=sorted(MODELS), default="opt")
    for k in ("layers", "hidden", "heads", "inter", "vocab"):
        p.add_argument(f"--{k}", type=int, default=None, help="override the model's shape")
    p.add_argument("--seq", type=int, default=None, help=f"default {RUN['seq']}")
    p.add_argument("--mb", type=int, default=None, help="micro-batch per data-parallel replica")
    p.add_argument("--warmup", type=int, default=None, help=f"default {RUN['warmup']}")
    p.add_argument("--steps", type=int, default=None, help=f"timed steps, default {RUN['steps']}")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--autocast", choices=["auto", "on", "off"], default="auto",
        help="bf16 autocast; auto = on for CUDA, off (fp32) on CPU ranks",
    )  # fmt: skip
    p.add_argument("--no-check", action="store_true", help="skip the small-model loss check")
    p.add_argument("--check-tol", type=float, default=2e-2, help="relative loss tolerance")
    p.add_argument("--accelerate-refusal", action="store_true", help="record accelerate's refusal")
    p.add_argument("--cpu", action="store_true", help="CPU ranks (gloo)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU ranks (implies --cpu)")
    p.add_argument("--out", default=".", help="folder for the result JSON")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    a = p.parse_args(argv)
    # a flag given wins, then the smoke shape, then the model's shape and the run defaults
    a.cpu = a.cpu or a.smoke
    defaults = {**MODELS[a.model], **RUN, **(SMOKE if a.smoke else {})}
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.targets = OPT_TARGETS if a.model == "opt" else list(qb.TARGETS)
    return a


# ---- the model --------------------------------------------------------------------------------
def model_config(s):
    """transformers config of the family `s.model` at the shape in `s` (no cache, SDPA)."""
    if s.model == "llama7b":
        return qb.llama_config(s)
    from transformers import OPTConfig

    cfg = OPTConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, ffn_dim=s.inter, word_embed_proj_dim=s.hidden,
        max_position_embeddings=max(2048, s.seq), do_layer_norm_before=True, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, use_cache=False,
        tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def skeleton(s, cfg):
    if s.model == "llama7b":
        return qb.skeleton(cfg)
    from transformers import OPTForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        model = OPTForCausalLM(cfg)
    model.config.use_cache = False
    return model


def build(s, mesh, cfg, *, dtype, gen_device=None):
    """Skeleton on meta -> parallelize (layout, quant, LoRA, DP) -> seeded random base weights."""
    import quantmesh as qm

    t0 = time.perf_counter()
    model = skeleton(s, cfg)
    lora = qm.LoraConfig(r=s.lora_r, alpha=s.lora_alpha, dropout=0.0, targets=s.targets, seed=0)
    qm.parallelize(model, mesh, quant=s.quant, lora=lora, dtype=dtype)
    t1 = time.perf_counter()
    info = qb.fill_random(model, seed=s.seed, gen_device=gen_device)
    with torch.no_grad():  # fill_random gives every 1-D "norm" tensor ones; LayerNorm biases: 0
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.bias is not None:
                m.bias.zero_()
    for d in set(mesh.devices):
        qb.sync(d)
    info["parallelize_s"] = round(t1 - t0, 2)
    model.train()
    return model, info


def placement(model) -> dict[str, list[int]]:
    """{device: the decoder blocks whose weights live there}."""
    inner = model.model
    blocks = inner.decoder.layers if hasattr(inner, "decoder") else inner.layers
    out: dict[str, list[int]] = {}
    for i, b in enumerate(blocks):
        out.setdefault(str(next(b.parameters()).device), []).append(i)
    return out


def make_mesh(a):
    import quantmesh as qm

    backend = "gloo" if a.cpu else None
    if a.layout == "accelerate" and not a.accelerate_refusal:
        return qm.init_mesh(dp=1, backend="gloo")  # one process; the mesh only holds a group
    if a.accelerate_refusal or a.layout == "split":
        return qm.init_mesh(dp=-1, devices_per_rank=2, backend=backend)
    if a.layout == "tp":
        return qm.init_mesh(tp=2, dp=-1, backend=backend)
    return qm.init_mesh(dp=-1, backend=backend)


def use_autocast(a, device) -> bool:
    return a.autocast == "on" or (a.autocast == "auto" and torch.device(device).type == "cuda")


def unique(devices) -> list[torch.device]:
    out: list[torch.device] = []
    for d in devices:
        if torch.device(d) not in out:
            out.append(torch.device(d))
    return out


def device_memory(devices) -> dict:
    """Peak memory of each of this rank's devices; host RssAnon on CPU ranks."""
    mems = {str(d): qb.gpu_mem(d) for d in unique(devices) if d.type == "cuda"}
    if not mems:
        mems = {"cpu": {"host_rss_anon_GiB": round(qb.rss_anon_bytes() / 2**30, 3)}}
    return mems


def train(model, opt, ids, *, warmup, steps, devices, autocast):
    """warmup + steps optimizer steps; (timed seconds, losses). Peaks are reset on every device."""
    devs = unique(devices)
    for d in devs:
        qb.reset_peaks(d)
    losses, t0 = [], None
    for i in range(warmup + steps):
        if i == warmup:
            for d in devs:
                qb.sync(d)
            dist.barrier()
            t0 = time.perf_counter()
        with torch.autocast(devs[0].type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read at the end: no sync inside the timed steps
    for d in devs:
        qb.sync(d)
    dt = time.perf_counter() - t0
    return dt, [round(float(x), 5) for x in losses]


def memory_estimate(a, mesh, cfg) -> dict:
    """quantmesh.plan.memory's bytes per rank; for split it is the whole replica (one device would
    need it all), the layer split puts about half of it on each of the rank's devices."""
    R: dict = {}
    with qb.record_errors(R):
        import quantmesh as qm

        lora = qm.LoraConfig(r=a.lora_r, alpha=a.lora_alpha, targets=a.targets)
        est = qm.estimate_memory(
            skeleton(a, cfg), tp=mesh.tp, dp=mesh.dp, quant=a.quant, lora=lora, seq_len=a.seq,
            micro_batch=a.mb, dtype=torch.bfloat16,
        )  # fmt: skip
        R["total_GiB"] = round(est.total / 2**30, 3)
        if len(mesh.devices) > 1:
            R["note"] = f"whole replica; split over {len(mesh.devices)} devices by the layer split"
    return R


# ---- the loss check ---------------------------------------------------------------------------
def run_check(a, mesh, R) -> None:
    """CHECK_STEPS SGD steps of a small model of the same family on this layout against tp=1 fp32
    on CPU (rank 0, same process, same seeded weights drawn on CPU, same global batch)."""
    shape = CHECK_SHAPE_SMOKE if a.smoke else CHECK_SHAPE
    s = SimpleNamespace(**{**vars(a), **shape, "lr": CHECK_LR})
    cfg = model_config(s)
    dev = mesh.device
    autocast = use_autocast(a, dev)
    wdtype = torch.bfloat16 if autocast else torch.float32
    t0 = time.perf_counter()
    # weights drawn on CPU by both sides (rounded to bf16 by full_value): identical values
    model, _ = build(s, mesh, cfg, dtype=wdtype, gen_device="cpu")
    ids = bt.batch(s, s.vocab, s.seq, s.mb, mesh.dp_rank * s.mb, dev)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=s.lr, momentum=0.9)
    losses = []
    for _ in range(CHECK_STEPS):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lt = loss.detach().float().reshape(1).to(dev)
        if mesh.dp > 1:  # equal token counts per replica: the global loss is the mean
            dist.all_reduce(lt, group=mesh.dp_group)
            lt /= mesh.dp
        losses.append(float(lt))
    del model, opt
    R["mesh_losses"] = [round(x, 6) for x in losses]
    R["mesh_s"] = round(time.perf_counter() - t0, 2)
    if mesh.rank == 0:
        t0 = time.perf_counter()
        ref, _ = build(s, bt.local_cpu_mesh(), cfg, dtype=torch.float32, gen_device="cpu")
        ids_all = bt.batch(s, s.vocab, s.seq, s.mb * mesh.dp, 0, "cpu")
        opt = torch.optim.SGD(
            [p for p in ref.parameters() if p.requires_grad], lr=s.lr, momentum=0.9
        )
        ref_losses = []
        for _ in range(CHECK_STEPS):
            loss = ref(input_ids=ids_all, labels=ids_all).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_losses.append(float(loss.detach()))
        rel = [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses, strict=True)]
        R.update(
            cpu_fp32_losses=[round(x, 6) for x in ref_losses],
            max_rel_diff=float(f"{max(rel):.3g}"),
            tol=a.check_tol,
            passed=max(rel) <= a.check_tol,
            cpu_s=round(time.perf_counter() - t0, 2),
            what=(
                f"{CHECK_STEPS} SGD steps (lr {CHECK_LR}, momentum 0.9) of a {s.layers}-layer "
                f"h={s.hidden} {s.model}, quant={a.quant}, LoRA r={a.lora_r} on "
                f"{','.join(s.targets)}: layout {a.layout} (tp={mesh.tp}, dp={mesh.dp}, "
                f"{len(mesh.devices)} device(s) per rank, {mesh.backend}, "
                f"{'bf16 autocast' if autocast else 'fp32'}) vs tp=1 fp32 on CPU with the same "
                f"quantization, global batch {mesh.dp * s.mb}x{s.seq}"
            ),
        )
        if a.quant == "int8":
            R["int8_note"] = (
                "bitsandbytes int8 on CPU in train mode dequantizes the weight and ignores the "
                "outlier threshold (no int8 matmul of activations); on CUDA LLM.int8 quantizes "
                "activations with threshold 6.0, so a GPU run differs from this reference by that "
                "error too"
            )
        qb.log(
            f"check: mesh {R['mesh_losses']} cpu {R['cpu_fp32_losses']} "
            f"rel {R['max_rel_diff']} passed {R['passed']}"
        )
    dist.barrier()


# ---- accelerate's refusal of DDP over multi-device replicas ----------------------------------
REFUSAL_SHAPE = dict(layers=4, hidden=64, heads=4, inter=128, vocab=256)


def _device_map(layers: int, devs: list) -> dict:
    """What a 2-device `device_map` of OPTForCausalLM looks like: embeddings on the first device,
    the layers in two halves, final norm and head on the last."""
    half = layers // 2
    dm = {"model.decoder.embed_tokens": devs[0], "model.decoder.embed_positions": devs[0]}
    for i in range(layers):
        dm[f"model.decoder.layers.{i}"] = devs[0] if i < half else devs[1]
    dm["model.decoder.final_layer_norm"] = devs[1]
    dm["lm_head"] = devs[1]
    return dm


def _attempt(fn) -> dict:
    try:
        fn()
        return {"refused": False, "message": None}
    except Exception as e:
        return {"refused": True, "type": type(e).__name__, "message": str(e)}


def accelerate_refusal(a, mesh, R) -> None:
    """A tiny OPT, loaded in 8-bit by transformers + bitsandbytes, LoRA (peft) on q_proj/v_proj,
    its modules mapped to 2 devices of this rank; Accelerator().prepare on every rank.

    On CUDA the map is real: from_pretrained(device_map=...) over the rank's own 2 GPUs, as
    device_map="auto" would place it. On CPU ranks no second device exists: the model is loaded on
    CPU and accelerate's dispatch_model records a multi-entry map whose entries are all "cpu"
    (which is what accelerate's first check reads), and for the second attempt the map a 2-GPU
    rank would record (device indices) is set by hand; the weights stay on CPU.
    """
    import peft
    from accelerate import Accelerator, dispatch_model
    from transformers import BitsAndBytesConfig, OPTForCausalLM

    cuda = mesh.device.type == "cuda"
    s = SimpleNamespace(**{**vars(a), **REFUSAL_SHAPE, "seq": 64})
    folder = [tempfile.mkdtemp(prefix="seed-refusal-") if mesh.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    try:
        if mesh.rank == 0:
            torch.manual_seed(0)
            OPTForCausalLM(model_config(s)).save_pretrained(folder)
        dist.barrier()
        q8 = BitsAndBytesConfig(load_in_8bit=True)
        if cuda:
            idx = [d.index for d in mesh.devices]
            dm = _device_map(s.layers, idx)
            model = OPTForCausalLM.from_pretrained(folder, quantization_config=q8, device_map=dm)
            R["how"] = (
                f"from_pretrained(load_in_8bit, device_map over cuda:{idx[0]} and cuda:{idx[1]})"
            )
            if not getattr(model, "hf_device_map", None):  # transformers dispatches it itself
                dispatch_model(model, device_map=dm)
                R["how"] += ", then accelerate.dispatch_model with the same map"
        else:
            model = OPTForCausalLM.from_pretrained(folder, quantization_config=q8, device_map="cpu")
            dispatch_model(
                model, device_map=_device_map(s.layers, ["cpu", "cpu"]), force_hooks=True
            )
            R["how"] = (
                "from_pretrained(load_in_8bit, device_map='cpu'), then accelerate.dispatch_model "
                "with a 2-part map whose entries are all 'cpu' (no second device on CPU ranks)"
            )
        R["hf_device_map"] = {k: str(v) for k, v in model.hf_device_map.items()}
        R["is_loaded_in_8bit"] = bool(getattr(model, "is_loaded_in_8bit", False))
        R["q_proj_class"] = type(model.model.decoder.layers[0].self_attn.q_proj).__name__
        lcfg = peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=OPT_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
        )
        pm = peft.get_peft_model(model, lcfg)
        # accelerate sets the current CUDA device to cuda:LOCAL_RANK; this rank's is put back below
        acc = Accelerator(cpu=not cuda)
        R["accelerate_distributed_type"] = str(acc.distributed_type)
        R["accelerate_num_processes"] = acc.num_processes
        R["prepare"] = _attempt(lambda: acc.prepare(pm))
        # accelerate's own escape hatch from that first check; its 8-bit/4-bit check comes next
        os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
        try:
            if not cuda:
                model.hf_device_map = _device_map(s.layers, [0, 1])
                R["bypass_how"] = (
                    "hf_device_map set by hand to the map a 2-GPU rank records (device indices "
                    "0 and 1); weights on CPU"
                )
            R["prepare_with_bypass"] = _attempt(lambda: acc.prepare(pm))
        finally:
            del os.environ["ACCELERATE_BYPASS_DEVICE_MAP"]
    finally:
        if cuda:
            torch.cuda.set_device(mesh.device)
        dist.barrier()
        if mesh.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


# ---- the peers' fallback: accelerate's single-process layer split ------------------------------
def peer_devices(a) -> list[torch.device]:
    if a.cpu:
        return [torch.device("cpu")] * 2
    n = a.peer_devices or torch.cuda.device_count()
    if n < 1 or n > torch.cuda.device_count():
        raise ValueError(
            f"--layout accelerate over {n} GPU(s), but {torch.cuda.device_count()} are visible; "
            "use --peer-devices N with N visible GPUs, or --cpu / --smoke"
        )
    return [torch.device("cuda", i) for i in range(n)]


def peer_device_map(a, cfg, devices) -> dict[str, torch.device]:
    """A device_map as accelerate's dispatch takes it: the embeddings on the first device, the
    blocks in consecutive runs of (nearly) equal length, the final norm on the last device; the head
    on the last device, or with the embedding it is tied to."""
    if a.model == "opt":
        base, pre, post = "model.decoder", ["embed_tokens", "embed_positions"], ["final_layer_norm"]
    else:
        base, pre, post = "model", ["embed_tokens", "rotary_emb"], ["norm"]
    n, L = len(devices), cfg.num_hidden_layers
    dm = {f"{base}.{m}": devices[0] for m in pre}
    i = 0
    for k, d in enumerate(devices):
        for _ in range(L // n + (k < L % n)):
            dm[f"{base}.layers.{i}"] = d
            i += 1
    dm.update({f"{base}.{m}": devices[-1] for m in post})
    dm["lm_head"] = devices[0] if cfg.tie_word_embeddings else devices[-1]
    return dm


def _where(dm: dict, fqn: str) -> torch.device:
    keys = [k for k in dm if fqn == k or fqn.startswith(k + ".")]
    return dm[max(keys, key=len)]


def build_peer(a, cfg, devices):
    """The model as a user of the peer stack runs it: transformers' class on meta (accelerate's
    init_empty_weights), every nn.Linear but the head replaced by bitsandbytes' Linear8bitLt
    (threshold 6.0, as BitsAndBytesConfig(load_in_8bit=True)) or Linear4bit (nf4, double quant),
    quantized on its device from the same seeded weights as the quantmesh runs, dispatched by
    accelerate over `devices`, then peft LoRA on the targets."""
    import bitsandbytes as bnb
    import peft
    from accelerate import dispatch_model, init_empty_weights
    from torch import nn
    from transformers import LlamaForCausalLM, OPTForCausalLM

    t0 = time.perf_counter()
    cls = OPTForCausalLM if a.model == "opt" else LlamaForCausalLM
    with init_empty_weights():
        model = cls(cfg)
    model.config.use_cache = False
    dm = peer_device_map(a, cfg, devices)
    cuda = devices[0].type == "cuda"
    wdtype = torch.bfloat16 if cuda else torch.float32
    with torch.no_grad():
        for fqn, m in list(model.named_modules()):
            if type(m) is not nn.Linear or fqn == "lm_head":
                continue
            dev = _where(dm, fqn)
            w = qb.full_value(f"{fqn}.weight", m.weight.shape, seed=a.seed, gen_device=dev)
            has_bias = m.bias is not None
            if a.quant == "int8":
                new = bnb.nn.Linear8bitLt(
                    m.in_features, m.out_features, has_bias, has_fp16_weights=False,
                    threshold=6.0, device="meta",
                )  # fmt: skip
                # Int8Params quantizes when moved from the CPU to its device
                new.weight = bnb.nn.Int8Params(
                    w.to(torch.float16).cpu(), requires_grad=False, has_fp16_weights=False
                ).to(dev)
            else:
                new = bnb.nn.Linear4bit(
                    m.in_features, m.out_features, has_bias, compute_dtype=wdtype,
                    compress_statistics=True, quant_type="nf4", device="meta",
                )  # fmt: skip
                new.weight = bnb.nn.Params4bit(
                    w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                    blocksize=64, module=new,
                ).to(dev)  # fmt: skip
                # bitsandbytes' repacked CPU layout drops input gradients (see quant/bnb.py)
                new.support_avx512bf16_for_cpu = False
            if has_bias:
                new.bias = nn.Parameter(torch.zeros(m.out_features, device=dev, dtype=wdtype))
            new.requires_grad_(False)
            model.set_submodule(fqn, new)
        emb = model.get_input_embeddings().weight
        for fqn, p in list(model.named_parameters()):
            if p.device.type != "meta":
                continue
            owner, pname = fqn.rsplit(".", 1)
            mod = model.get_submodule(owner)
            dev = _where(dm, owner)
            # fill_random writes a tied tensor under each of its names, the head's last
            key = "lm_head.weight" if (cfg.tie_word_embeddings and p is emb) else fqn
            v = qb.full_value(key, p.shape, seed=a.seed, gen_device=dev).to(wdtype)
            if isinstance(mod, nn.LayerNorm) and pname == "bias":
                v.zero_()
            mod._parameters[pname] = nn.Parameter(v, requires_grad=False)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.get_input_embeddings().weight
    where = {k: (d.index if d.type == "cuda" else "cpu") for k, d in dm.items()}
    main = devices[0].index if cuda else "cpu"  # where the inputs go: the embeddings' device
    dispatch_model(model, device_map=where, main_device=main, force_hooks=not cuda)
    lcfg = peft.LoraConfig(
        r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, target_modules=a.targets,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    pm = peft.get_peft_model(model, lcfg)
    pm.train()
    for d in unique(devices):
        qb.sync(d)
    blocks: dict[str, list[int]] = {}
    for k, d in dm.items():
        if ".layers." in k:
            blocks.setdefault(str(d), []).append(int(k.rsplit(".", 1)[1]))
    info = {
        "build_s": round(time.perf_counter() - t0, 2),
        "blocks_per_device": blocks,
        "head_on": str(dm["lm_head"]),
        "quantized_class": type(new).__name__,
    }
    return pm, info


def run_peer(a, R) -> None:
    devices = peer_devices(a)
    autocast = use_autocast(a, devices[0])
    cfg = model_config(a)
    model, R["build"] = build_peer(a, cfg, devices)
    qb.log(f"built the peer over {len(devices)} devices: {R['build']}")
    params = [p for p in model.parameters() if p.requires_grad]
    R.update(
        dp=1,
        devices_per_rank=len(devices),
        devices=[str(d) for d in devices],
        autocast_bf16=autocast,
        trainable_params=sum(p.numel() for p in params),
        lora_dtype=sorted({str(p.dtype) for p in params}),
        what=(
            "peers' fallback: one process, transformers + bitsandbytes "
            f"{'Linear8bitLt' if a.quant == 'int8' else 'Linear4bit nf4'} + peft LoRA, accelerate "
            f"dispatch_model over {len(devices)} device(s), no data parallelism"
        ),
    )
    opt = torch.optim.AdamW(params, lr=a.lr)
    ids = bt.batch(a, a.vocab, a.seq, a.mb, 0, devices[0])
    dt, losses = train(
        model, opt, ids, warmup=a.warmup, steps=a.steps, devices=devices, autocast=autocast
    )
    tok = a.mb * a.seq * a.steps / dt
    R.update(
        tokens_per_step=a.mb * a.seq,
        tokens_per_s=round(tok, 1),
        tokens_per_s_per_device=round(tok / len(unique(devices)), 1),
        step_s=round(dt / a.steps, 4),
        losses_first=losses[:5],
        loss_last=losses[-1],
        mem={"0": device_memory(devices)},
    )
    qb.log(f"peer: {tok:,.0f} tokens/s, step {R['step_s']} s, mem {R['mem']['0']}")


# ---- main -------------------------------------------------------------------------------------
def result_name(a, mesh) -> str:
    if a.accelerate_refusal:
        return f"result_seed_accelerate_refusal{a.tag}.json"
    if a.layout == "accelerate":
        n = 2 if a.cpu else (a.peer_devices or torch.cuda.device_count())
        return f"result_seed_accelerate_{a.model}_{a.quant}_{n}dev{a.tag}.json"
    return f"result_seed_{a.layout}_{a.model}_{a.quant}_dp{mesh.dp}_tp{mesh.tp}{a.tag}.json"


def run_layout(a, mesh, R) -> None:
    """Build this layout, run the loss check and the timed steps; results into R."""
    import quantmesh as qm

    dev = mesh.device
    autocast = use_autocast(a, dev)
    R["autocast_bf16"] = autocast
    if not a.no_check:
        R["check"] = {}
        with qb.record_errors(R["check"]):
            run_check(a, mesh, R["check"])
        if "error" in R["check"]:
            dist.barrier()
    cfg = model_config(a)
    dtype = torch.bfloat16 if (autocast or not a.cpu) else torch.float32
    model, R["build"] = build(a, mesh, cfg, dtype=dtype)
    R["memory_estimate"] = memory_estimate(a, mesh, cfg)
    R["blocks_per_device"] = bt.gather(placement(model))
    qb.log(f"built {a.layout} {a.model} {a.quant}: {R['build']}")
    params = qm.trainable_parameters(model)
    R["trainable_params_per_rank"] = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=a.lr)
    ids = bt.batch(a, a.vocab, a.seq, a.mb, mesh.dp_rank * a.mb, dev)
    dt, losses = train(
        model, opt, ids, warmup=a.warmup, steps=a.steps, devices=mesh.devices,
        autocast=autocast,
    )  # fmt: skip
    dts = bt.gather(dt)
    mems = bt.gather(device_memory(mesh.devices))
    tokens_per_step = mesh.dp * a.mb * a.seq
    tok = tokens_per_step * a.steps / max(dts)
    R.update(
        tokens_per_step=tokens_per_step,
        tokens_per_s=round(tok, 1),
        tokens_per_s_per_device=round(tok / (mesh.world_size * len(mesh.devices)), 1),
        step_s=round(max(dts) / a.steps, 4),
        rank_times=[round(x, 3) for x in dts],
        losses_first=losses[:5],
        loss_last=losses[-1],
        mem={str(r): m for r, m in enumerate(mems)},
    )
    qb.log(f"{a.layout}: {tok:,.0f} tokens/s, step {R['step_s']} s, mem {mems[0]}")
    R["ok"] = "error" not in R.get("check", {})


def main(argv=None) -> int:
    a = parse(argv)
    t_start = time.time()
    R: dict = {
        "bench": "seed",
        "args": {k: v for k, v in vars(a).items() if k != "out"},
        "versions": qb.versions(),
        "ok": False,
    }
    mesh = make_mesh(a)
    dev = mesh.device
    R.update(
        layout="accelerate_refusal" if a.accelerate_refusal else a.layout,
        dp=mesh.dp, tp=mesh.tp, ranks=mesh.world_size, devices_per_rank=len(mesh.devices),
        backend=mesh.backend,
    )  # fmt: skip
    out_path = os.path.join(a.out, result_name(a, mesh))
    try:
        if a.accelerate_refusal:
            mine: dict = {}
            with qb.record_errors(mine):
                accelerate_refusal(a, mesh, mine)
            R["per_rank"] = {str(r): x for r, x in enumerate(bt.gather(mine))}
            R["ok"] = all("error" not in x for x in R["per_rank"].values())
        elif a.layout == "accelerate":
            run_peer(a, R)
            R["ok"] = True
        else:
            run_layout(a, mesh, R)
    except Exception as e:
        R["ok"] = False
        R["error"] = f"{type(e).__name__}: {e}"[:2000]
        import traceback

        R["traceback"] = traceback.format_exc()[-4000:]
        qb.log("FAILED", R["error"])
        print(R["traceback"], flush=True)
        if dev.type == "cuda":
            R["mem_at_error"] = device_memory(mesh.devices)
    gc.collect()  # the models (DDP state included) go before the process group does
    R["wall_s"] = round(time.time() - t_start, 1)
    if mesh.rank == 0:
        qb.write_json(out_path, R)
        keys = ("layout", "ok", "tokens_per_s", "error")
        qb.log("RESULT", json.dumps({k: R.get(k) for k in keys}, default=str))
    dist.destroy_process_group()
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
