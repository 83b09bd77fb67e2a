"""parallelize: the one ordered pipeline. plan -> (quant, LoRA, TP in one pass) -> DP.

Everything is validated first (plan against the model, quant and LoRA targets), before any allocation
or collective. Then each planned / quantized / adapted module becomes a ShardedModule holding this
rank's shard on its device; the rest is materialized there; finally trainable parameters get their
gradient sync over dp.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import check_offload_base
from ..errors import QuantmeshError
from ..lora.adapter import LoraConfig, LoraError
from ..lora.peft import inner_model, restore_adapters, rewrap, unwrap_peft
from ..pipeline.cut import PipelineConfig, check_ties, drop_others, plan_stages, stage_plan
from ..pipeline.schedule import build_runtime
from ..plan.auto import auto_plan
from ..plan.plan import Plan, Resolved, _globify, size_candidates
from ..plan.styles import Style
from ..quant.base import QuantConfig, QuantError, get_format, resolve_quant
from ..quant.bnb import format_of
from ..quant.kinds import check_quantizable, is_quantized_linear, quantizable
from ..tp.apply import apply_tp, norm_params, shared_params
from ..tp.experts import find_experts, select_lora, unhandled_3d
from ..tp.kinds import kind_of
from ..tp.rng import RngRegions
from .dp import apply_dp
from .fsdp import FsdpError, apply_fsdp, check_fsdp, fsdp_blocked_by
from .layersplit import install_moves, layer_placement
from .state import ParallelState, attach_state, parallel_state

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = ["parallelize", "SplitForwardError"]


class SplitForwardError(QuantmeshError, RuntimeError):
    """A module failed in its first forward after its layers were split by a plan that could not
    be verified; the message names the module, its split layers and the fix."""


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    *,
    plan: Plan | dict[str, str] | None = None,
    quant: str | QuantConfig | None = None,
    lora: LoraConfig | None = None,
    dtype: torch.dtype | None = None,
    data_parallel: bool = True,
    verify: bool = True,
    example_inputs: Any = None,
    pipeline: PipelineConfig | None = None,
    fsdp: bool = False,
    offload_base: bool = False,
) -> nn.Module:
    """Tensor-parallelize, quantize and LoRA-adapt `model` in place over `mesh`; returns it.

    Module and parameter names never change. A model built under `qm.empty_model()` gets
    uninitialized shards (fill them with `qm.load_checkpoint`); a model with real CPU weights is
    sliced per rank, and each rank's slice is moved and quantized on its device.

    Args:
        plan: a Plan or {fqn/glob: style}; None = `qm.auto_plan(model, mesh.tp)`.
        quant: None, "nf4", "fp4", "int8" or a QuantConfig (every linear except `skip`).
        lora: adapters on the targeted linears; everything else is frozen.
        dtype: cast floating-point weights (e.g. torch.bfloat16); None keeps the model's. What
            transformers keeps in float32 stays so (`tp.apply.held_dtypes`: a model's
            `_keep_in_fp32_modules_strict`, a router it builds in float32).
        data_parallel: sync trainable gradients over mesh.dp (torch's DDP engine).
        verify: at tp > 1, prove the plan exact first (`qm.verify_plan`: a one-block random copy
            run whole and split on the tp group); modules whose split is not exact are
            replicated, with the measured error as the reason in the plan table. A collective.
        example_inputs: the probe's inputs (kwargs dict, args tuple, or callable(model,
            device)); None works for transformers models. Without them a custom model's plan is
            not verified (a warning says so).
        pipeline: at pp > 1, how to cut the model into stages of whole blocks
            (`qm.PipelineConfig(stages=[...])`); None = balanced by compute. Each rank keeps only
            its stage's modules (the others become parameterless stand-ins); train with
            `qm.train_step`.
        fsdp: shard every parameter (frozen base and adapters) over mesh.dp with torch's FSDP2,
            one repeated block at a time (fsdp.py), instead of a whole replica per dp rank.
            Quantized bases need backend="torchao". A model built under `qm.empty_model()` is
            sharded when `load_checkpoint` has filled it.
        offload_base: with fsdp, keep each block's frozen base in host memory (FSDP2's
            CPUOffloadPolicy), copied to the device for its gather.

    A model whose linears are bitsandbytes Linear4bit / Linear8bitLt already keeps their format:
    their codes are re-sharded as they are where the tp cuts fall on quantization blocks (and
    requantized from their exact values where not). A model wrapped by peft (`get_peft_model`,
    LoRA only) keeps its adapters' values and names: pass lora=None.

    The global random state of every rank is left as it was found.

    Example:
        >>> model = qm.parallelize(model, mesh, quant="nf4",
        ...                        lora=qm.LoraConfig(r=16, targets=["q_proj", "v_proj"]))  # doctest: +SKIP
    """
    # nothing below may move any rank's random streams (uneven shards would move them apart)
    dev = mesh.devices[0]
    cuda = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        adapters = unwrap_peft(model, lora)  # peft's LoRA layers -> base layers + one LoraConfig
        inner = inner_model(model)  # a PeftModel's own model; its names keep peft's prefix
        if adapters is not None and (getattr(mesh, "pp", 1) > 1 or fsdp):
            rewrap(model, adapters)
            what = f"pp={mesh.pp}" if mesh.pp > 1 else "fsdp=True"
            raise LoraError(
                f"a peft model at {what}: {'pipeline stages' if mesh.pp > 1 else 'FSDP'} of peft "
                "models are not supported yet; use pp=1 and plain dp (tp and dp), or merge the "
                "adapter (merge_and_unload()) and pass lora=qm.LoraConfig(...)"
            )
        if adapters is None:
            _parallelize(
                inner, mesh, plan, quant, lora, dtype, data_parallel, verify, example_inputs,
                pipeline, fsdp, offload_base,
            )  # fmt: skip
        else:
            try:
                _parallelize(inner, mesh, plan, quant, adapters.config, dtype, False, verify,
                             example_inputs, pipeline)  # fmt: skip
            except Exception:
                rewrap(model, adapters)  # a refusal leaves the user's peft model as it was
                raise
            restore_adapters(inner, adapters)  # peft's values, each rank its slice
            if data_parallel and mesh.dp > 1:
                apply_dp(inner, mesh)
        if inner is not model:  # save_adapter, load_checkpoint, train read it from the root
            attach_state(model, parallel_state(inner))
        return model


def _parallelize(
    model: nn.Module,
    mesh: Any,
    plan: Plan | dict[str, str] | None,
    quant: str | QuantConfig | None,
    lora: LoraConfig | None,
    dtype: torch.dtype | None,
    data_parallel: bool,
    verify: bool,
    example_inputs: Any,
    pipeline: PipelineConfig | None = None,
    fsdp: bool = False,
    offload_base: bool = False,
) -> nn.Module:
    if isinstance(plan, dict):
        plan = Plan(plan)
    if plan is None:
        plan = auto_plan(model, mesh.tp)
    qcfg = resolve_quant(quant)
    if qcfg is not None:  # the modules the model keeps in float stay unquantized (transformers')
        qcfg = qcfg.for_model(model)
    if lora is not None and not isinstance(lora, LoraConfig):
        raise LoraError(f"lora={lora!r}; pass qm.LoraConfig(r=..., targets=[...]) or None")
    cut = None
    if mesh.pp > 1:  # the stage cut is checked before anything else (no collective yet)
        if len(mesh.devices) > 1:
            raise ValueError(
                f"devices_per_rank={len(mesh.devices)} with pp={mesh.pp}: a rank holds one "
                f"pipeline stage on one device; use devices_per_rank=1"
            )
        cut = plan_stages(model, mesh.pp, pipeline)
        check_ties(model, cut, trainable=lora is None)
    elif pipeline is not None and pipeline.stages not in (None, [1]):
        raise ValueError(f"pipeline={pipeline!r} needs a mesh with pp > 1; this one has pp=1")
    if len(mesh.devices) > 1 and mesh.tp > 1:
        raise ValueError(
            f"devices_per_rank={len(mesh.devices)} with tp={mesh.tp}: a rank either splits its "
            f"replica's layers over its own devices or joins a tp group, not both; use tp=1"
        )

    check_offload_base(fsdp=fsdp, offload_base=offload_base)
    if fsdp:
        check_fsdp(qcfg, data_parallel, mesh)

    # 1. validate everything before allocating anything (or any collective)
    resolved = plan.resolve(model, mesh.tp)
    fmt = get_format(qcfg) if qcfg is not None else None
    if fsdp and hasattr(fmt, "shards"):  # torchao nf4: block-scale groups within dp shards
        setattr(fmt, "shards", mesh.dp)  # noqa: B010 - only that format has the attribute
    wrap = _wrap_plan(model, resolved, qcfg, fmt, lora)
    if qcfg is not None:
        _say_kept_float(model, qcfg)
    if fsdp and (why := fsdp_blocked_by(model)) is not None:
        raise FsdpError(f"fsdp=True with {why} (fsdp=False)")

    # 2. prove the split exact on the tp group; replicate what is not (the reasons go in the plan)
    report = None
    if verify and mesh.tp > 1 and resolved.sharded():
        from .verify import verify_plan

        report = verify_plan(model, mesh, plan, inputs=example_inputs)
        if report.verified:
            plan = report.apply(plan)
            resolved = plan.resolve(model, mesh.tp)
            wrap = _wrap_plan(model, resolved, qcfg, fmt, lora)
        elif not report.verified:
            warnings.warn(
                f"quantmesh: the tp plan was not verified ({report.skipped}); the split is "
                "trusted from structure alone. Pass example_inputs=... to parallelize (or check "
                "with qm.verify_plan) to prove it exact.",
                stacklevel=3,
            )
    guards = {}
    if report is not None and not report.verified:  # computed on the whole layers (before tp)
        guards = _guard_notes(model, resolved, mesh.tp_rank)

    # for load_checkpoint: names sharing one tensor (tied weights; a checkpoint may hold only one
    # of them, and quantizing one side unties them), over the whole model (a tie may span stages)
    tied = [[f"{m}.{p}" if m else p for m, p in g] for g in shared_params(model)]

    # 3. keep only this rank's pipeline stage (the plan was resolved and verified on the whole model)
    swaps: dict = {}
    if cut is not None:
        swaps = drop_others(model, cut, cut.local(mesh.pp_rank), mesh.device)
        resolved, wrap = stage_plan(model, resolved, wrap)

    # 4. build shards on their devices (quantized there), attach adapters, materialize the rest
    placement = layer_placement(model, mesh.devices)
    if lora is not None:
        model.requires_grad_(False)
    meta = [n for n, t in _named_tensors(model) if t.device.type == "meta"]  # no values yet
    rng = RngRegions()
    apply_tp(model, mesh, resolved, wrap=wrap, placement=placement, rng=rng, dtype=dtype, lora=lora)
    for owner, note in guards.items():
        _guard_first_forward(model.get_submodule(owner), owner, note)
    # a forward that stops inside a split region (an exception) must not leave this rank on its
    # private random stream: the root's hook closes every region, also when the forward raised
    model.register_forward_hook(rng.close_all, always_call=True)
    if len(mesh.devices) > 1:
        install_moves(model, placement)
    attach_state(
        model,
        ParallelState(
            mesh=mesh,
            plan=resolved,
            lora=lora,
            quant=qcfg,
            rng=rng,
            tied=tied,
            uninitialized=set(meta),
            verify=report,
            pipeline=None if cut is None else build_runtime(model, cut, mesh, swaps),
        ),
    )

    # replicated weights that see split heads: those the probe found, and every per-head
    # parameter read through this rank's heads (by rule, also without verify); one hook each
    partial = list(report.reduce_grads) if report is not None else []
    partial += [f"{o}.{n}" for o, views in resolved.head_views.items() for n in views]
    partial += [
        f"{f}.{n}" for f in resolved.split_norms for n in norm_params(model.get_submodule(f))
    ]
    if partial and mesh.tp > 1:
        from .verify import reduce_partial_grads

        reduce_partial_grads(model, partial, mesh.tp_group)

    # 5. data parallel: FSDP2 over every parameter (once all hold values), or DDP over the
    # trainable ones (at pp > 1, train_step sums them over dp)
    if fsdp:
        st = parallel_state(model)
        st.fsdp, st.offload_base = True, offload_base
        if not meta:  # else load_checkpoint shards it once every tensor holds its values
            apply_fsdp(model, mesh, offload=offload_base)
    elif data_parallel and mesh.dp > 1 and mesh.pp == 1:
        apply_dp(model, mesh)
    return model


def _guard_notes(model: nn.Module, resolved: Resolved, rank: int) -> dict[str, str]:
    """{module: what to say if its first forward fails} for every module (the root aside) whose
    children the plan splits: the split, the integer attributes that may hold a global size
    (found by value), and the fixes."""
    children: dict[str, list[str]] = {}
    for e in resolved.sharded():
        if "." in e.fqn:
            owner, _, child = e.fqn.rpartition(".")
            assert e.split is not None and e.kind is not None  # a split module has both
            whole = e.kind.in_out(model.get_submodule(e.fqn))[1 if e.style.is_colwise else 0]
            side = "out" if e.style.is_colwise else "in"
            children.setdefault(owner, []).append(
                f"{child} {e.style.value} ({side} {whole} -> {e.split.size(rank)} here)"
            )
    notes = {}
    for owner, split in children.items():
        mod = model.get_submodule(owner)
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue  # never called
        cands = size_candidates(model, resolved, owner)
        attrs = ", ".join(f"{n} = {v} ({r[rank]} on this rank)" for n, (v, r) in cands.items())
        sizes = (
            f"set per rank each attribute that holds a global size (of {type(mod).__name__}, "
            f"by value: {attrs}) after parallelize"
            if attrs
            else "make its forward read sizes from its inputs rather than global attributes"
        )
        notes[owner] = (
            "with its layers split by a plan that was not verified: "
            f"{', '.join(split)}. Fix: pass example_inputs=... to qm.parallelize (the probe then "
            f"checks the split and sets such attributes per rank), or {sizes}, or keep it whole: "
            f"plan.override({{'{_globify(owner, model)}.*': 'replicate'}})"
        )
    return notes


def _guard_first_forward(module: nn.Module, name: str, note: str) -> None:
    """Run `module`'s next forward under a guard that turns a failure into a SplitForwardError
    (`note` says the split and the fix); the guard removes itself after a forward that returns.
    Bound as a method on the instance, so a deep copy of the model guards its own copy."""
    prev = module.__dict__.get("forward")  # an instance-level forward of the user's, if any
    module.__dict__["_quantmesh_guard"] = (name, note, prev)
    module.__dict__["forward"] = types.MethodType(_guarded_forward, module)


def _guarded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    name, note, prev = self.__dict__["_quantmesh_guard"]
    forward = prev if prev is not None else types.MethodType(type(self).forward, self)
    try:
        out = forward(*args, **kwargs)
    except SplitForwardError:
        raise
    except Exception as e:
        raise SplitForwardError(
            f"{name} ({type(self).__name__}) failed in its first forward at tp > 1 "
            f"({type(e).__name__}: {e}), {note}"
        ) from e
    del self.__dict__["_quantmesh_guard"]
    if prev is not None:
        self.__dict__["forward"] = prev
    else:
        del self.__dict__["forward"]
    return out


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _is_leaf_with_weight(m: nn.Module) -> bool:
    return getattr(m, "weight", None) is not None and not list(m.children())


def _say_kept_float(model: nn.Module, qcfg: QuantConfig) -> None:
    """Warn, naming them, of the linear layers left unquantized because the model keeps them in
    float32 (`QuantConfig.kept_float`), as transformers' bitsandbytes integration leaves them."""
    kept = [
        fqn for fqn, m in model.named_modules()
        if fqn and qcfg.model_keeps_float(fqn) and not qcfg.skip_names(fqn) and qcfg.selects(fqn)
        and (k := kind_of(m)) is not None and k.linear_like
    ]  # fmt: skip
    if kept:
        warnings.warn(
            f"quantmesh: {len(kept)} linear layer(s) stay unquantized because the model keeps "
            f"them in float32 ({type(model).__name__}._keep_in_fp32_modules = "
            f"{qcfg.kept_float}), as transformers' bitsandbytes integration leaves them: "
            f"{', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}; name them in "
            "QuantConfig(targets=...) to quantize them anyway",
            stacklevel=4,
        )


def _wrap_plan(
    model: nn.Module,
    resolved: Resolved,
    qcfg: QuantConfig | None,
    fmt: Any,
    lora: LoraConfig | None,
) -> dict[str, dict]:
    """{fqn: {"fmt": QuantFormat, "lora": True}} of every module that becomes a ShardedModule
    (split, quantized or adapted); raises on a quant or LoRA target that cannot be."""
    wrap: dict[str, dict] = {e.fqn: {} for e in resolved.sharded()}
    for fqn, m in model.named_modules():  # linears quantized already keep their format
        if fqn and is_quantized_linear(m):
            try:
                own = format_of(m)
            except QuantError as err:
                raise QuantError(f"{fqn}: {err}") from None
            if own is None:
                raise QuantError(
                    f"{fqn} is a {type(m).__name__}, quantized by a library quantmesh cannot "
                    "re-shard; parallelize takes bitsandbytes Linear4bit / Linear8bitLt, or the "
                    "float model with quant='nf4' / 'int8'"
                )
            if qcfg is not None and (qcfg.backend, qcfg.format) != ("bitsandbytes", own.name):
                raise QuantError(
                    f"{fqn} is quantized already as bitsandbytes {own.name}, but quant= asks for "
                    f"{qcfg.backend} {qcfg.format}; pass quant=None to keep the model's own "
                    "formats (its float linears stay float), or quant with the same format"
                )
            wrap.setdefault(fqn, {})["fmt"] = own
    if qcfg is not None:
        for fqn, m in model.named_modules():
            if not fqn or qcfg.skips(fqn) or not qcfg.selects(fqn) or "fmt" in wrap.get(fqn, {}):
                continue
            k = kind_of(m)
            if k is not None and k.linear_like:
                if quantizable(m):
                    wrap.setdefault(fqn, {})["fmt"] = fmt
                elif qcfg.targets is not None:  # asked for by name: say why not
                    check_quantizable(fqn, m, qcfg.backend)
                # else: left in full precision (nn.MultiheadAttention reads out_proj.weight)
            elif qcfg.targets is not None and _is_leaf_with_weight(m):
                raise QuantError(
                    f"{fqn} is a {type(m).__name__}; {qcfg.backend} quantizes only linear layers; "
                    f"remove it from QuantConfig(targets=...) or add it to skip"
                )
    experts = find_experts(model)
    for fqn, tensors in experts.items():  # split at tp > 1, quantized like every frozen weight
        spec: dict[str, Any] = {"experts": tensors}
        if qcfg is not None and qcfg.selects(fqn) and not qcfg.skips(fqn):
            spec["fmt"] = fmt
        if resolved.tp > 1 or "fmt" in spec:
            wrap[fqn] = spec
    if (resolved.tp > 1 or qcfg is not None) and (whole := unhandled_3d(model, experts)):
        warnings.warn(
            f"quantmesh: {len(whole)} tensor(s) of 3 or more dims outside a recognized experts "
            f"module stay whole and in float on every rank: {', '.join(whole[:6])}"
            f"{' ...' if len(whole) > 6 else ''} (quantmesh splits and quantizes transformers' "
            "experts modules: gate_up_proj / up_proj and down_proj with num_experts and "
            "is_transposed)",
            stacklevel=4,
        )
    if lora is not None:
        tensor_names = {f"{f}.{t.name}" for f, ts in experts.items() for t in ts}
        selected, adapted = select_lora(model, lora, experts)
        for owner, names in adapted.items():
            wrap.setdefault(owner, {"experts": experts[owner]})["lora_tensors"] = names
        for fqn in selected:
            if fqn in experts or fqn in tensor_names:  # expert tensors: above
                continue
            e = resolved.entries.get(fqn)
            if e is not None and e.style == Style.VOCAB:
                raise LoraError(f"LoRA on a vocab-split embedding ({fqn}) is not supported")
            wrap.setdefault(fqn, {})["lora"] = True
    return wrap
