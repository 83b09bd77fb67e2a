"""verify_plan: prove a plan exact on the tp group before trusting it, numerically.

A split is exact when the sharded model computes what the whole model computes: the same outputs
and the same gradient for every parameter. The planner decides splits from structure (names,
shapes, head attributes); structure cannot see what a module's forward does with them (a fused
q|k|v laid out per head, a per-head parameter applied to sharded heads, an embedding subclass that
scales its output). So every plan is checked by running it:

1. A probe: a copy of the model with each repeated block list cut to the first block of each
   distinct structure (a dense first layer, then the expert layers), random weights (the same on
   every rank), and small random inputs (the same on every rank).
2. The probe runs whole (the reference) and then sharded by the plan, forward and backward, on this
   rank's tp group. Outputs and every gradient are compared (sharded gradients gathered).
3. When the whole plan is not exact, each group of sharded modules (the sharded children of one
   parent: an attention, an MLP; the embedding; the head) is probed alone, and a group that is not
   exact on its own is replicated, with the measured error as the reason. Groups exact alone but
   not together are then added one at a time, the largest first; each is kept when the plan of
   those kept so far stays exact (a router's linear that structure put in an MLP's column group
   stays whole, the MLP split).
4. A replicated parameter whose gradient differs per rank but sums over the tp group to the
   reference (a norm shared by all heads, applied to each rank's heads: Qwen3's q_norm) gets its
   gradient all-reduced over tp ("reduce_grads"). That is a rule, not a model-specific fix: a
   replicated parameter that sees sharded activations needs its gradient reduced.

The probes run on a process group of their own with a timeout (a fresh one after a probe raised
anywhere), and the ranks agree on each outcome over another group: a rank that raises (a shape
error on one rank of an uneven split) never leaves its peers waiting. On NCCL a peer left inside a
collective is ended by NCCL's watchdog at the timeout rather than by an exception.

Example:
    >>> report = qm.verify_plan(model, mesh)   # doctest: +SKIP
    >>> print(report)                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import fnmatch
import functools
import inspect
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..plan.auto import auto_plan, blocks_of
from ..plan.plan import Plan, Resolved, _globify, size_candidates
from ..plan.styles import Style
from ..tp.kinds import kind_of

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = [
    "VerifyReport",
    "GroupVerdict",
    "verify_plan",
    "probe_inputs",
    "made_inputs",
    "probe_wait",
]

TOLERANCE = 1e-4  # relative error (max abs difference / max abs reference), fp32
PROBE_TIMEOUT_S = 60.0
# gloo (CPU ranks): a probe's collectives wait on the other ranks' one-block compute, at most
# seconds; a wrong split that makes ranks disagree on their collectives (experts routed
# differently per rank all-reduce gradients of other sizes) then costs this, not a minute. The
# wait is `GLOO_PROBE_COMPUTE_MARGIN` times the unsharded probe's own forward and backward (timed
# on each rank, first-call costs included), within [GLOO_PROBE_FLOOR_S, GLOO_PROBE_TIMEOUT_S]:
# a probe of a few milliseconds that hangs costs seconds, not the ceiling (`probe_wait`)
GLOO_PROBE_TIMEOUT_S = 15.0
GLOO_PROBE_FLOOR_S = 3.0
GLOO_PROBE_COMPUTE_MARGIN = 20.0
MAX_SIZE_CANDIDATES = 6  # integer attributes tried per failing group (all their subsets: 63 probes)


@dataclass
class GroupVerdict:
    """The verdict on one group of sharded modules (globs over repeated blocks)."""

    group: str
    modules: list[str]
    exact: bool
    detail: str  # "max rel. error 3e-07" or the exception's first line


@dataclass
class VerifyReport:
    """What verify_plan found. `overrides()` are plan rules that make the plan exact.

    Example:
        >>> report.exact, report.replicated   # doctest: +SKIP
        (False, ['model.layers.*.self_attn.q_proj', ...])
    """

    tp: int
    verified: bool  # False: the model could not be probed (see `skipped`)
    exact: bool = True  # the plan as given was exact
    groups: list[GroupVerdict] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)  # module glob -> reason
    reduce_grads: list[str] = field(default_factory=list)  # parameter globs
    contiguous: list[str] = field(default_factory=list)  # fused outputs laid out per head
    # integer attributes holding a global size, set per rank ({owner glob: {name: global value}})
    attrs: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: str = ""  # why the model was not probed

    def overrides(self) -> dict[str, str]:
        """Plan rules replicating every module of a group that was not exact."""
        return {g: Style.REPLICATE.value for g in self.replicated}

    def apply(self, plan: Plan) -> Plan:
        """`plan` with this report's findings: per-head fused layouts, failed groups replicated."""
        plan = plan.to_probe()
        if self.contiguous:
            plan = plan.with_contiguous(self.contiguous)
        if self.attrs:
            plan = plan.with_attrs(self.attrs)
        if self.replicated:
            plan = plan.override(self.overrides(), notes=self.replicated)
        return plan

    def table(self) -> str:
        if not self.verified:
            return f"plan not verified: {self.skipped}"
        lines = [f"verify at tp={self.tp}: " + ("exact" if self.exact else "NOT exact as planned")]
        for g in self.groups:
            lines.append(f"  {'ok  ' if g.exact else 'FAIL'}  {g.group}: {g.detail}")
        for glob, why in self.replicated.items():
            lines.append(f"  -> replicate {glob}: {why}")
        for glob in self.contiguous:
            lines.append(f"  -> fused output split in contiguous head blocks: {glob}")
        for glob, attrs in self.attrs.items():
            for name, value in attrs.items():
                lines.append(f"  -> set per rank (found by value): {glob}.{name} ({value} whole)")
        for glob in self.reduce_grads:
            lines.append(
                f"  -> gradient all-reduced over tp: {glob} (replicated, sees split heads)"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---- the probe model and its inputs -------------------------------------------------------------
MAX_PROBE_BLOCKS = 8  # distinct block structures a probe keeps per block list, at most


def _structure(block: nn.Module) -> tuple:
    """What a plan's globs over blocks could meet differently in two blocks: each submodule's
    name and class, each parameter's name and shape."""
    mods = tuple((n, type(m).__name__) for n, m in block.named_modules())
    return mods, tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def _reduced_copy(model: nn.Module, keep: int | None = 1) -> nn.Module:
    """A copy of `model` with each repeated block list cut to the first block of each distinct
    structure (`_structure`: a dense first layer and the mixture-of-experts layers after it are
    two; `MAX_PROBE_BLOCKS` at most), or to its first `keep` blocks where they are all alike
    (None: all blocks); parameters are fresh meta tensors (never a copy of the model's weights),
    buffers are copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    lists = {n.rsplit(".", 1)[0] for n, _ in blocks_of(model)} if keep is not None else set()
    # cut before copying, so a 70B model's blocks are never copied
    saved = {}
    for name in lists:
        ml = model.get_submodule(name)
        saved[name] = dict(ml._modules)
        kept: dict[tuple, nn.Module] = {}
        for b in saved[name].values():
            if b is not None and len(kept) < MAX_PROBE_BLOCKS:
                kept.setdefault(_structure(b), b)
        firsts = list(kept.values()) if len(kept) > 1 else list(saved[name].values())[: keep or 0]
        ml._modules = {str(i): b for i, b in enumerate(firsts)}  # renumbered, as a ModuleList
    try:
        probe = copy.deepcopy(model, memo)
    finally:
        for name, mods in saved.items():
            model.get_submodule(name)._modules = mods
    _float_linears(probe)
    return probe


def _float_linears(probe: nn.Module) -> None:
    """Quantized linears of the probe (a model quantized already) become float nn.Linear on meta:
    the probe checks the split, which does not depend on the weight's storage."""
    from ..quant.kinds import is_quantized_linear

    for fqn, mod in list(probe.named_modules()):
        if fqn and is_quantized_linear(mod):
            m = cast(Any, mod)
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            parent, _, child = fqn.rpartition(".")
            setattr(probe.get_submodule(parent), child, lin)


@torch.no_grad()
def _randomize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Random fp32 weights, the same on every rank: matrices ~ 1/sqrt(fan_in), 1-D scales near 1,
    biases small."""
    gen = torch.Generator().manual_seed(seed)
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in done:  # tied weights stay tied
                mod._parameters[name] = done[id(p)]
                continue
            if not p.is_floating_point():
                t = torch.zeros(p.shape, dtype=p.dtype)
            elif p.dim() >= 2:
                t = torch.randn(p.shape, generator=gen) / math.sqrt(max(1, p.shape[-1]))
            elif name.endswith("bias"):
                t = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            new = nn.Parameter(t.to(device), requires_grad=p.is_floating_point())
            done[id(p)] = mod._parameters[name] = new
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if b.device.type == "meta":
                    b = torch.zeros(b.shape, dtype=b.dtype)
                if b.is_floating_point() and b.dtype != torch.float32:
                    b = b.float()
                mod._buffers[name] = b.to(device)


def probe_inputs(model: nn.Module, device: torch.device, seed: int = 0) -> dict[str, Any] | None:
    """Small random inputs for a transformers model (token ids, pixels, decoder ids), or None.

    Example:
        >>> sorted(probe_inputs(model, torch.device("cpu")))   # doctest: +SKIP
        ['input_ids']
    """
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    gen = torch.Generator().manual_seed(seed)
    name = getattr(model, "main_input_name", "input_ids")
    out: dict[str, Any] = {}
    if name == "pixel_values":
        size = getattr(cfg, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        ch = getattr(cfg, "num_channels", 3)
        out[name] = torch.randn(2, ch, size, size, generator=gen).to(device)
    elif name == "input_ids":
        vocab = getattr(cfg, "vocab_size", None) or getattr(
            getattr(cfg, "text_config", None), "vocab_size", None
        )
        if not vocab:
            return None
        out[name] = torch.randint(0, vocab, (2, 8), generator=gen).to(device)
        if getattr(cfg, "is_encoder_decoder", False):
            out["decoder_input_ids"] = torch.randint(0, vocab, (2, 6), generator=gen).to(device)
    else:
        return None
    return out


def made_inputs(model: nn.Module, device: torch.device, seed: int = 0) -> tuple | None:
    """Probe inputs made from a model that is not a transformers model, or None when none can be:
    its forward must take exactly one required argument; token ids (2 x 8) when its first layer
    is an nn.Embedding, else random values of the first layer's input size (2 x 8 x in_features
    for a linear, 2 x channels x 4k x 4k for a k x k convolution).

    Example:
        >>> made_inputs(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)), torch.device("cpu"))[0].shape
        torch.Size([2, 8])
    """
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind in positional]
    required_kw = [p for p in params if p.default is p.empty and p.kind == p.KEYWORD_ONLY]
    if len(required) != 1 or required_kw:
        return None
    first = next((m for m in model.modules() if kind_of(m) is not None), None)
    kind = kind_of(first) if first is not None else None
    if first is None or kind is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    if isinstance(first, nn.Embedding):
        return (torch.randint(0, first.num_embeddings, (2, 8), generator=gen).to(device),)
    if kind.linear_like:
        return (torch.randn(2, 8, kind.in_out(first)[0], generator=gen).to(device),)
    if isinstance(first, nn.Conv2d):
        side = 4 * max(cast(tuple, first.kernel_size))
        return (torch.randn(2, first.in_channels, side, side, generator=gen).to(device),)
    return None


def _float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model output (tensor, tuple, dict, ModelOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in _float_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _float_outputs(v)]
    return []


# a kept group's wait, set again (a private torch function; without it a kept group keeps the
# wait it was made with, so the probes then wait the ceiling: `verify_plan`)
_SET_WAIT = getattr(dist.distributed_c10d, "_set_pg_timeout", None)


def probe_wait(reference_s: float) -> float:
    """How long a gloo probe's collectives wait for the other ranks, given that the unsharded
    probe's forward and backward took `reference_s` seconds in one process: a sharded probe runs
    the same compute, so a wait far beyond it is a hang (ranks that disagree on their
    collectives), not a slow rank.

    Example:
        >>> probe_wait(0.01), probe_wait(0.5), probe_wait(10.0)
        (3.0, 10.0, 15.0)
    """
    return min(
        GLOO_PROBE_TIMEOUT_S, max(GLOO_PROBE_FLOOR_S, GLOO_PROBE_COMPUTE_MARGIN * reference_s)
    )


def _run(model: nn.Module, inputs: Any, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Forward, then backward of a fixed random projection of every output."""
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    outs = _float_outputs(out)
    if not outs:
        raise ValueError(f"{type(model).__name__} returned no floating-point tensor")
    gen = torch.Generator().manual_seed(seed + 1)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
        for o in outs
        if o.requires_grad
    )
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return [o.detach().float() for o in outs], torch.as_tensor(
        float(torch.as_tensor(loss).detach())
    )


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """max |a - b| relative to max |b|, or to `floor` when b is smaller (a gradient that is zero
    in exact arithmetic, like an attention key bias's, is rounding noise on both sides)."""
    if a.shape != b.shape:
        return math.inf
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, floor) if a.numel() else 0.0


# ---- groups and collectives ---------------------------------------------------------------------
class _ProbeMesh:
    """The parts of a Mesh that parallelize uses, over a probe group of this rank's tp ranks."""

    def __init__(self, mesh: Mesh, group: Any) -> None:
        self.tp, self.tp_rank, self.tp_group = mesh.tp, mesh.tp_rank, group
        self.dp, self.dp_rank, self.pp, self.pp_rank = 1, 0, 1, 0
        self.rank = mesh.rank
        self.devices: list[torch.device] = [mesh.device]

    @property
    def device(self) -> torch.device:
        return self.devices[0]


def _tp_groups(mesh: Any) -> list[list[int]]:
    grid = mesh.device_mesh.mesh  # (dp, pp, tp)
    return [[int(r) for r in row] for row in grid.reshape(-1, mesh.tp).tolist()]


def _new_group(mesh: Any, timeout_s: float) -> Any:
    """A fresh group of this rank's tp ranks (every rank of the world creates every tp group)."""
    mine = None
    for ranks in _tp_groups(mesh):
        g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
        if mesh.rank in ranks:
            mine = g
    return mine


def _agree(ok: bool, raised: bool, group: Any, device: torch.device) -> tuple[bool, bool]:
    """(ok on every rank, raised on some rank) over `group`."""
    t = torch.tensor([int(not ok), int(raised)], dtype=torch.int32, device=device)
    dist.all_reduce(t, group=group)
    return int(t[0].item()) == 0, int(t[1].item()) > 0


class _ProbeGroups:
    """A tp group of the probe's, kept in `mesh.side_groups` under `key` and so reused by later
    calls on the mesh (making and destroying a group costs tens of milliseconds per rank, and a
    test suite parallelizes thousands of times) while no collective on it raised; one that
    raised on any rank may have left a collective half done, so the next use gets a fresh group
    (a process group is never reused after a collective raised)."""

    def __init__(self, mesh: Any, key: str, timeout_s: float) -> None:
        self.mesh, self.key, self.timeout_s = mesh, key, timeout_s
        self.groups: dict[str, Any] = getattr(mesh, "side_groups", {})

    def get(self) -> Any:
        """The group, its collectives waiting `timeout_s` (a kept one's wait is set anew: each
        rank's own, no collective; gloo's `probe_wait` follows each probe's compute)."""
        if self.key not in self.groups:
            self.groups[self.key] = _new_group(self.mesh, self.timeout_s)
        group = self.groups[self.key]
        if group is not None and _SET_WAIT is not None and _is_gloo(group):
            _SET_WAIT(datetime.timedelta(seconds=self.timeout_s), group)
        return group

    def drop(self) -> None:
        group = self.groups.pop(self.key, None)
        if group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


@contextlib.contextmanager
def _quiet_rng() -> Iterator[None]:
    """The probe draws nothing from the caller's random streams."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


# ---- the probe ----------------------------------------------------------------------------------
@dataclass
class _Outcome:
    ok: bool
    detail: str
    partial: list[str] = field(default_factory=list)  # replicated params whose grads sum to ref


def _probe(
    probe: nn.Module,
    inputs: Any,
    plan: Plan,
    mesh: Any,
    ref_out: list[torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    agree_group: Any,
    tol: float,
    groups: _ProbeGroups,
) -> _Outcome:
    """Run `probe` sharded by `plan` on the probe's tp group; compare with the reference."""
    from ..tp.gather import gather_param, tp_sharded
    from ..tp.layers import sharded_modules
    from .parallelize import parallelize

    group = groups.get()
    dev = mesh.device
    raised = False
    outcome: _Outcome
    local_ok = True
    try:
        m = copy.deepcopy(probe)
        m.zero_grad(set_to_none=True)
        probe_mesh = cast("Mesh", _ProbeMesh(mesh, group))  # the parts of a Mesh parallelize reads
        parallelize(m, probe_mesh, plan=plan, data_parallel=False, verify=False)
        outs, _ = _run(m, inputs, seed=0)
        err = math.inf  # a different number of outputs
        if len(outs) == len(ref_out):
            err = max((_rel(a, b) for a, b in zip(outs, ref_out, strict=True)), default=0.0)
        # gradients: sharded ones gathered (collective, same order on every rank)
        grads: dict[str, torch.Tensor] = {}
        for fqn, sm in sharded_modules(m).items():
            split = tp_sharded(sm)
            for pname, p in sm.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach().float()
                if pname in split:
                    dim, fs = split[pname]
                    g = gather_param(g, dim, fs, group)
                grads[f"{fqn}.{pname}"] = g
        names = sharded_modules(m)
        for name, p in m.named_parameters():
            if (
                name not in grads
                and p.grad is not None
                and not any(name.startswith(f + ".") for f in names)
            ):
                grads[name] = p.grad.detach().float()
        worst, worst_name = err, "outputs"
        order = sorted(ref_grads)
        floor = 1e-3 * max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
        errs = []
        for name in order:
            got, ref = grads.get(name), ref_grads[name]
            if got is None:
                errs.append(0.0 if ref.abs().max().item() <= floor * tol else math.inf)
            else:
                errs.append(_rel(got, ref, floor))
        # replicated gradients that differ per rank: do they sum over tp to the reference? Decided
        # together (MIN over the group), so every rank all-reduces the same tensors.
        cand = torch.tensor(
            [int(e > tol and name in grads and grads[name].shape == ref_grads[name].shape)
             for name, e in zip(order, errs, strict=True)],
            dtype=torch.int32,
        )  # fmt: skip
        dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
        partial: list[str] = []
        for i, name in enumerate(order):
            if cand[i]:
                summed = grads[name].clone()
                dist.all_reduce(summed, group=group)
                if _rel(summed, ref_grads[name], floor) <= tol:
                    partial.append(name)
                    continue
            if errs[i] > worst:
                worst, worst_name = errs[i], name
        if worst > tol:
            local_ok = False
            outcome = _Outcome(False, f"max rel. error {worst:.2g} ({worst_name})", partial)
        else:
            outcome = _Outcome(True, f"max rel. error {worst:.1g}", partial)
    except Exception as e:  # noqa: BLE001 - any failure of the sharded run is a verdict
        local_ok, raised = False, True
        line = (str(e).strip().splitlines() or [""])[0][:160]
        outcome = _Outcome(False, f"{type(e).__name__}: {line}")
    cdev = torch.device("cpu") if _is_gloo(agree_group) else dev
    all_ok, any_raised = _agree(local_ok, raised, agree_group, cdev)
    if not all_ok and outcome.ok:
        outcome = _Outcome(False, "failed on another rank of the tp group")
    if any_raised:
        groups.drop()
    return outcome


def _is_gloo(group: Any) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _groups_of(res: Resolved, probe: nn.Module) -> dict[str, list[str]]:
    """Sharded modules of the probe, grouped by parent module (as globs over blocks); modules that
    share a parameter (an embedding tied to its head) are one group, since they split alike."""
    key_of: dict[str, str] = {}
    for e in res.sharded():
        parent = e.fqn.rsplit(".", 1)[0] if "." in e.fqn else ""
        glob = _globify(parent, probe) if parent else "(top level)"
        if parent and isinstance(probe.get_submodule(parent), nn.ModuleList):
            glob = _globify(e.fqn, probe)
        key_of[e.fqn] = glob
    owners: dict[int, list[str]] = {}
    for fqn, mod in probe.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(fqn)
    for names in owners.values():  # merge the groups of modules holding one tensor
        keys = sorted({key_of[n] for n in names if n in key_of})
        for fqn, k in list(key_of.items()):
            if k in keys[1:]:
                key_of[fqn] = keys[0]
    groups: dict[str, list[str]] = {}
    for fqn, k in key_of.items():
        groups.setdefault(k, []).append(_globify(fqn, probe))
    return groups


def verify_plan(
    model: nn.Module,
    mesh: Any,
    plan: Plan | dict[str, str] | None = None,
    *,
    inputs: Any = None,
    tol: float = TOLERANCE,
    seed: int = 0,
) -> VerifyReport:
    """Check `plan` numerically against the unsharded model on this rank's tp group.

    Collective: every rank of the world calls it (each tp group probes on its own). The model is
    not changed (a reduced random copy is probed). `inputs`: a dict of keyword arguments, a tuple of
    positional ones, or a callable(model, device) returning either; None: made from the model
    (token ids or pixels for a transformers model, else `made_inputs`). A group that is not exact
    gets its parent's integer attributes that may hold a global size (`size_candidates`) tried
    per rank, the fewest first; a set that makes it exact is kept (`report.attrs`). Returns a
    report; `report.overrides()` replicates what failed.

    Example:
        >>> report = qm.verify_plan(model, mesh)    # doctest: +SKIP
        >>> report.exact                            # doctest: +SKIP
        True
    """
    if isinstance(plan, dict):
        plan = Plan(plan)
    if plan is None:
        plan = auto_plan(model, mesh.tp)
    plan = plan.to_probe()  # the probe decides what the source scan could only suspect
    report = VerifyReport(tp=mesh.tp, verified=False)
    if mesh.tp == 1:
        report.skipped = "tp=1: nothing is split"
        return report
    dev = mesh.device
    with _quiet_rng():
        given = inputs
        ref_out: list[torch.Tensor] = []
        ref_grads: dict[str, torch.Tensor] = {}
        failure = ""
        ref_s = 0.0  # the unsharded probe's forward and backward, seconds
        for reduced in (True, False):  # a model that indexes its blocks needs them all
            cpu = torch.device("cpu")
            if (
                given is None
                and (probe_inputs(model, cpu, seed) or made_inputs(model, cpu)) is None
            ):
                report.skipped = (  # said before any weight is made
                    f"{type(model).__name__} is not a transformers model, no probe input could "
                    "be made from it (its forward takes more than one required argument, or its "
                    "first layer is not an embedding, linear or convolution) and no example "
                    "inputs were given (pass inputs=... / example_inputs=...)"
                )
                return report
            probe = _reduced_copy(model) if reduced else _reduced_copy(model, keep=None)
            _randomize(probe, dev, seed)
            probe.eval()  # no dropout: the comparison is about the split
            inputs = given(probe, dev) if callable(given) else given
            if inputs is None:
                inputs = probe_inputs(probe, dev, seed) or made_inputs(probe, dev, seed)
            try:  # one process, no collectives: safe to fail here
                ref = copy.deepcopy(probe)
                t0 = time.perf_counter()
                ref_out, _ = _run(ref, inputs, seed=0)
                ref_s = time.perf_counter() - t0
                ref_grads = {
                    n: p.grad.detach().float()
                    for n, p in ref.named_parameters()
                    if p.grad is not None
                }
                del ref
                failure = ""
                break
            except Exception as e:  # noqa: BLE001 - the whole model fails: nothing to compare
                made = " on inputs made from the model" if given is None else ""
                failure = f"the unsharded probe failed{made} ({type(e).__name__}: {e})"
        if failure:
            report.skipped = failure
            return report
        wait = PROBE_TIMEOUT_S
        if _is_gloo(mesh.tp_group):
            wait = probe_wait(ref_s) if _SET_WAIT is not None else GLOO_PROBE_TIMEOUT_S
        agreeing = _ProbeGroups(mesh, "verify.agree", wait * 3)
        pgroups = _ProbeGroups(mesh, "verify.probe", wait)
        try:
            agree_group = agreeing.get()
            run: Callable[[Plan], _Outcome] = lambda p: _probe(  # noqa: E731
                probe, inputs, p, mesh, ref_out, ref_grads, agree_group, tol, pgroups
            )
            return _verify(plan, probe, mesh.tp, report, run)
        except BaseException:  # a collective may have failed half done: no group is reused
            agreeing.drop()
            pgroups.drop()
            raise
    return report


def _verify(
    plan: Plan, probe: nn.Module, tp: int, report: VerifyReport, run: Callable[[Plan], _Outcome]
) -> VerifyReport:
    """verify_plan's verdicts, once the reference ran: `run` probes a plan on the tp group
    against it (collective)."""
    report.verified = True
    resolved = plan.resolve(probe, tp)  # the plan as the probe sees it
    groups = _groups_of(resolved, probe)
    whole = run(plan)
    report.reduce_grads = sorted({_param_glob(n, probe) for n in whole.partial})
    if whole.ok:
        report.groups = [GroupVerdict("whole plan", [], True, whole.detail)]
    else:
        report.exact = False
        everything = [m for ms in groups.values() for m in ms]
        packed = _packed_of(resolved, probe)
        for glob, members in groups.items():
            others = {m: Style.REPLICATE.value for m in everything if m not in members}
            alone = plan.override(others) if others else plan
            out = run(alone) if others else whole
            fused = [m for m in members if m in packed]
            if not out.ok and fused:  # q|k|v fused per head rather than in segments?
                retry = run(alone.with_contiguous(fused))
                if retry.ok:
                    report.contiguous += fused
                    out = _Outcome(True, f"{retry.detail}, fused outputs per head")
            if not out.ok:  # a head count or width the forward reads as a global size?
                found = _sizes_per_rank(probe, resolved, members, alone, run)
                if found is not None:
                    attrs, retry = found
                    for g, a in attrs.items():
                        report.attrs.setdefault(g, {}).update(a)
                    names = ", ".join(f"{g}.{n}" for g, a in attrs.items() for n in a)
                    out = _Outcome(True, f"{retry.detail}, per rank: {names}")
            report.groups.append(GroupVerdict(glob, members, out.ok, out.detail))
            if not out.ok:
                for m in members:
                    report.replicated[m] = (
                        f"replicated: verify: not exact when split ({out.detail})"
                    )
        changed = report.replicated or report.contiguous or report.attrs
        final = run(report.apply(plan)) if changed else whole
        report.groups.append(GroupVerdict("plan with those changes", [], final.ok, final.detail))
        if not final.ok:  # exact alone, not together: keep the groups that are exact together
            final = _compatible_groups(plan, probe, groups, report, run, final)
        report.reduce_grads = sorted({_param_glob(n, probe) for n in final.partial})
    return report


def _compatible_groups(
    plan: Plan,
    probe: nn.Module,
    groups: dict[str, list[str]],
    report: VerifyReport,
    run: Callable[[Plan], _Outcome],
    together: _Outcome,
) -> _Outcome:
    """Groups exact alone but not together (a router's linear joined an MLP's column group, its
    output read by a softmax rather than by the MLP's row layer): add them one at a time, the
    largest first, each kept when the plan of those kept so far stays exact, the rest replicated
    with the reason. One probe per group (the last one's, all of them, is `together`, known
    already); returns the outcome of the plan kept."""
    left = {g: ms for g, ms in groups.items() if not any(m in report.replicated for m in ms)}

    def size(glob: str) -> int:
        return sum(
            p.numel()
            for n, mod in probe.named_modules()
            if any(fnmatch.fnmatchcase(n, m) for m in left[glob])
            for p in mod.parameters()
        )

    kept: list[str] = []
    outcome: _Outcome | None = None  # the plan of the groups kept
    for glob in sorted(left, key=size, reverse=True):
        rest = [m for g in left if g not in kept and g != glob for m in left[g]]
        if rest:
            out = run(report.apply(plan).override(dict.fromkeys(rest, Style.REPLICATE.value)))
        else:  # every group: the plan that failed together (a wrong split may hang a probe)
            out = together
        report.groups.append(GroupVerdict(f"with {glob}", left[glob], out.ok, out.detail))
        if out.ok:
            kept.append(glob)
            outcome = out
            continue
        for m in left[glob]:
            report.replicated[m] = (
                f"replicated: verify: exact alone, not beside the larger groups kept split "
                f"({out.detail})"
            )
    return outcome if outcome is not None else run(report.apply(plan))  # none: nothing split


def _sizes_per_rank(
    probe: nn.Module,
    resolved: Resolved,
    members: list[str],
    alone: Plan,
    run: Callable[[Plan], _Outcome],
) -> tuple[dict[str, dict[str, int]], _Outcome] | None:
    """The fewest integer attributes of the group's parents that, set per rank, make the group
    exact ({owner glob: {name: global value}}, with that probe's outcome), or None. The
    candidates are found by value (`size_candidates`); only the probe says which are sizes."""
    cands: list[tuple[str, str, int]] = []
    owners = {e.fqn.rsplit(".", 1)[0] for e in resolved.sharded() if "." in e.fqn}
    for owner in sorted(owners):
        glob = _globify(owner, probe)
        if any(m.rsplit(".", 1)[0] == glob for m in members):
            for name, (value, _) in size_candidates(probe, resolved, owner).items():
                cands.append((glob, name, value))
    cands = cands[:MAX_SIZE_CANDIDATES]
    for k in range(1, len(cands) + 1):
        for subset in itertools.combinations(cands, k):
            attrs: dict[str, dict[str, int]] = {}
            for glob, name, value in subset:
                attrs.setdefault(glob, {})[name] = value
            out = run(alone.with_attrs(attrs))
            if out.ok:
                return attrs, out
    return None


def _packed_of(res: Resolved, probe: nn.Module) -> set[str]:
    """Globs of the modules whose fused output the plan splits as q|k|v (or gate|up) segments."""
    return {
        _globify(e.fqn, probe)
        for e in res.sharded()
        if e.split is not None and len(e.split.per_rank[0]) > 1 and not e.contiguous
    }


def _param_glob(name: str, probe: nn.Module) -> str:
    mod, _, pname = name.rpartition(".")
    return f"{_globify(mod, probe)}.{pname}" if mod else pname


def reduce_partial_grads(model: nn.Module, globs: list[str], group: Any) -> list[str]:
    """All-reduce over `group` the gradient of every parameter matching `globs` (each backward,
    before accumulation). Returns the names hooked.

    Example:
        >>> reduce_partial_grads(model, ["model.layers.*.self_attn.q_norm.weight"], mesh.tp_group)  # doctest: +SKIP
        ['model.layers.0.self_attn.q_norm.weight', ...]
    """
    hooked = []
    for name, p in model.named_parameters():
        if p.requires_grad and any(fnmatch.fnmatchcase(name, g) for g in globs):
            p.register_hook(functools.partial(_summed, group=group))
            hooked.append(name)
    return hooked


def _summed(grad: torch.Tensor, group: Any) -> torch.Tensor:
    """This backward's gradient summed over the tp group (each rank holds its heads' part)."""
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=group)
    return grad
