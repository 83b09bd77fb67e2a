"""Rank functions for the pipeline tests (spawned by run_ranks): `pp_train` trains a small model
for a few steps at one (dp, pp, tp) layout through `qm.train_step`; (1, 1, 1) is the reference.

A rank reports its losses, its stage's gradients (gathered over tp, by name) from the replica's
first tp rank and dp rank, and the parameter names it holds; the test merges the stages.
"""

from __future__ import annotations

import torch

import quantmesh as qm
from quantmesh.tp.gather import gather_param, tp_sharded
from quantmesh.tp.layers import ShardedModule

from ..models import llama, tiny_gpt

GLOBAL_BATCH, SEQ, VOCAB = 8, 8, 100
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(name: str):
    if name == "llama":  # GQA: 8 heads, 4 KV heads; untied head (trained in fp32 runs)
        return llama(layers=4, tie=False, vocab=VOCAB)
    if name == "llama_tied":
        return llama(layers=4, tie=True, vocab=VOCAB)
    if name == "gpt":  # a custom (non-transformers) model: learned positions, fused q|k|v
        return tiny_gpt(layers=4, vocab=VOCAB)
    raise ValueError(name)


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every trainable gradient this rank holds, whole (gathered over tp where split)."""
    sharded = {n: m for n, m in model.named_modules() if isinstance(m, ShardedModule)}
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        g = p.grad
        owner = max((n for n in sharded if name.startswith(n + ".")), key=len, default=None)
        if owner is not None:
            m = sharded[owner]
            split = tp_sharded(m)
            pname = name[len(owner) + 1 :]
            if pname in split:
                dim, s = split[pname]
                g = gather_param(g, dim, s, m.group)
        out[name] = g.detach().cpu().clone()
    return out


def pp_train(
    rank: int,
    dp: int,
    pp: int,
    tp: int,
    *,
    model: str = "llama",
    quant=None,
    lora: bool = False,
    steps: int = 3,
    microbatches: int = 4,
    schedule: str = "1f1b",
    stages: list[int] | None = None,
    virtual: int = 1,
) -> dict:
    """`steps` SGD-momentum steps; returns losses, gradients by name and the names held."""
    mesh = qm.init_mesh(dp=dp, pp=pp, tp=tp)
    net = build(model)
    cfg = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7) if lora else None
    if lora and model == "gpt":
        cfg = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=["qkv", "proj"], seed=7)
    pipe = qm.PipelineConfig(stages=stages, virtual=virtual) if stages or virtual > 1 else None
    qm.parallelize(net, mesh, quant=quant, lora=cfg, pipeline=pipe, verify=model != "gpt")
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    per = GLOBAL_BATCH // dp
    losses, grads = [], []
    for ids in batches(steps):
        local = ids[mesh.dp_rank * per : (mesh.dp_rank + 1) * per]
        loss = qm.train_step(
            net, {"input_ids": local, "labels": local}, microbatches=microbatches, schedule=schedule
        )
        grads.append(full_grads(net))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    lead = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {
        "stage": mesh.pp_rank,
        "losses": losses,
        "grads": grads if lead else None,
        "names": sorted(net.state_dict().keys()),
        "params": sorted(n for n, _ in net.named_parameters(remove_duplicate=False)),
    }


def many(rank: int, cases: list[tuple[tuple[int, int, int], dict]]) -> list[dict]:
    """Several layouts in one spawn (a mesh each, over the same world)."""
    return [pp_train(rank, *layout, **kw) for layout, kw in cases]


def jobs(rank: int, todo: list[tuple[str, tuple, dict]]) -> list:
    """Several rank functions of this module in one spawn, in order: (name, args, kwargs) each.
    Each builds its own mesh and seeded model, so none depends on what another left behind."""
    fns = {"pp_train": pp_train, "pp_io": pp_io, "pp_resume": pp_resume, "pp_eval": pp_eval}
    return [fns[name](rank, *args, **kw) for name, args, kw in todo]


class Boom(RuntimeError):
    pass


def failing_stage(rank: int) -> dict:
    """pp=2 where stage 1's block raises on the second step. Each rank catches what ended it and
    reports it, so the test sees that stage 0 was not left waiting (the mesh timeout is short)."""
    import time

    mesh = qm.init_mesh(pp=2, timeout=20)
    net = build("gpt")
    qm.parallelize(net, mesh, verify=False)
    calls = {"n": 0}

    def hook(module, args):
        calls["n"] += 1
        if calls["n"] > 8:  # shape inference + 4 micro-batches of step 1, then fail in step 2
            raise Boom(f"stage {mesh.pp_rank} failed on purpose")

    if mesh.pp_rank == 1:
        net.blocks[3].register_forward_pre_hook(hook)
    t0 = time.monotonic()
    ids = batches(1)[0]
    try:
        for _ in range(3):
            qm.train_step(net, {"input_ids": ids}, microbatches=4, schedule="gpipe")
    except Exception as e:  # what ended this rank, with its causes
        chain, cur = [], e
        while cur is not None:
            chain.append(f"{type(cur).__name__}: {cur}")
            cur = cur.__cause__
        return {"error": " <- ".join(chain), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def misuse(rank: int) -> dict[str, str]:
    """pp=2: what each misuse raises (every rank raises the same, before any collective)."""
    mesh = qm.init_mesh(pp=2)
    out = {}
    try:
        qm.parallelize(build("llama_tied"), mesh)  # a trainable tie spanning stages 0 and 1
    except qm.PipelineError as e:
        out["tie"] = str(e)
    net = build("gpt")
    qm.parallelize(net, mesh, verify=False)
    ids = batches(1)[0]
    try:
        net(ids)
    except qm.PipelineError as e:
        out["direct"] = str(e)
    try:
        qm.export(net, "unused-export-folder")  # refused in its check, before any file
    except NotImplementedError as e:
        out["export"] = str(e)
    try:
        qm.full_state_dict(net)
    except NotImplementedError as e:
        out["full"] = str(e)
    for key, m, sched, chunk in (("1f1b", 1, "1f1b", 0), ("split", 3, "gpipe", 0),
                                 ("chunk", 4, "1f1b", 8)):  # fmt: skip
        try:
            qm.train_step(net, {"input_ids": ids}, microbatches=m, schedule=sched,
                          chunk_tokens=chunk)  # fmt: skip
        except ValueError as e:
            out[key] = str(e)
    return out


def pp_io(rank: int, root: str, pp: int, load_from: str | None = None) -> dict:
    """Load a saved (tied) Llama at `pp` stages with qm.from_pretrained (each stage reads its own
    layers), train two LoRA steps, save the adapter to ROOT/adapter-pp{pp}, report the trained
    model's loss and gradient norm; then a fresh copy loads `load_from` (an adapter saved by
    another layout) and reports its loss."""
    from pathlib import Path

    mesh = qm.init_mesh(pp=pp)
    lora = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7)
    net = qm.from_pretrained(Path(root) / "base", mesh, lora=lora, progress=False)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    ids = batches(1)[0]
    losses = []
    for _ in range(2):
        losses.append(float(qm.train_step(net, {"input_ids": ids}, microbatches=2)))
        qm.clip_grad_norm_(net, 1e9)
        opt.step()
        opt.zero_grad()
    qm.save_adapter(net, Path(root) / f"adapter-pp{pp}")
    final = float(qm.train_step(net, {"input_ids": ids}, microbatches=2))  # the trained adapter
    norm = float(qm.clip_grad_norm_(net, 1e9))  # over every stage's gradients
    loaded = None
    if load_from is not None:
        fresh = qm.from_pretrained(Path(root) / "base", mesh, lora=lora, progress=False)
        qm.load_adapter(fresh, Path(root) / load_from)
        loaded = float(qm.train_step(fresh, {"input_ids": ids}, microbatches=2))
    return {"losses": losses, "final": final, "norm": norm, "loaded": loaded}


def pp_resume(rank: int, root: str, pp: int, load_from: str | None = None) -> dict:
    """Two SGD-momentum LoRA steps at `pp` stages, save_state to ROOT/state-pp{pp}, then one more
    step: its loss is `cont`. With `load_from` (a state saved at another layout): a fresh model and
    optimizer load it and take that same step: its loss is `resumed`."""
    from pathlib import Path

    mesh = qm.init_mesh(pp=pp)
    lora = qm.LoraConfig(r=4, alpha=8, dropout=0.0, targets=TARGETS, seed=7)
    ids = batches(1)[0]

    def fresh():
        net = qm.from_pretrained(Path(root) / "base", mesh, lora=lora, progress=False)
        return net, torch.optim.SGD(qm.trainable_parameters(net), lr=0.5, momentum=0.9)

    def step(net, opt) -> float:
        loss = float(qm.train_step(net, {"input_ids": ids}, microbatches=2))
        opt.step()
        opt.zero_grad()
        return loss

    net, opt = fresh()
    step(net, opt), step(net, opt)
    qm.save_state(net, opt, Path(root) / f"state-pp{pp}", step=2)
    step(net, opt)
    out = {"cont": step(net, opt), "resumed": None, "step": None}
    if load_from is not None:
        net2, opt2 = fresh()
        out["step"] = qm.load_state(net2, opt2, Path(root) / load_from)
        step(net2, opt2)
        out["resumed"] = step(net2, opt2)
    return out


def pp_eval(rank: int, pp: int, virtual: int = 1) -> tuple:
    """Forward-only summed losses (two batch shapes) then a training step's loss, at `pp` stages."""
    from quantmesh.train.step import eval_loss_sum

    mesh = qm.init_mesh(pp=pp)
    net = build("llama")
    qm.parallelize(net, mesh, pipeline=qm.PipelineConfig(virtual=virtual) if pp > 1 else None)
    ids = batches(1)[0]
    a, n = eval_loss_sum(net, {"input_ids": ids})
    b, _ = eval_loss_sum(net, {"input_ids": ids[:3]})  # another shape: another schedule
    sched = "interleaved1f1b" if virtual > 1 else "1f1b"
    c = qm.train_step(net, {"input_ids": ids}, microbatches=4, schedule=sched)
    return float(a), n, float(b), float(c)
