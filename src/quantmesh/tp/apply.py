"""apply_tp: swap every planned, quantized or LoRA-targeted module for a ShardedModule, in place.

Order per module: build the empty local shard on its device -> fill it from the original module when
that one holds real weights (sliced per rank first, so no device ever sees a full copy) -> attach LoRA.
Modules left alone are materialized on their device (meta -> uninitialized, to be loaded).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..lora.adapter import _init_A, attach_lora
from ..parallel.layersplit import device_of
from ..plan.styles import Style
from .experts import ShardedExperts
from .kinds import kind_of
from .layers import ShardedModule, inside_sharded, sharded_modules, share_colwise_copies
from .rng import RngRegions

__all__ = ["apply_tp", "held_dtypes", "norm_params", "shared_params", "split_norm", "view_heads"]


def shared_params(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module fqn, parameter name) holding one Parameter (weights, biases, any name)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((fqn, pname))
    return [o for o in owners.values() if len(o) > 1]


def held_dtypes(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """{parameter or buffer name: the dtype it keeps} when the model is cast to `dtype`, as
    transformers loads it: the names of its `_keep_in_fp32_modules_strict` (fp16, bf16) and
    `_keep_in_fp32_modules` (fp16) stay float32, and a floating parameter the model made in a
    dtype other than most of its weights' (a router built in float32 in a bf16 model) keeps it.

    Example:
        >>> held_dtypes(deepseek_v3_in_bf16, torch.bfloat16)  # doctest: +SKIP
        {'model.layers.1.mlp.gate.weight': torch.float32}
    """
    import re

    if dtype is None:
        return {}
    held: dict[str, torch.dtype] = {}
    sizes: dict[torch.dtype, int] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    for _, p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) > 1:  # the model's own dtype: most of its weights'
        own = max(sizes, key=lambda d: sizes[d])
        held.update({n: p.dtype for n, p in params if p.dtype != own})
    plan = getattr(model, "_get_dtype_plan", None)
    patterns = plan(dtype) if callable(plan) else {}
    if patterns:  # transformers' reading: each "*" any run, searched in the name
        found = re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in patterns))
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and found.search(n):
                held[n] = torch.float32
    return held


def _retie_unwrapped(model: nn.Module, shared, built: dict[str, ShardedModule]) -> None:
    """A parameter a wrapped module keeps whole (a colwise_gather head's bias) that was shared with
    a module left alone (BERT's cls.predictions.bias) is shared again: one tensor, one gradient.
    The plan refuses ties whose wrapped side is split (plan._check_ties)."""
    for group in shared:
        src = next((built[f]._parameters.get(p) for f, p in group if f in built), None)
        if src is None:
            continue
        for fqn, pname in group:
            if fqn in built or inside_sharded(fqn, built):
                continue
            mod = model.get_submodule(fqn)
            p = mod._parameters[pname]
            assert p is not None  # listed by named_parameters
            if p.shape == src.shape:  # not a split or quantized tensor
                mod._parameters[pname] = src


def apply_tp(
    model: nn.Module,
    mesh,
    resolved,
    *,
    wrap: dict[str, dict],
    placement,
    rng: RngRegions,
    dtype=None,
    lora=None,
) -> nn.Module:
    """Replace modules named in `wrap` ({fqn: {"fmt": QuantFormat|None}}) by ShardedModules.

    Example:
        >>> apply_tp(model, mesh, plan.resolve(model, mesh.tp), wrap=..., placement={"": dev})  # doctest: +SKIP
    """
    held = held_dtypes(model, dtype)  # a router kept in float32 (transformers' rule)
    shared = shared_params(model)
    # modules whose weights are tied (an embedding and its head)
    tied = [[f for f, p in g if p == "weight"] for g in shared]
    tied = [g for g in tied if len(g) > 1]
    built: dict[str, ShardedModule] = {}
    for fqn in [n for n, _ in model.named_modules() if n in wrap]:
        orig = model.get_submodule(fqn)
        if "experts" in wrap[fqn]:
            built[fqn] = _build_experts(model, mesh, fqn, wrap[fqn], placement, dtype, lora)
            continue
        entry = resolved.entries.get(fqn)
        split = entry.split if entry is not None else None
        style = entry.style if split is not None else Style.REPLICATE
        device = device_of(placement, fqn)
        kind = kind_of(orig)
        assert kind is not None, f"{fqn}: {type(orig).__name__} has no Kind"  # wrap: shardable
        m = ShardedModule.build(
            orig,
            fqn,
            kind,
            style,
            split,
            rank=mesh.tp_rank,
            group=mesh.tp_group if split is not None else None,
            device=device,
            dtype=held.get(f"{fqn}.weight", dtype),
            fmt=wrap[fqn].get("fmt"),
        )
        m.fill_from(orig)  # when it holds values (not on meta)
        m.keep_buffers(orig, device)
        if lora is not None and wrap[fqn].get("lora"):
            attach_lora(m, lora, device=device)
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, m)
        built[fqn] = m
    for names in tied:  # re-tie shared weights (their splits were checked equal by the plan)
        first = next((built[n] for n in names if n in built), None)
        if first is None:
            continue  # none of them was wrapped
        for n in names:
            if n in built and built[n] is not first and first.fmt is None and built[n].fmt is None:
                built[n].tie_weight(first)
    _retie_unwrapped(model, shared, built)
    _materialize_rest(model, placement, dtype, held)
    track = _has_dropout(model)  # without dropout, the RNG-region bookkeeping is pure overhead
    for m in built.values():
        m.set_rng(rng, track)  # the experts never track: their routed computation is whole
    share_colwise_copies(model)  # q, k, v (gate, up) share one input copy under compile too
    own_config: set[str] = set()  # owners given their own copy of the config in this loop
    for owner, attrs in resolved.attr_updates.items():
        mod = model.get_submodule(owner)
        for a, per_rank in attrs.items():
            target: Any = mod  # the module, or its own copy of its config
            if a.startswith("config."):  # this module's own copy: the model's config stays whole
                if owner not in own_config:
                    mod.config = copy.copy(mod.config)
                    own_config.add(owner)
                target, a = mod.config, a.split(".", 1)[1]
            setattr(target, a, per_rank[mesh.tp_rank])
    for owner, views in resolved.head_views.items():
        view_heads(model.get_submodule(owner), {n: r[mesh.tp_rank] for n, r in views.items()})
    for norm, ranges in resolved.split_norms.items():
        split_norm(model.get_submodule(norm), ranges[mesh.tp_rank], mesh.tp_group)
    return model


def norm_params(module: nn.Module) -> list[str]:
    """The parameters `split_norm` reads per rank: every 1-D one of the norm's width."""
    w = module._parameters["weight"]
    assert w is not None  # plan._split_norms checked it
    return [n for n, p in module._parameters.items() if p is not None and p.shape == w.shape]


def split_norm(module: nn.Module, features: tuple[int, int], group: Any) -> None:
    """An RMS norm over features tp splits: each rank normalizes its features [first, end) with
    the statistic of all of them, reading its rows of the (whole) weight. The norm's own forward
    runs on x * s and its output is divided by s, where s**2 = mean(x**2 over every rank's
    features) / mean(x**2 over this rank's): any norm of the form g(weight) * x / rms(x) gives
    exactly its whole-width output on this rank's features (a centering norm does not: the
    probe finds it). The sum of squares is all-reduced forward and backward (each rank's loss
    reads it); the weight's gradient holds this rank's rows, summed over tp by parallelize.

    Example:
        >>> split_norm(model.model.layers[0].self_attn.q_norm, (0, 2048), mesh.tp_group)  # doctest: +SKIP
    """
    from .collectives import copy_to_tp, reduce_from_tp

    first, end = features
    width = int(module._parameters["weight"].shape[0])  # type: ignore[union-attr]
    base = type(module).__dict__.get("_rows_base", type(module))

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        xf = x.float()
        local = xf.pow(2).sum(-1, keepdim=True)
        whole = copy_to_tp(reduce_from_tp(local, group), group)
        ratio = (whole / width) / (local / (end - first)).clamp_min(torch.finfo(xf.dtype).tiny)
        s = torch.where(local > 0, ratio.sqrt(), torch.ones_like(ratio))  # x == 0: any s works
        y: torch.Tensor = base.forward(self, (xf * s).to(x.dtype), *args, **kwargs)
        return y / s.to(y.dtype)

    _read_rows(module, {n: features for n in norm_params(module)}, forward=forward)


def view_heads(module: nn.Module, views: dict[str, tuple[int, int]]) -> None:
    """Make `module.<name>` read rows [first, end) of its parameter `name` (this rank's heads),
    the parameter itself staying whole: state dict, loading, saving and optimizers see the one
    full tensor; its gradient holds this rank's rows only, and parallelize sums it over tp. Done
    with a subclass of the module's class (a property per name; nothing is set on the instance).

    Example:
        >>> view_heads(model.model.layers[0].self_attn, {"sinks": (0, 32)})  # doctest: +SKIP
    """
    _read_rows(module, views)


def _read_rows(
    module: nn.Module, views: dict[str, tuple[int, int]], **methods: Callable[..., Any]
) -> None:
    """Give `module` a subclass of its class in which attribute `name` reads rows [first, end) of
    the parameter `name` (a property each), plus `methods`; a module given one before gets a new
    subclass of its original class."""
    base = type(module).__dict__.get("_rows_base", type(module))

    def rows(name: str, first: int, end: int) -> property:
        return property(lambda self: self._parameters[name][first:end])

    module.__class__ = type(base.__name__, (base,), {
        **{n: rows(n, a, b) for n, (a, b) in views.items()}, **methods,
        "__module__": base.__module__, "__qualname__": base.__qualname__, "_rows_base": base,
    })  # fmt: skip


def _build_experts(
    model: nn.Module, mesh, fqn: str, spec: dict, placement, dtype, lora
) -> ShardedExperts:
    """Swap experts module `fqn` for a ShardedExperts holding this rank's slices (filled from the
    original's values when it has them), with per-expert adapters on `spec["lora_tensors"]`."""
    orig = model.get_submodule(fqn)
    device = device_of(placement, fqn)
    tensors = spec["experts"]
    m = ShardedExperts.build_experts(
        orig, fqn, tensors, rank=mesh.tp_rank, tp=mesh.tp, group=mesh.tp_group, device=device,
        dtype=dtype, fmt=spec.get("fmt"),
    )  # fmt: skip
    m.fill_from(orig)  # when it holds values (not on meta)
    m.keep_buffers(orig, device)
    names = spec.get("lora_tensors") or []
    if lora is not None and names:
        a_full = {}
        for n in names:
            in_full = m.full_shapes[n][m.tensors[n].in_dim]
            a_full[n] = _init_A(f"{fqn}.{n}", lora.r * m.num_experts, in_full, lora.seed)
        m.attach_expert_lora(names, lora.r, lora.scaling, a_full)
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name), child, m)
    return m


def _has_dropout(model: nn.Module) -> bool:
    """True when some module may draw random masks: an nn.Dropout with p > 0, or a float attribute
    named like a dropout probability (transformers' attention_dropout) above zero."""
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        for k, v in vars(m).items():
            if "dropout" in k and isinstance(v, float) and v > 0:
                return True
    return False


@torch.no_grad()
def _materialize_rest(
    model: nn.Module, placement, dtype, held: dict[str, torch.dtype] | None = None
) -> None:
    """Everything not sharded: meta -> empty on its device; real -> moved (and cast) there, but
    the parameters and buffers in `held` (`held_dtypes`) in their dtype. A parameter shared by
    several modules (tied weights) stays shared."""
    held = held or {}
    done: dict[int, nn.Parameter] = {}
    sharded = sharded_modules(model)
    for fqn, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, ShardedModule):
            continue
        dev = device_of(placement, fqn)
        for name, p in list(mod._parameters.items()):
            if p is None or inside_sharded(fqn, sharded):
                continue
            if id(p) in done:
                mod._parameters[name] = done[id(p)]
                continue
            dt = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
            dt = held.get(f"{fqn}.{name}" if fqn else name, dt)
            if p.device.type == "meta":
                new = torch.empty_like(p, device=dev, dtype=dt)
            elif p.device != dev or p.dtype != dt:
                new = p.to(device=dev, dtype=dt)
            else:
                continue
            done[id(p)] = mod._parameters[name] = nn.Parameter(new, requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            bt = held.get(f"{fqn}.{name}" if fqn else name, b.dtype)
            if b.device.type == "meta":
                mod._buffers[name] = torch.empty_like(b, device=dev, dtype=bt)
            elif b.device != dev or b.dtype != bt:
                mod._buffers[name] = b.to(dev, bt)
