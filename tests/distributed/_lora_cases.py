"""Rank functions for the LoRA / quantization / data-parallel tests (spawned by run_ranks).

test_lora_dp.py, test_lora_peft.py and test_lora_errors.py share their spawns: `spawned(world)`
runs every job of one world size (JOBS) in one launch, once per pytest session, and each test
reads its job's result. A job is a tuple (function name in this module, *arguments).
"""

from __future__ import annotations

import torch
from torch import nn

import quantmesh as qm
from quantmesh.io.adapter import expert_adapter_keys
from quantmesh.tp.experts import ShardedExperts
from quantmesh.tp.gather import gather_param, tp_sharded
from quantmesh.tp.layers import ShardedModule

from ._spawns import JobSpawns

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 128


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def whole_lora(
    model, what: str = "grad", *, missing_as_zero: bool = False
) -> dict[str, torch.Tensor]:
    """{module.lora_A.weight / lora_B.weight: the whole tensor} of every adapter: its gradient
    (`what="grad"`; `missing_as_zero`: zeros where there is none) or its weight ("param"), gathered
    over dp (an FSDP shard) and tp; on CPU, on every rank. Collective: every rank calls it."""
    from quantmesh.parallel.fsdp import whole

    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, ShardedModule) or m.lora is None:
            continue
        split = tp_sharded(m)
        for pname in ("lora_A.weight", "lora_B.weight"):
            p = m.get_parameter(pname)
            t = p.detach() if what == "param" else p.grad
            if t is None and missing_as_zero:
                t = torch.zeros_like(p)
            t = whole(t)
            if pname in split:
                dim, s = split[pname]
                t = gather_param(t, dim, s, m.group)
            out[f"{name}.{pname}"] = t.detach().cpu().clone()
    for m in model.modules():  # adapters on expert tensors, under PEFT's keys
        if not isinstance(m, ShardedExperts) or not len(m.expert_lora):
            continue
        split = tp_sharded(m)
        for key, (tname, ab) in expert_adapter_keys(m).items():
            pname = f"expert_lora.{tname}.{ab}.weight"
            p = m.get_parameter(pname)
            t = p.detach() if what == "param" else p.grad
            if t is None and missing_as_zero:
                t = torch.zeros_like(p)
            if pname in split:
                dim, s = split[pname]
                t = gather_param(t, dim, s, m.group)
            out[key] = t.detach().cpu().clone()
    return out


def train(
    rank: int, dp: int, tp: int, quant, steps: int = 5, devices_per_rank: int = 1, accum: int = 1
) -> dict:
    """`steps` AdamW steps of LoRA training on a fixed global batch; losses and LoRA grads."""
    if quant == "nf4_no_double_quant":
        quant = qm.QuantConfig(format="nf4", double_quant=False)
    mesh = qm.init_mesh(dp=dp, tp=tp, devices_per_rank=devices_per_rank)
    model = tiny_llama()
    lora = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7)
    qm.parallelize(model, mesh, quant=quant, lora=lora)
    # SGD with momentum, not Adam: Adam's first steps are sign-like (g / |g|), so a gradient element
    # at rounding level flips its step between layouts and the comparison would test Adam, not us
    opt = torch.optim.SGD(qm.trainable_parameters(model), lr=0.5, momentum=0.9)
    per_rank = GLOBAL_BATCH // dp
    losses, grads, norms = [], [], []
    for ids in batches(steps):
        local = ids[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank]
        micro = local.chunk(accum)
        total = 0.0
        for i, mb in enumerate(micro):
            ctx = qm.no_sync(model) if i < accum - 1 else _null()
            with ctx:
                mb = mb.to(mesh.device)
                loss = model(mb, labels=mb).loss / accum
                loss.backward()
            total += loss.detach()
        if dp > 1:  # the mean over the global batch: average the per-replica means
            torch.distributed.all_reduce(total, group=mesh.dp_group)
            total /= dp
        grads.append(whole_lora(model))
        norms.append(clip_to_half(model))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return {
        "losses": losses,
        "grads": grads if mesh.rank == 0 else None,
        "norms": norms,
        "replicas": _replicated_digest(model, mesh),
    }


def clip_to_half(model) -> float:
    """The global gradient norm (`qm.clip_grad_norm_` with no bound), then the gradients clipped to
    half of it: every rank scales its own by 0.5, so the steps that follow hold the one-rank
    reference's only if the norm and the scaling are right on every rank."""
    norm = float(qm.clip_grad_norm_(model, 1e9))
    qm.clip_grad_norm_(model, 0.5 * norm)
    return norm


def _replicated_digest(model, mesh) -> dict:
    """Whether every trainable adapter tensor is bitwise equal to its replicas: over dp (each
    replica's copy of the same tp shard) and, for an adapter kept whole over tp, over tp.
    `compared`: how many (tensor, group) pairs were looked at, so that a layout with nothing to
    compare cannot pass as "equal". Collective: every rank calls it."""
    ok, compared = True, 0
    for m in model.modules():
        if not isinstance(m, ShardedModule) or m.lora is None:
            continue
        sharded = tp_sharded(m)
        for pname in ("lora_A.weight", "lora_B.weight"):
            t = m.get_parameter(pname).detach().contiguous()
            groups = [(mesh.dp_group, mesh.dp)] if mesh.dp > 1 else []
            if mesh.tp > 1 and pname not in sharded:
                groups.append((mesh.tp_group, mesh.tp))
            for group, size in groups:
                parts = [torch.empty_like(t) for _ in range(size)]
                torch.distributed.all_gather(parts, t, group=group)
                ok &= all(torch.equal(parts[0], p) for p in parts)
                compared += 1
    return {"equal": ok, "compared": compared}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def many(rank: int, cases: list[tuple]) -> list[dict]:
    """Several training runs in one spawn (one mesh each)."""
    return [train(rank, *c) for c in cases]


def peft_compare(rank: int, quant) -> dict:
    """Our TP LoRA vs peft's LoRA on the unsharded model, with the same A and B copied in."""
    import peft

    mesh = qm.init_mesh(tp=2)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    ours = tiny_llama()
    qm.parallelize(ours, mesh, quant=quant, lora=qm.LoraConfig(r=4, alpha=8, targets=targets))
    g = torch.Generator().manual_seed(5)
    full_b = {}
    with torch.no_grad():  # nonzero B (a fresh adapter is a no-op), sliced as each style holds it
        for name, m in ours.named_modules():
            if isinstance(m, ShardedModule) and m.lora is not None:
                b = torch.randn(m.out_full, 4, generator=g) * 0.1
                full_b[name] = b
                if "lora_B.weight" in tp_sharded(m):
                    ((a, z),) = m.split.ranges(m.tp_rank)
                    b = b[a:z]
                m.lora_B.weight.copy_(b)
    sd = qm.full_state_dict(ours, rank0_only=False)
    ref = tiny_llama()
    if quant is not None:  # the reference quantizes the same (whole) weights: use our tp=1 shards
        return {"skipped": True}
    pm = peft.get_peft_model(
        ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name in full_b:
            base = f"base_model.model.{name}"
            pm.get_parameter(f"{base}.lora_A.default.weight").copy_(sd[f"{name}.lora_A.weight"])
            pm.get_parameter(f"{base}.lora_B.default.weight").copy_(sd[f"{name}.lora_B.weight"])
    ids = batches(1)[0]
    out_ours = ours(ids, labels=ids)
    out_ref = pm(ids, labels=ids)
    out_ours.loss.backward()
    out_ref.loss.backward()
    ours_g = whole_lora(ours)
    errs = {}
    for name in full_b:
        for p in ("lora_A", "lora_B"):
            rg = pm.get_parameter(f"base_model.model.{name}.{p}.default.weight").grad
            og = ours_g[f"{name}.{p}.weight"]
            errs[f"{name}.{p}"] = float((og - rg).norm() / rg.norm())
    return {
        "logits": float((out_ours.logits - out_ref.logits).abs().max()),
        "loss": (float(out_ours.loss), float(out_ref.loss)),
        "grad_errs": errs,
    }


def param_bytes(rank: int, tp: int, quant) -> dict:
    """Bytes of this rank's sharded-module parameters, and of the whole model's same modules."""
    mesh = qm.init_mesh(tp=tp)
    model = tiny_llama()
    qm.parallelize(model, mesh, quant=quant, lora=qm.LoraConfig(r=4, targets=TARGETS))
    base = lora = 0
    for name, m in model.named_modules():
        if isinstance(m, ShardedModule) and name.rsplit(".", 1)[-1] in TARGETS:
            for n, p in m.named_parameters():
                if n.startswith("lora_"):
                    lora += p.numel() * p.element_size()
                else:
                    base += p.numel() * p.element_size()
            qs = getattr(m.local.weight, "quant_state", None)
            if qs is not None:  # 4-bit statistics live on the quant state
                base += qs.absmax.numel() * qs.absmax.element_size()
    return {"base": base, "lora": lora}


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def parallelize_errors(rank: int) -> dict:
    """parallelize's LoRA / quantization errors on a model with a conv (tp=1)."""
    mesh = qm.init_mesh(tp=1)
    out = {}
    try:
        qm.parallelize(TinyCNN(), mesh, lora=qm.LoraConfig(targets=["conv"]))
    except qm.LoraError as e:
        out["lora_conv"] = str(e)
    try:
        qm.parallelize(TinyCNN(), mesh, quant=qm.QuantConfig(format="nf4", targets=["conv"]))
    except qm.QuantError as e:
        out["quant_conv"] = str(e)
    m = TinyCNN()
    qm.parallelize(m, mesh, quant="nf4")  # default targets: every linear; the conv stays float
    out["conv_dtype"] = str(m.conv.weight.dtype)
    out["head_quant"] = type(m.head).__name__
    try:
        qm.parallelize(TinyCNN(), mesh, lora={"r": 4})
    except qm.LoraError as e:
        out["lora_dict"] = str(e)
    return out


# Training layouts (dp, tp, quant[, steps, devices_per_rank, accum]) per world size.
LAYOUTS = {
    1: [(1, 1, None), (1, 1, "nf4"), (1, 1, "int8"), (1, 1, "nf4_no_double_quant")],
    2: [
        (1, 2, None),
        (2, 1, None),
        (1, 2, "nf4"),
        (1, 2, "int8"),
        (1, 2, "nf4_no_double_quant"),
        (2, 1, None, 5, 1, 2),  # dp=2, two micro-steps each, the first under no_sync
        (2, 1, None, 5, 2),  # the seed layout: each dp replica split over 2 CPU "devices"
    ],
    4: [(2, 2, None), (1, 4, None), (2, 2, "nf4")],
}
QUANTS = (None, "nf4", "int8")
JOBS: dict[int, list[tuple]] = {
    1: [("train", *c) for c in LAYOUTS[1]]
    + [("param_bytes", 1, q) for q in QUANTS]
    + [("parallelize_errors",)],
    2: [("train", *c) for c in LAYOUTS[2]]
    + [("param_bytes", 2, q) for q in QUANTS]
    + [("peft_compare", None)],
    4: [("train", *c) for c in LAYOUTS[4]],
}


def run_jobs(rank: int, jobs: list[tuple]) -> list:
    """Every job of one spawn, in order, on this rank."""
    return [globals()[name](rank, *args) for name, *args in jobs]


SPAWNS = JobSpawns(JOBS, run_jobs)
result = SPAWNS.result
