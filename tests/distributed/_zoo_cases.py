"""Rank-side code of the architecture zoo (tests/distributed/test_zoo.py), spawned by run_ranks.

`zoo_rank` runs every named zoo model in one process per rank and returns plain facts. Each model
is three independent jobs, each on a fresh copy of the same reference model:

- main: `qm.parallelize(copy, mesh)` (auto plan, fp32), then the same probe loss forward and
  backward on the copy and on the reference: output error, every parameter's gradient error (split
  ones gathered over tp), the CPU RNG state after parallelize and after the step, the fraction of
  parameter elements split over tp, and the planner's reasons for what it replicated.
- lora: adapters on every linear layer (except the output head), B set to nonzero values, against
  peft's LoRA on the unsharded reference holding the same A and B.
- nf4: `quant="nf4"` against the unsharded fp32 model holding the sharded model's own dequantized
  weights (`full_state_dict` gathers and dequantizes them): the sharded computation must add no
  error of its own. Also reported: which weights dequantize differently from quantizing the whole
  weight at once (blocks that straddle a shard boundary).

One rank raising inside a job while its peers wait in a collective would hang them, so the ranks
agree after every job through the process group's store (not through a collective, which may be
the thing that is stuck): a job failed on one rank counts as failed on all. A peer stuck in a
collective is freed by the gloo timeout; that leaves the ranks' collective sequences apart, so the
rank function then stops and names the models it did not run (`"_not_run"`); the parent launches
again for those.
"""

from __future__ import annotations

import copy
import datetime
import pickle
import time
import traceback
import zlib

import torch
from torch import nn

PROBE_SEED = 123
LORA_R, LORA_ALPHA = 4, 8


def _probe(y: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(y.shape, generator=g).to(y.dtype)


def _step(model: nn.Module, inputs: dict) -> torch.Tensor:
    """Forward, probe loss, backward; the output (detached)."""
    from tests.zoo import output_of

    y = output_of(model(**inputs))
    (y * _probe(y)).sum().backward()
    return y.detach()


def _rel(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if scale is None else scale
    return float((got - want).abs().max()) / max(scale, 1e-30)


def _state_hash(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().tobytes())


def full_grads(model: nn.Module, only_trainable: bool = False) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole gradient: split ones all-gathered over tp (collective: every rank
    calls it; the order is the model's, the same on every rank). A missing gradient is gathered as
    zeros, so that a rank never skips a collective its peers enter, and reported as None."""
    from quantmesh.tp.gather import gather_param, tp_sharded
    from quantmesh.tp.layers import ShardedModule

    mods = dict(model.named_modules())
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        if only_trainable and not p.requires_grad:
            continue
        owner, _, local = name.rpartition(".")
        m = mods[owner]
        g = p.grad
        if isinstance(m, ShardedModule):
            split = tp_sharded(m)
            if local in split:
                dim, s = split[local]
                full = gather_param(g if g is not None else torch.zeros_like(p), dim, s, m.group)
                out[name] = full if g is not None else None
                continue
        out[name] = None if g is None else g.detach().clone()
    return out


def _owner_scales(ref: nn.Module) -> dict[str, float]:
    scale: dict[str, float] = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        if p.grad is not None:
            owner = n.rpartition(".")[0]
            scale[owner] = max(scale.get(owner, 0.0), float(p.grad.abs().max()))
    return scale


def grad_errors(got: dict[str, torch.Tensor | None], ref: nn.Module, ref64: nn.Module) -> dict:
    """Gradient errors of `got` against the fp32 reference, each with its own tolerance.

    Each error is divided by the largest reference gradient of the same module (as in
    tests/models.py compare_tp): a key bias has an exactly-zero true gradient, so its computed value
    is rounding noise, and noise over noise would say nothing. The tolerance of each tensor is
    `tolerance(floor)`, floor = the fp32 reference's own distance from an fp64 copy of it.

    Returns: worst (error, name), ratio (largest error / tolerance, name), one_sided (parameters
    with a gradient on one side only)."""
    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    r64 = dict(ref64.named_parameters(remove_duplicate=False))
    scale, scale64 = _owner_scales(ref), _owner_scales(ref64)
    worst, ratio, one_sided = (0.0, None), (0.0, None), []
    for n, g in got.items():
        want = ref_p[n].grad
        if (g is None) != (want is None):
            one_sided.append(n)
            continue
        if g is None:
            continue
        owner = n.rpartition(".")[0]
        e = _rel(g, want, scale.get(owner, 0.0))
        floor = _rel(want, r64[n].grad, scale64.get(owner, 0.0))
        if e >= worst[0]:
            worst = (e, n)
        if e / tolerance(floor) >= ratio[0]:
            ratio = (e / tolerance(floor), n)
    return {"worst": worst, "ratio": ratio, "one_sided": one_sided}


TOL = 1e-4  # fp32: rounding of a few reductions over <= 128 terms is ~1e-6; real bugs are O(1)


def tolerance(floor: float) -> float:
    """1e-4 relative, or 10x the fp32 reference's own error against fp64 where that is larger
    (a cancelling gradient, like a key projection's under softmax, is noisier than 1e-5)."""
    return max(TOL, 10 * floor)


def _ref64(ref: nn.Module, inputs: dict) -> tuple[nn.Module, float]:
    """An fp64 copy of `ref` stepped on the same inputs; returns it and the fp32 output's distance
    from it (the output floor). `ref` must have been stepped already."""
    from tests.zoo import output_of

    r64 = copy.deepcopy(ref).double()
    r64.zero_grad(set_to_none=True)
    ins = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    y64 = _step(r64, ins)
    with torch.no_grad():
        y32 = output_of(ref(**inputs))
    return r64, _rel(y32, y64)


def split_fraction(model: nn.Module, ref: nn.Module) -> float:
    """Elements of the reference's parameters that are split over tp / all its elements (tied
    parameters counted once)."""
    from quantmesh.tp.gather import tp_sharded
    from quantmesh.tp.layers import ShardedModule

    ref_p = dict(ref.named_parameters(remove_duplicate=False))
    split_ids: set[int] = set()
    for fqn, m in model.named_modules():
        if isinstance(m, ShardedModule):
            for local in tp_sharded(m):
                if not local.startswith("lora_"):
                    split_ids.add(id(ref_p[f"{fqn}.{local}"]))
    total = sum(p.numel() for p in ref.parameters())
    split = sum(p.numel() for p in ref.parameters() if id(p) in split_ids)
    return split / total


def layout(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """The state dict's keys in order, then every buffer (persistent or not) with its persistence:
    what a full save holds, and what `load_state_dict` into the original class expects. Names
    containing one of `skip` (adapters) are left out."""
    rows = [k for k in model.state_dict()]
    for fqn, mod in model.named_modules():
        for name in mod._buffers:
            full = f"{fqn}.{name}" if fqn else name
            kept = "non-persistent" if name in mod._non_persistent_buffers_set else "persistent"
            rows.append(f"{full} ({kept} buffer)")
    return [r for r in rows if not any(s in r for s in skip)]


def layout_diff(got: list[str], want: list[str]) -> str:
    """An empty string when equal, else what differs: names on one side only, or the first out of
    order."""
    if got == want:
        return ""
    extra, missing = [k for k in got if k not in want], [k for k in want if k not in got]
    if extra or missing:
        return f"extra {extra[:3]}, missing {missing[:3]}"
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return f"order: {got[i]} where the model has {want[i]}"


def replicated_reasons(model: nn.Module) -> dict[str, str]:
    """{module: the planner's reason} for every plan entry that is not split."""
    from quantmesh.parallel.state import parallel_state

    entries = parallel_state(model).plan.entries
    return {fqn: e.reason for fqn, e in entries.items() if e.split is None}


# --------------------------------------------------------------------------------------- jobs


def job_main(name: str, mesh) -> dict:
    import quantmesh as qm
    from tests.zoo import ZOO

    case = ZOO[name]
    ref, inputs = case.build(0), case.inputs()
    model = copy.deepcopy(ref)
    torch.manual_seed(1234)  # the same seed on every rank: the state must stay the same
    qm.parallelize(model, mesh)
    facts: dict = {"rng_parallelize": _state_hash(torch.get_rng_state())}
    facts["keys"] = layout_diff(layout(model), layout(ref))
    facts["split"] = split_fraction(model, ref)
    facts["replicated"] = replicated_reasons(model)
    y_ref = _step(ref, inputs)
    y = _step(model, inputs)
    facts["rng_step"] = _state_hash(torch.get_rng_state())
    ref64, floor = _ref64(ref, inputs)
    facts["forward"] = _rel(y, y_ref)
    facts["forward_tol"] = tolerance(floor)
    facts["grads"] = grad_errors(full_grads(model), ref, ref64)
    return facts


def _set_b(model: nn.Module) -> None:
    """Nonzero B (a fresh adapter is a no-op and gives A no gradient), drawn whole per module and
    sliced as this rank holds it."""
    from quantmesh.tp.experts import ShardedExperts
    from quantmesh.tp.gather import tp_sharded
    from quantmesh.tp.layers import ShardedModule

    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, ShardedExperts):
                split = tp_sharded(m)
                for tname, ad in m.expert_lora.items():
                    key = f"expert_lora.{tname}.lora_B.weight"
                    g = torch.Generator().manual_seed(zlib.crc32(f"{name}.{key}".encode()))
                    b = torch.randn(m.full_shapes[tname][m.tensors[tname].out_dim],
                                    ad.lora_B.weight.shape[1], generator=g) * 0.5  # fmt: skip
                    if key in split:
                        b = torch.cat([b[a:z] for a, z in split[key][1].ranges(m.tp_rank)])
                    ad.lora_B.weight.copy_(b)
            if not isinstance(m, ShardedModule) or m.lora is None:
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            b = torch.randn(m.out_full, LORA_R, generator=g) * 0.5
            if "lora_B.weight" in tp_sharded(m):
                b = torch.cat([b[a:z] for a, z in m.split.ranges(m.tp_rank)])
            m.lora_B.weight.copy_(b)


def job_lora(name: str, mesh) -> dict:
    import peft

    import quantmesh as qm
    from quantmesh.io.adapter import expert_adapter_keys
    from quantmesh.tp.experts import ShardedExperts, find_experts
    from tests.zoo import ZOO, linear_names

    case = ZOO[name]
    ref, inputs = case.build(0), case.inputs()
    targets = linear_names(ref, case.lora_skip)
    # the expert tensors too (PEFT: target_parameters), each by its full name
    tensors = [f"{f}.{t.name}" for f, ts in find_experts(ref).items() for t in ts]
    tensors = [t for t in tensors if not t.endswith(case.lora_skip)]
    model = copy.deepcopy(ref)
    cfg = qm.LoraConfig(r=LORA_R, alpha=LORA_ALPHA, targets=targets + tensors)
    qm.parallelize(model, mesh, lora=cfg)
    keys = layout_diff(layout(model, skip=("lora_",)), layout(ref))
    _set_b(model)
    sd = qm.full_state_dict(model, rank0_only=False)
    extra = {"target_parameters": tensors} if tensors else {}
    pm = peft.get_peft_model(
        copy.deepcopy(ref),
        peft.LoraConfig(
            r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0, **extra
        ),
    )
    with torch.no_grad():
        for t in targets:
            for ab in ("lora_A", "lora_B"):
                pm.get_parameter(f"base_model.model.{t}.{ab}.default.weight").copy_(
                    sd[f"{t}.{ab}.weight"]
                )
        for m in model.modules():
            if isinstance(m, ShardedExperts):
                for key, (tname, ab) in expert_adapter_keys(m).items():
                    peft_name = f"base_model.model.{key[: -len('.weight')]}.default.weight"
                    pm.get_parameter(peft_name).copy_(
                        sd[f"{m.fqn}.expert_lora.{tname}.{ab}.weight"]
                    )
    y_ref = _step(pm, inputs)
    y = _step(model, inputs)
    pm64, floor = _ref64(pm, inputs)
    from tests.distributed._lora_cases import whole_lora

    ours = whole_lora(model, missing_as_zero=True)
    got = {f"base_model.model.{k[: -len('.weight')]}.default.weight": g for k, g in ours.items()}
    return {
        "logits": _rel(y, y_ref),
        "logits_tol": tolerance(floor),
        "grads": grad_errors(got, pm, pm64),
        "n_adapters": len(targets) + len(tensors),
        "keys": keys,
    }


def job_nf4(name: str, mesh) -> dict:
    import quantmesh as qm
    from tests.zoo import ZOO

    case = ZOO[name]
    ref, inputs = case.build(0), case.inputs()
    model = copy.deepcopy(ref)
    qm.parallelize(model, mesh, quant="nf4")
    sd = qm.full_state_dict(model, rank0_only=False)  # gathered, dequantized
    deq = _same_ties(copy.deepcopy(ref), model)
    deq.load_state_dict(sd)
    y_ref = _step(deq, inputs)
    y = _step(model, inputs)
    deq64, floor = _ref64(deq, inputs)
    got = full_grads(model, only_trainable=True)
    facts = {"logits": _rel(y, y_ref), "logits_tol": tolerance(floor)}
    facts["grads"] = grad_errors(got, deq, deq64)
    facts["vs_whole"] = _vs_whole(model, ref, sd, inputs)
    return facts


def _same_ties(deq: nn.Module, model: nn.Module) -> nn.Module:
    """Untie in `deq` the parameters that `model` no longer shares (a quantized head tied to a
    float embedding holds its own dequantized weight), so both hold the same values."""
    got = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for n, p in deq.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    for names in groups.values():
        if len(names) > 1 and len({id(got[n]) for n in names}) > 1:
            for n in names[1:]:
                owner, _, pname = n.rpartition(".")
                m = deq.get_submodule(owner)
                setattr(m, pname, nn.Parameter(getattr(m, pname).detach().clone()))
    return deq


def _vs_whole(model: nn.Module, ref: nn.Module, sd: dict, inputs: dict) -> dict:
    """How the sharded model's nf4 weights relate to nf4 of each whole weight (quantize, then
    slice): the weights whose dequantized values differ (shard boundaries inside a 64-element block,
    or per-shard double-quant statistics), and the output's relative distance to that model.
    Information, not a check: per-shard quantization is a choice, its error is the format's."""
    import bitsandbytes.functional as bnbf

    from quantmesh.parallel.state import parallel_state
    from quantmesh.tp.layers import ShardedModule

    qcfg = parallel_state(model).quant
    whole_model = copy.deepcopy(ref)
    mods = dict(whole_model.named_modules())
    differ = []
    with torch.no_grad():
        for fqn, m in model.named_modules():
            if (
                not isinstance(m, ShardedModule)
                or m.fmt is None
                or not hasattr(mods[fqn], "weight")
            ):
                continue  # (expert tensors: ShardedExperts, judged by the logits and gradients)
            w = mods[fqn].weight
            conv1d = m.kind.name == "Conv1D"  # (in, out): quantized as (out, in)
            w2 = (w.t() if conv1d else w).contiguous()
            q, st = bnbf.quantize_4bit(
                w2,
                blocksize=getattr(qcfg, "blocksize", None) or 64,
                quant_type="nf4",
                compress_statistics=bool(getattr(qcfg, "double_quant", True)),
            )
            d = bnbf.dequantize_4bit(q, st).to(w.dtype)
            w.copy_(d.t() if conv1d else d)
            if not torch.equal(w, sd[f"{fqn}.weight"]):
                differ.append(fqn)
    with torch.no_grad():
        from tests.zoo import output_of

        y_whole = output_of(whole_model(**inputs))
        y = output_of(model(**inputs))
    return {"differ": differ, "logits": _rel(y, y_whole)}


JOBS = {"main": job_main, "lora": job_lora, "nf4": job_nf4}


# --------------------------------------------------------------------------------- the rank


class _Agree:
    """All ranks' payloads of one step, exchanged through the store (never a collective)."""

    def __init__(self, rank: int, world: int, wait_s: float):
        import torch.distributed as dist

        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world, self.n = rank, world, 0
        self.wait = datetime.timedelta(seconds=wait_s)

    def __call__(self, payload) -> list:
        key = f"zoo/{self.n}/"
        self.n += 1
        self.store.set(key + str(self.rank), pickle.dumps(payload))
        keys = [key + str(r) for r in range(self.world)]
        self.store.wait(keys, self.wait)
        return [pickle.loads(self.store.get(k)) for k in keys]


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:160]}"


def _desync(err: str | None) -> bool:
    return err is not None and ("Timed out" in err or "DistBackendError" in err)


def _probe_each_model_once() -> list[str]:
    """Make `qm.parallelize`'s probe (`verify_plan`) run once per model in this rank process: the
    lora and nf4 jobs take a copy of the report their model's main job made. parallelize calls
    verify_plan on the float model before it quantizes or adds adapters, with the auto plan and
    no inputs in every job, so their probes would repeat the main job's to the value (a third of
    the zoo's time). The key holds the plan's rules and every argument; set `[0]` of the returned
    list to the model's name before its jobs."""
    from quantmesh.parallel import verify

    real = verify.verify_plan
    current = [""]
    reports: dict[str, object] = {}

    def once(model, mesh, plan=None, **kw):
        rules = None if plan is None else sorted(getattr(plan, "rules", {"?": repr(plan)}).items())
        key = repr((current[0], type(model).__name__, mesh.tp, rules, sorted(kw.items())))
        if key not in reports:
            reports[key] = real(model, mesh, plan, **kw)
        return copy.deepcopy(reports[key])

    verify.verify_plan = once
    return current


def zoo_rank(rank: int, tp: int, jobs: dict[str, list[str]], collective_s: float = 30.0) -> dict:
    """Run `jobs` ({model: [job names]}) in order on a tp mesh; {model: {job: facts or error}}.

    A job's facts are the same dict on every rank, plus per-rank values under "ranks" where ranks
    may differ (errors, RNG hashes). `collective_s` bounds every collective (gloo timeout).
    """
    import warnings

    import quantmesh as qm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    mesh = qm.init_mesh(tp=tp, timeout=collective_s)
    agree = _Agree(rank, tp, 3 * collective_s + 30)
    out: dict = {}
    names = list(jobs)
    probing = _probe_each_model_once()
    for i, name in enumerate(names):
        out[name] = {}
        probing[0] = name
        for job in jobs[name]:
            t0 = time.perf_counter()
            facts, err = None, None
            try:
                facts = JOBS[job](name, mesh)
            except Exception as e:  # reported as a fact, never raised: other models still run
                err = _short(e)
                if rank == 0:
                    facts = {"traceback": traceback.format_exc()[-3000:]}
            everyone = agree((err, facts))
            errs = [e for e, _ in everyone]
            res: dict = {"seconds": time.perf_counter() - t0}
            if any(e is not None for e in errs):
                # the cause, not a peer's timeout waiting for the rank that raised
                res["error"] = min(
                    (e for e in errs if e), key=lambda e: (_desync(e), errs.index(e))
                )
                res["error_ranks"] = [r for r, e in enumerate(errs) if e is not None]
                if everyone[0][1]:
                    res["traceback"] = everyone[0][1].get("traceback")
            else:
                res.update(_merge([f for _, f in everyone]))
            out[name][job] = res
            if any(_desync(e) for e in errs):
                out["_not_run"] = names[i + 1 :]
                out["_desync"] = f"{name}/{job}"
                return out
    out["_not_run"] = []
    return out


def _merge(per_rank: list[dict]) -> dict:
    """One dict from every rank's facts: errors are the worst over ranks, RNG hashes a verdict."""
    first = per_rank[0]
    merged: dict = {}
    for k, v in first.items():
        vals = [f[k] for f in per_rank]
        if k in ("rng_parallelize", "rng_step"):
            merged[k] = len(set(vals)) == 1  # True: every rank holds the same generator state
        elif isinstance(v, float) and k.endswith("_tol"):
            merged[k] = min(vals)
        elif isinstance(v, float):
            merged[k] = max(vals)
        elif k == "grads":
            merged[k] = {
                "worst": max((f["worst"] for f in vals), key=lambda t: t[0]),
                "ratio": max((f["ratio"] for f in vals), key=lambda t: t[0]),
                "one_sided": sorted({n for f in vals for n in f["one_sided"]}),
            }
        elif k == "keys":  # a difference seen on any rank
            merged[k] = next((x for x in vals if x), "")
        elif k == "vs_whole":
            differ = sorted({n for f in vals for n in f["differ"]})
            merged[k] = {"differ": differ, "logits": max(f["logits"] for f in vals)}
        else:
            merged[k] = v
    return merged
