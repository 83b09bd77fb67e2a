"""Rank functions for the FSDP tests (spawned by run_ranks; one launch per world size).

A job is (function name in this module, *arguments); `result(job)` runs every job of the job's
world size in one spawn, once per pytest session.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import quantmesh as qm
import quantmesh.parallel.fsdp as qm_fsdp
from quantmesh.parallel.fsdp import local_of
from quantmesh.parallel.state import parallel_state
from quantmesh.plan.auto import blocks_of
from quantmesh.tp.layers import ShardedModule

from ._lora_cases import GLOBAL_BATCH, TARGETS, batches, clip_to_half, tiny_llama, whole_lora
from ._spawns import JobSpawns

NF4_AO = "nf4_torchao"
INT8_AO = "int8_torchao"


def _quant(q):
    if q == NF4_AO:
        return qm.QuantConfig(format="nf4", backend="torchao")
    if q == INT8_AO:
        return qm.QuantConfig(format="int8", backend="torchao")
    return q


def _build(mesh, quant, fsdp: bool, offload: bool = False):
    model = tiny_llama()
    lora = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7)
    qm.parallelize(model, mesh, quant=_quant(quant), lora=lora, fsdp=fsdp, offload_base=offload)
    # SGD with momentum (as _lora_cases.train): its state is param-shaped, so resume covers it
    opt = torch.optim.SGD(qm.trainable_parameters(model), lr=0.5, momentum=0.9)
    return model, opt


def _step(model, opt, mesh, ids: torch.Tensor, grads: list | None = None) -> tuple[float, float]:
    """One optimizer step on this dp rank's rows of the global batch: (global mean loss, norm)."""
    per_rank = GLOBAL_BATCH // mesh.dp
    local = ids[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank].to(mesh.device)
    loss = model(local, labels=local).loss
    loss.backward()
    total = loss.detach()
    if mesh.dp > 1:
        torch.distributed.all_reduce(total, group=mesh.dp_group)
        total /= mesh.dp
    if grads is not None:
        grads.append(whole_lora(model, "grad"))
    norm = clip_to_half(model)
    opt.step()
    opt.zero_grad()
    return float(total), norm


def train(
    rank: int, dp: int, tp: int, quant, fsdp: bool, offload: bool = False, steps: int = 4,
    ckpt: bool = False,
):  # fmt: skip
    """`steps` SGD-momentum steps of LoRA training on a fixed global batch (as _lora_cases.train);
    `ckpt`: the blocks checkpointed (qm.checkpoint_blocks) after FSDP wrapped them."""
    mesh = qm.init_mesh(dp=dp, tp=tp)
    model, opt = _build(mesh, quant, fsdp, offload)
    if ckpt:
        qm.checkpoint_blocks(model)
    losses, grads, norms = [], [], []
    for ids in batches(steps):
        loss, norm = _step(model, opt, mesh, ids, grads)
        losses.append(loss)
        norms.append(norm)
    adapters = whole_lora(model, "param")  # collective: every rank
    return {
        "losses": losses,
        "grads": grads if mesh.rank == 0 else None,
        "norms": norms,
        "adapters": adapters if mesh.rank == 0 else None,
        "sharded": parallel_state(model).sharded is not None,
    }


def resume(rank: int, dp: int, tp: int, quant) -> dict:
    """fsdp: 2 steps, save_state + save_adapter, 2 more; then a fresh fsdp model (and a plain dp
    one) load_state and run the same 2 steps; a third loads the adapter."""
    root = Path(os.environ["QM_FSDP_TMP"]) / f"resume-{dp}-{tp}-{quant}"
    mesh = qm.init_mesh(dp=dp, tp=tp)
    data = batches(4)
    model, opt = _build(mesh, quant, True)
    for ids in data[:2]:
        _step(model, opt, mesh, ids)
    qm.save_state(model, opt, root / "state", step=2)
    qm.save_adapter(model, root / "adapter")
    saved = whole_lora(model, "param")
    cont = [_step(model, opt, mesh, ids)[0] for ids in data[2:]]
    end = whole_lora(model, "param")
    out: dict = {"cont": cont}
    for name, fsdp in (("fsdp", True), ("plain", False)):
        m2, o2 = _build(mesh, quant, fsdp)
        step = qm.load_state(m2, o2, root / "state")
        out[f"{name}_step"] = step
        out[f"{name}_cont"] = [_step(m2, o2, mesh, ids)[0] for ids in data[2:]]
        got = whole_lora(m2, "param")
        out[f"{name}_end"] = max(float((got[k] - end[k]).abs().max()) for k in end)
    m3, _ = _build(mesh, quant, True)
    qm.load_adapter(m3, root / "adapter")
    got = whole_lora(m3, "param")
    out["adapter_equal"] = all(torch.equal(got[k], saved[k]) for k in saved)
    return out


def nf4_survives(rank: int, dp: int) -> dict:
    """Every NF4 weight gathered by FSDP equals, bit for bit, the NF4 quantization of its float
    weight (same block sizes) made without FSDP."""
    mesh = qm.init_mesh(dp=dp)
    ref = tiny_llama()
    model, _ = _build(mesh, NF4_AO, True)
    for m in model.modules():
        if hasattr(m, "unshard"):
            m.unshard()  # every FSDP group gathered (the modules now hold the whole tensors)
    checked, equal = 0, True
    for name, m in model.named_modules():
        if not isinstance(m, ShardedModule) or m.fmt is None:
            continue
        got = m.local.weight
        fresh = m.fmt.new_linear(m.in_full, m.out_full, bias=False, device="cpu",
                                 dtype=torch.float32)  # fmt: skip
        m.fmt.quantize_into(fresh, ref.get_submodule(name).weight.detach())
        want = fresh.weight
        names, _ = want.__tensor_flatten__()
        for n in names:
            equal &= torch.equal(getattr(got, n), getattr(want, n))
        equal &= type(got).__name__ == "NF4Tensor"
        checked += 1
    return {"checked": checked, "equal": equal}


def offload_policies(rank: int) -> dict:
    """Which FSDP groups got FSDP2's CPUOffloadPolicy with offload_base=True: {kind: [bool]}."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    mesh = qm.init_mesh(dp=2)
    model, _ = _build(mesh, None, True, offload=True)
    out: dict[str, list] = {"block": [], "adapters": [], "head": [], "root": []}
    blocks = {id(b) for _, b in blocks_of(model)}
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        group = get()._fsdp_param_group  # torch's FSDP2 internals: test-only introspection
        offloaded = isinstance(group.offload_policy, CPUOffloadPolicy)
        trainable = {fp.sharded_param.requires_grad for fp in group.fsdp_params}
        kind = (
            "root" if m is model else "block" if id(m) in blocks
            else "head" if m is model.lm_head else "adapters"
        )  # fmt: skip
        out[kind].append((offloaded, sorted(trainable)))
    return out


def loaded(rank: int, dp: int, tp: int, quant=None) -> dict:
    """A skeleton on meta, parallelize(fsdp=True), load_checkpoint: each block sharded as soon as
    it is filled, then it trains like the one-rank reference; evaluate over 3 examples at dp=2
    (uneven) agrees with plain dp; a second load_checkpoint is refused."""
    from quantmesh.io import load as qm_load
    from quantmesh.io.load import LoadError
    from quantmesh.train.loop import evaluate

    mesh = qm.init_mesh(dp=dp, tp=tp)
    sd = tiny_llama().state_dict()
    with qm.empty_model():
        model = tiny_llama()
    lora = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7)
    qm.parallelize(model, mesh, quant=_quant(quant), lora=lora, fsdp=True)
    before = parallel_state(model).sharded is not None
    plain = tiny_llama()  # the same layout without fsdp: a whole replica per rank
    qm.parallelize(plain, mesh, quant=_quant(quant), lora=lora)
    replica = sum(_nbytes(p) for p in plain.parameters())
    puts, seen = [0], []  # tensors written so far; (written, bytes held) at each block's sharding
    put, shard = qm_load._put, qm_fsdp.shard_block

    def count(*a, **k):
        puts[0] += 1
        put(*a, **k)

    def spy(block, *a, **k):
        seen.append(
            (puts[0], sum(_nbytes(local_of(p)) for p in model.parameters() if not p.is_meta))
        )
        shard(block, *a, **k)

    qm_load._put, qm_fsdp.shard_block = count, spy
    try:
        qm.load_checkpoint(model, sd, progress=False)
    finally:
        qm_load._put, qm_fsdp.shard_block = put, shard
    after = parallel_state(model).sharded is not None
    ids = batches(1)[0]
    examples = [{"input_ids": ids[i], "labels": ids[i]} for i in range(3)]
    ev, ev_plain = (
        evaluate(model, examples, micro_batch=1),
        evaluate(plain, examples, micro_batch=1),
    )
    opt = torch.optim.SGD(qm.trainable_parameters(model), lr=0.5, momentum=0.9)
    losses = [_step(model, opt, mesh, b)[0] for b in batches(4)]
    try:
        qm.load_checkpoint(model, sd, progress=False)
        refused = ""
    except LoadError as e:
        refused = str(e)
    return {"before": before, "after": after, "losses": losses, "eval": (ev, ev_plain),
            "refused": refused, "streamed": seen, "puts": puts[0], "replica": replica}  # fmt: skip


def base_bytes(rank: int, dp: int, tp: int, quant, fsdp: bool) -> dict:
    """Bytes this rank holds of the frozen base (local shards of DTensors), and of the adapters."""
    mesh = qm.init_mesh(dp=dp, tp=tp)
    model = tiny_llama()
    lora = qm.LoraConfig(r=4, alpha=8, targets=TARGETS)
    qm.parallelize(model, mesh, quant=_quant(quant), lora=lora, fsdp=fsdp)
    base = adapters = 0
    for p in model.parameters():
        t = local_of(p)
        n = _nbytes(t)
        if p.requires_grad:
            adapters += n
        else:
            base += n
    return {"base": base, "adapters": adapters}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a plain tensor, or of every inner tensor of a tensor subclass (NF4Tensor)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t.numel() * t.element_size()
    flat = getattr(t, "__tensor_flatten__", None)
    if flat is None:
        return t.numel() * t.element_size()
    names, _ = flat()
    return sum(_nbytes(getattr(t, n)) for n in names)


def refusals(rank: int) -> dict:
    """fsdp=True with formats that do not shard exactly, and other misuse: the messages."""
    mesh = qm.init_mesh(dp=1)
    out = {}
    for q in ("nf4", "int8"):
        try:
            qm.parallelize(tiny_llama(), mesh, quant=q, lora=qm.LoraConfig(targets=TARGETS),
                           fsdp=True)  # fmt: skip
        except qm.QuantError as e:
            out[q] = str(e)
        except ValueError as e:
            out[q] = f"{type(e).__name__}: {e}"
    try:
        qm.parallelize(tiny_llama(), mesh, offload_base=True)
    except ValueError as e:
        out["offload_alone"] = str(e)
    return out


JOBS: dict[int, list[tuple]] = {
    1: [
        ("train", 1, 1, None, False),
        ("train", 1, 1, None, True),
        ("train", 1, 1, NF4_AO, False),
        ("train", 1, 1, NF4_AO, True),
        ("train", 1, 1, INT8_AO, False),
        ("base_bytes", 1, 1, None, False),
        ("base_bytes", 1, 1, NF4_AO, False),
        ("refusals",),
    ],
    2: [
        ("train", 2, 1, None, True),
        ("train", 2, 1, None, True, True),
        ("train", 2, 1, None, True, False, 4, True),
        ("train", 2, 1, NF4_AO, True),
        ("train", 2, 1, INT8_AO, True),
        ("base_bytes", 2, 1, None, True),
        ("base_bytes", 2, 1, NF4_AO, True),
        ("resume", 2, 1, None),
        ("resume", 2, 1, NF4_AO),
        ("nf4_survives", 2),
        ("offload_policies",),
        ("loaded", 2, 1),
        ("loaded", 2, 1, NF4_AO),
    ],
    4: [("train", 2, 2, None, True), ("train", 2, 2, NF4_AO, True)],
}


def run_jobs(rank: int, jobs: list[tuple]) -> list:
    return [globals()[name](rank, *args) for name, *args in jobs]


SPAWNS = JobSpawns(JOBS, run_jobs, tmp_env="QM_FSDP_TMP")
result = SPAWNS.result
