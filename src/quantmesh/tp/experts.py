"""Mixtures of experts: the fused 3-D expert tensors split over tp, quantized and adapted.

transformers 5 stores a block's experts as 3-D parameters read by one experts module
(`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I); transposed, (E, H, 2I) and (E, I, H), where
the module says `is_transposed`, or where the shapes say so in a module that does not (Llama 4's,
read by `bmm`: split and quantized, but given no adapters, since PEFT reads such tensors the other
way round); a bias per expert where it has them). The rules:

- **Split the intermediate dimension I of every expert, like a dense MLP.** The first projection's
  output features and the second's input features are cut at the same places (a gated first
  projection keeps each gate feature with its up feature: [gate; up] halves split alike, or
  neighbouring pairs when the module interleaves them), so each rank computes every expert on its
  slice of I and the outputs are partial sums: the input goes through `copy_to_tp` (its gradient
  all-reduced) and the output through one all-reduce. The router and the routing stay whole.
- **A term added to a partial sum lives on one rank.** The second projection's bias would be added
  tp times: tp rank 0 adds it, the others add zeros (its gradient, if it has one, all-reduced).
- **A replicated factor that meets split features gets its gradient all-reduced.** LoRA on an
  expert tensor is a per-expert weight delta (PEFT's `target_parameters` layout: A (E*r, in),
  B (out, E*r)); the factor on the split side is split with it, the other factor is whole on every
  rank and passes through `copy_to_tp`, so its gradient is complete and identical everywhere.
- **Quantized like every frozen weight.** Each rank's (E, a, b) slice is quantized by the model's
  QuantFormat as one (E*a, b) linear weight, so blocks follow the slice (per-expert statistics
  whenever a*b is a multiple of the block size) and the store is the format's own.

The model's own experts forward runs unchanged on the rank's effective tensors (dequantized,
plus the adapters' deltas) through `torch.func.functional_call`; with a quantized base or adapters
it runs under activation checkpointing, so that no dequantized expert weight is kept for backward.

**On transformers' grouped path, an expert adapter meets the activations, not the weight.** A
weight delta W_e + s B_e A_e is exact but costs a merged copy of every expert and, in backward, a
weight-sized gradient of each expert tensor before it reaches A and B. Where the module runs
transformers' `grouped_mm` experts forward (what compiled blocks and GPUs run), the same forward
runs here with each grouped projection followed by its adapter's x A_e^T B_e^T s (two grouped
matmuls of rank r): `_grouped_forward`, the semantics of transformers' experts interface
(sorting by expert, the module's own gate or activation, biases, routing weights), the module's
flags read as that interface reads them. The weight-delta path stays for everything else
(the eager loop, a decoding step on the routed experts, an adapter bank) and is the reference:
both are tested equal. On by default since it was measured on a GPU (1.19x the weight deltas'
training speed at the same memory: docs/benchmarks.md, "Mixtures of experts against Unsloth's MoE
path"); `QUANTMESH_EXPERT_ADAPTERS_ON_ACTIVATIONS=0`, or `adapters_on_activations = False` on the
module, keeps the weight deltas.

**Only the experts a batch routes to are dequantized.** When the tokens of a forward reach fewer
than all experts (decoding, small batches), the forward runs on those experts alone: their codes
dequantized (`QuantFormat.compute_units`), their adapters' deltas and biases picked, the routing
ids renumbered to them, the module's `num_experts` set to their count for the call. The model's
loop visits the same experts in the same order, so the output is the whole path's exactly. Eager
only (a compiled block keeps the whole path: the count is data-dependent).

**Many adapters, one per row (serving): each slot's copy of an expert is an expert of its own.**
An adapter bank (serve/bank.py) renumbers the routing ids: expert e of a row on slot s becomes
expert `s * E + e` of `slots * E` (`ExpertLora.route`), whose weight is expert e's plus slot s's
delta. The model's loop then runs each (slot, expert) pair on its own tokens, unchanged; eager,
only the pairs a batch hits are built; compiled, every pair (slots times the experts' weights).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import env_switch
from ..lora.adapter import ExpertAdapter, ExpertLora, Factors
from ..plan.styles import (
    FeatureSplit,
    Ranges,
    Style,
    balanced_counts,
    segmented_split,
    slice_dim,
    unit_split,
)
from .collectives import copy_to_tp, reduce_from_tp
from .kinds import ExpertTensor, Kind, expert_tensors
from .layers import ShardedModule, _refuse_adapter_setattr
from .rng import RngRegions


@torch.library.custom_op("quantmesh::permuted_copy", mutates_args=())
def permuted_copy(
    x: torch.Tensor, shape: list[int], perm: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """`x` reshaped to `shape`, permuted by `perm` and cast to `dtype`, as a contiguous tensor.

    An op of its own so that a compiler keeps its output contiguous: grouped matmuls take a 3-D
    operand only row- or column-major in its last two dims, and inductor, free to lay out a plain
    permute + contiguous as it likes, handed one a permuted view (found on CPU and on a GPU).

    Example:
        >>> permuted_copy(torch.arange(6.0).reshape(2, 3), [2, 3], [1, 0], torch.float32).stride()
        (2, 1)
    """
    return x.reshape(shape).permute(perm).to(dtype).contiguous()


@permuted_copy.register_fake
def _(x: torch.Tensor, shape: list[int], perm: list[int], dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty([shape[i] for i in perm], dtype=dtype)


def _permuted_copy_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, _shape, perm, _dtype = inputs
    ctx.x_shape, ctx.x_dtype, ctx.perm = list(x.shape), x.dtype, list(perm)


def _permuted_copy_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    inverse = [ctx.perm.index(i) for i in range(len(ctx.perm))]
    return grad.permute(inverse).reshape(ctx.x_shape).to(ctx.x_dtype), None, None, None


permuted_copy.register_autograd(_permuted_copy_backward, setup_context=_permuted_copy_setup)


def _transformers_grouped_mm() -> Any:
    """transformers' grouped matmul dispatcher (torch's grouped_mm where it runs: the device, the
    dtype under compile, alignment; else its own fallback op), or None if it has none."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "_grouped_mm", None)


__all__ = [
    "ExpertTensor",
    "ShardedExperts",
    "expert_lora_targets",
    "expert_tensors",
    "find_experts",
    "local_sizes",
    "unhandled_3d",
]

EXPERTS = Kind(
    "Experts", 1, 2, -1, False
)  # the (E, out, in) layout; `ExpertTensor` says per tensor


def find_experts(model: nn.Module) -> dict[str, list[ExpertTensor]]:
    """{fqn: expert tensors} of every experts module of `model`, in model order.

    Example:
        >>> list(find_experts(mixtral))  # doctest: +SKIP
        ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
    """
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, ShardedModule):
            continue
        ts = expert_tensors(m)
        if ts is not None:
            out[fqn] = ts
    return out


def unhandled_3d(model: nn.Module, experts: dict[str, Any]) -> list[str]:
    """Names of float parameters of 3 or more dims outside the recognized experts modules: weights
    quantmesh keeps whole and in float (callers say so).

    Example:
        >>> unhandled_3d(model, find_experts(model))  # doctest: +SKIP
        ['model.layers.0.moe.w1']
    """
    out = []
    for fqn, m in model.named_modules():
        if fqn in experts or isinstance(m, ShardedModule):
            continue
        for name, p in m._parameters.items():
            if p is not None and p.dim() >= 3 and p.is_floating_point():
                out.append(f"{fqn}.{name}" if fqn else name)
    return [n for n in out if not isinstance(model.get_submodule(n.rpartition(".")[0]), nn.Conv2d)]


GROUP = 8  # features: 16 bytes in bf16, the stride grouped_mm needs


def whole_reason(inter: int, tp: int) -> str | None:
    """Why experts of `inter` intermediate features stay whole on every rank at `tp`; None when
    they split. grouped_mm (transformers' experts kernel) refuses strides that are not a multiple
    of 16 bytes, so every rank's share must be a multiple of GROUP features: a cut of 40 over tp 3
    into 14 / 13 / 13 failed deep in the forward. Where no such cut exists the experts are kept
    whole, exactly as at tp 1, and the plan says so.

    Example:
        >>> whole_reason(40, 3) is None, whole_reason(16, 3)
        (True, '16 intermediate features cannot be cut over tp=3 in groups of 8 (grouped_mm needs every rank's share to be a multiple of 16 bytes)')
    """  # noqa: E501
    if tp <= 1 or (inter % GROUP == 0 and inter // GROUP >= tp):
        return None
    return (
        f"{inter} intermediate features cannot be cut over tp={tp} in groups of {GROUP} "
        "(grouped_mm needs every rank's share to be a multiple of 16 bytes)"
    )


def _inter_split(module: nn.Module, t: ExpertTensor, inter: int, tp: int) -> FeatureSplit:
    """The split of tensor `t`'s `split_dim` over tp (`whole_reason` is None): I cut in balanced
    blocks of GROUP features, the first projection's gated features kept with their partners
    (Mixtral's 14336 at tp 3: 4784 / 4776 / 4776, not 4779 / 4779 / 4778)."""
    unit = GROUP
    counts = balanced_counts(inter // unit, tp)
    base = unit_split(inter, unit, counts)
    if not t.first or not bool(getattr(module, "has_gate", True)):
        return base
    if bool(getattr(module, "is_concatenated", True)):  # [gate; up]: each half cut alike
        return segmented_split([base, base])
    return unit_split(2 * inter, 2 * unit, counts)  # gate, up interleaved: neighbouring pairs


def local_sizes(module: nn.Module, tensors: list[ExpertTensor], tp: int, rank: int) -> dict:
    """{tensor name: (local elements, local (in, out) of one expert)} on tp rank `rank` (for the
    memory planner: the split ShardedExperts makes).

    Example:
        >>> local_sizes(experts, expert_tensors(experts), 2, 0)["down_proj"]  # doctest: +SKIP
        (6144, (16, 96))
    """
    out = {}
    for t in tensors:
        shape = _local_shape(module, tensors, t, tp, rank)
        out[t.name] = (math.prod(shape), (shape[t.in_dim], shape[t.out_dim]))
    return out


def _intermediate(module: nn.Module, tensors: list[ExpertTensor]) -> int:
    """The experts' intermediate features (the second projection's input dim)."""
    second = tensors[1]
    return int(cast(torch.Tensor, module._parameters[second.name]).shape[second.in_dim])


def _local_shape(
    module: nn.Module, tensors: list[ExpertTensor], t: ExpertTensor, tp: int, rank: int
) -> list[int]:
    """Tensor `t`'s shape on tp rank `rank`: its intermediate features cut as ShardedExperts
    cuts them, whole where `whole_reason` says."""
    shape = list(cast(torch.Tensor, module._parameters[t.name]).shape)
    inter = _intermediate(module, tensors)
    if tp > 1 and whole_reason(inter, tp) is None:
        shape[t.split_dim] = _inter_split(module, t, inter, tp).size(rank)
    return shape


def expert_rows(model: nn.Module, tp: int) -> list[tuple[str, str, str, str, str]]:
    """The plan table's rows of the experts modules (`Plan.table(extra=...)`), which
    ShardedExperts splits outside the plan: (fqn, type, "experts", each tensor's local shape on
    every rank, why).

    Example:
        >>> expert_rows(model, 2)[0][3]  # doctest: +SKIP
        'gate_up_proj 4x32x64/4x32x64, down_proj 4x64x16/4x64x16'
    """
    rows = []
    for fqn, tensors in find_experts(model).items():
        module = model.get_submodule(fqn)
        inter = _intermediate(module, tensors)
        whole = whole_reason(inter, tp)
        split = tp > 1 and whole is None
        cells = []
        for t in tensors:
            shapes = [
                "x".join(map(str, _local_shape(module, tensors, t, tp, rank)))
                for rank in range(tp if split else 1)
            ]
            cells.append(f"{t.name} {'/'.join(shapes)}")
        if split:
            why = f"experts: {inter} intermediate features split over tp"
        elif tp > 1:
            why = f"experts whole on every rank: {whole}"
        else:
            why = "experts"
        rows.append((fqn, type(module).__name__, "experts", ", ".join(cells), why))
    return rows


def expert_lora_targets(
    experts: dict[str, list[ExpertTensor]], selected: list[str]
) -> dict[str, list[str]]:
    """{experts fqn: tensor names} adapted, from the names a LoraConfig selected (`lora_targets`
    with the expert tensors' full names as extra candidates): an experts module's own name
    selects all of its tensors.

    Example:
        >>> expert_lora_targets(find_experts(m), ["model.layers.0.mlp.experts.down_proj"])  # doctest: +SKIP
        {'model.layers.0.mlp.experts': ['down_proj']}
    """
    out: dict[str, list[str]] = {}
    for fqn, ts in experts.items():
        names = [t.name for t in ts if fqn in selected or f"{fqn}.{t.name}" in selected]
        if names:
            out[fqn] = names
    return out


def select_lora(
    model: nn.Module, lora: Any, experts: dict[str, list[ExpertTensor]] | None = None
) -> tuple[list[str], dict[str, list[str]]]:
    """(every name `lora` selects: modules and expert tensors, {experts fqn: tensor names} it
    adapts), checked: a target that matches nothing, and dropout on expert tensors, are refused
    (LoraError) before anything is built. `experts`: `find_experts(model)`, when known.

    Example:
        >>> select_lora(mixtral, LoraConfig(r=8))[1]["model.layers.0.mlp.experts"]  # doctest: +SKIP
        ['gate_up_proj', 'down_proj']
    """
    from ..config import LoraError
    from ..lora.adapter import lora_targets

    experts = find_experts(model) if experts is None else experts
    tensor_names = [f"{f}.{t.name}" for f, ts in experts.items() for t in ts]
    selected = lora_targets(model, lora, extra=tensor_names)
    adapted = expert_lora_targets(experts, selected)
    # PEFT reads a 3-D parameter as (E, out, in) unless its module says `is_transposed`: an
    # experts module whose layout quantmesh reads from the shapes (Llama 4's (E, H, 2I), read
    # by bmm) has no PEFT-compatible adapter layout here
    odd = [f for f in adapted if getattr(model.get_submodule(f), "is_transposed", None) is None]
    if odd:
        kind = type(model.get_submodule(odd[0])).__name__
        why = (
            f"{kind} ({odd[0]}, ...) does not declare is_transposed, so PEFT reads its (E, H, 2I) "
            "tensors as (E, out, in), the other way round from its forward; quantmesh does not "
            "write adapters in that reading"
        )
        if not lora.default_targets:
            raise LoraError(
                f"LoRA on expert tensors: {why}; leave the experts out of "
                "LoraConfig(targets=...) (CLI: --lora-targets), e.g. ['q_proj', 'k_proj', "
                "'v_proj', 'o_proj']"
            )
        warnings.warn(f"quantmesh: the default LoRA targets leave out expert tensors: {why}",
                      stacklevel=3)  # fmt: skip
        drop = {f"{f}.{t}" for f in odd for t in adapted[f]} | set(odd)
        selected = [n for n in selected if n not in drop]
        adapted = {f: ts for f, ts in adapted.items() if f not in odd}
    if adapted and lora.dropout > 0:
        raise LoraError(
            f"LoRA on the expert tensors of {next(iter(adapted))} with dropout={lora.dropout}: an "
            "expert adapter is a weight delta (as PEFT's target_parameters), which cannot drop "
            "its input; use dropout=0, or leave the experts out of LoraConfig(targets=...) (e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj'])"
        )
    return selected, adapted


class ShardedExperts(ShardedModule):
    """An experts module holding this rank's slice of every expert tensor (quantized or float),
    with optional per-expert LoRA; the model's own experts forward runs on them.

    Built by `build_experts`; `param_slices`, `load_param`, `tp_splits` and
    `checkpoint_tensors` follow ShardedModule's contract for the loader and the savers.

    Example:
        >>> m = ShardedExperts.build_experts(experts, "model.layers.0.mlp.experts",
        ...                                  rank=0, tp=2, group=g, device="cpu")  # doctest: +SKIP
    """

    tensors: dict[str, ExpertTensor]
    splits: dict[str, FeatureSplit]  # tensor name -> split of its split_dim (tp > 1 only)
    qlocal: dict[str, nn.Module]  # tensor name -> the quantized linear holding (E*a, b)
    local_shapes: dict[str, tuple[int, ...]]
    full_shapes: dict[str, tuple[int, ...]]
    expert_lora: nn.ModuleDict  # tensor name -> ExpertLora (attach_expert_lora, a bank's)
    transposed: bool
    num_experts: int
    inter: int
    split_reason: str | None  # why the experts are whole at tp > 1
    routed_only: bool  # run only the experts a forward routes to (eager; see the module doc)
    last_routed: int
    adapters_on_activations: bool  # grouped path: adapters on the activations (module doc)
    grouped_mm: Any  # transformers' grouped matmul (_transformers_grouped_mm), None: none

    @classmethod
    def build_experts(
        cls,
        orig: nn.Module,
        fqn: str,
        tensors: list[ExpertTensor],
        *,
        rank: int,
        tp: int,
        group: Any,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        fmt: Any = None,
    ) -> ShardedExperts:
        """An empty (uninitialized) sharded copy of experts module `orig`; fill it with
        `load_param` (apply_tp does, from `orig`'s values when it has them)."""
        self = cls()
        device = torch.device(device)
        self.fqn, self.kind, self.style = fqn, EXPERTS, Style.REPLICATE
        self.tp_rank, self.fmt = rank, fmt
        self.tensors = {t.name: t for t in tensors}
        self.transposed = tensors[0].in_dim == 1  # (E, in, out): declared or read from shapes
        self.num_experts = int(cast(Any, orig).num_experts)
        first, second = tensors
        w2 = cast(torch.Tensor, orig._parameters[second.name])
        self.inter = int(w2.shape[second.in_dim])
        self.split_reason = whole_reason(self.inter, tp)
        self.tp = tp if self.split_reason is None else 1
        self.group = group if self.tp > 1 else None
        self.splits = (
            {t.name: _inter_split(orig, t, self.inter, tp) for t in tensors} if self.tp > 1 else {}
        )
        self.split = self.splits.get(second.name)  # non-None: split over tp (tp/gather.py)
        w1 = cast(torch.Tensor, orig._parameters[first.name])
        dt: torch.dtype = dtype or w1.dtype
        self.float_dtype = dt
        self.in_full = self.out_full = 0  # per tensor: full_shapes
        self.full_shapes, self.local_shapes, self.qlocal = {}, {}, {}
        for t in tensors:
            w = cast(torch.Tensor, orig._parameters[t.name])
            self.full_shapes[t.name] = tuple(w.shape)
            shape = list(w.shape)
            if t.name in self.splits:
                shape[t.split_dim] = self.splits[t.name].size(rank)
            self.local_shapes[t.name] = tuple(shape)
            if fmt is not None:
                q = fmt.new_linear(shape[2], shape[0] * shape[1], bias=False, device=device,
                                   dtype=dt)  # fmt: skip
                self.qlocal[t.name] = q
                self._parameters[t.name] = q._parameters["weight"]
            else:
                p = nn.Parameter(torch.empty(shape, device=device, dtype=dt))
                p.requires_grad_(cast(nn.Parameter, w).requires_grad)
                self._parameters[t.name] = p
            if t.bias is not None:
                b = cast(nn.Parameter, orig._parameters[t.bias])
                self.full_shapes[t.bias] = tuple(b.shape)
                bshape = list(b.shape)
                if t.first and t.name in self.splits:  # (E, out): out is the split dim
                    bshape[1] = self.splits[t.name].size(rank)
                self.local_shapes[t.bias] = tuple(bshape)
                self._parameters[t.bias] = nn.Parameter(
                    torch.empty(bshape, device=device, dtype=dt), requires_grad=b.requires_grad
                )
        # the module whose forward runs: the original's attributes and code, no tensors of its own
        local: Any = copy.copy(orig)
        local._parameters = {k: None for k in orig._parameters}
        local._buffers = dict(orig._buffers)
        local._modules = dict(orig._modules)
        local._forward_hooks = type(orig._forward_hooks)()
        local._forward_pre_hooks = type(orig._forward_pre_hooks)()
        object.__setattr__(self, "local", local)
        for name, child in orig.named_children():  # an expert norm, ...: the model's modules
            self.add_module(name, child)
        self.device_hint = device
        self.track_rng = False  # no dropout region of its own: the routed computation is whole
        self.rng = RngRegions()
        self.loaded = False
        object.__setattr__(self, "_adapter", None)  # plain LoRA: none (per-expert: expert_lora)
        self.copy_share = None
        self.local_output = False
        self.expert_lora = nn.ModuleDict()
        self.routed_only = hasattr(orig, "num_experts")
        self.last_routed = 0  # experts the last routed-only forward ran on (0: none yet)
        # on by default: measured faster on a GPU (docs/quantization-and-lora.md, "Mixtures of
        # experts"); 0 keeps the weight deltas
        self.adapters_on_activations = env_switch(
            "QUANTMESH_EXPERT_ADAPTERS_ON_ACTIVATIONS", default=True
        )
        self.grouped_mm = _transformers_grouped_mm()
        self.padding_idx = None
        self.in_local = self.out_local = 0
        return self

    # ---- parameters: own, not mirrored from a local module -----------------------------------
    def _sync_from_local(self) -> None:
        for name, q in self.qlocal.items():
            self._parameters[name] = q._parameters["weight"]

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse_adapter_setattr(name)
        nn.Module.__setattr__(self, name, value)

    def _apply(self, fn, recurse=True):
        for name in self.qlocal:
            del self._parameters[name]
        nn.Module._apply(self, fn, recurse)
        for q in self.qlocal.values():
            q._apply(fn)
        self._sync_from_local()
        return self

    def train(self, mode: bool = True):
        nn.Module.train(self, mode)
        self.local.train(mode)
        return self

    @property
    def has_bias(self) -> bool:
        return False  # per-expert biases are named tensors of their own (param_slices)

    @torch.no_grad()
    def fill_from(self, orig: nn.Module) -> None:
        """Fill this rank's slices of every expert tensor (and bias) from `orig`, the experts
        module this one replaces, when it holds values (not on meta). Sets `loaded`."""
        first = orig._parameters[next(iter(self.tensors))]
        assert first is not None  # expert_tensors checked it
        self.loaded = first.device.type != "meta"
        if not self.loaded:
            return
        for name, sl in self.param_slices().items():
            t = orig._parameters[name]
            assert t is not None  # listed by expert_tensors
            self.load_param(name, slice_dim(t.detach(), *sl) if sl is not None else t.detach())

    def set_rng(self, rng: RngRegions, track: bool) -> None:
        """The model's RngRegions; never tracked: the routed computation is whole."""
        self.rng, self.track_rng = rng, False

    # ---- slices: the loader's and the savers' contract ----------------------------------------
    def _slice_of(self, name: str) -> tuple[int, FeatureSplit] | None:
        for t in self.tensors.values():
            if t.name == name and name in self.splits:
                return t.split_dim, self.splits[name]
            if t.bias == name and t.first and t.name in self.splits:
                return 1, self.splits[t.name]
        return None

    def param_slices(self) -> dict[str, tuple[int, Ranges] | None]:
        out: dict[str, tuple[int, Ranges] | None] = {}
        for t in self.tensors.values():
            for name in (t.name, t.bias):
                if name is None:
                    continue
                sl = self._slice_of(name)
                out[name] = None if sl is None else (sl[0], sl[1].ranges(self.tp_rank))
        return out

    def local_shape(self, name: str) -> tuple[int, ...]:
        return self.local_shapes[name]

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.full_shapes[name]

    def tp_splits(self) -> dict[str, tuple[int, FeatureSplit]]:
        out = {}
        for name in self.param_slices():
            sl = self._slice_of(name)
            if sl is not None:
                out[name] = sl
        for tname in self.expert_lora:
            if tname not in self.splits:
                continue
            t = self.tensors[tname]
            # A (E*r, in): split with the input (second projection); B (out, E*r): with the output
            key = "lora_B.weight" if t.first else "lora_A.weight"
            out[f"expert_lora.{tname}.{key}"] = (0 if t.first else 1, self.splits[tname])
        return out

    def checkpoint_tensors(self, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in self.param_slices():
            if name in self.qlocal:
                assert self.fmt is not None  # quantized tensors have a format
                out[name] = self.fmt.dequantize(self.qlocal[name]).view(self.local_shapes[name])
            else:
                p = self._parameters[name]
                assert p is not None, f"{self.fqn}.{name} is None"
                out[name] = p.detach()
        for tname, ad in self.expert_lora.items():
            for ab in ("lora_A", "lora_B"):
                out[f"expert_lora.{tname}.{ab}.weight"] = getattr(ad, ab).weight.detach()
        return out

    @torch.no_grad()
    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Set expert tensor (or bias) `name` from this rank's slice (checkpoint layout)."""
        expected = self.local_shapes[name]
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{self.fqn}.{name}: got a slice of shape {tuple(value.shape)}, expected "
                f"{expected} (experts split over tp rank {self.tp_rank}/{self.tp})"
            )
        device = self.device_hint
        if name in self.qlocal:
            assert self.fmt is not None  # quantized tensors have a format
            w = value.to(device=device,
                         dtype=torch.float32 if device.type == "cpu" else self.float_dtype)  # fmt: skip
            self.fmt.quantize_into(self.qlocal[name], w.reshape(-1, w.shape[-1]).contiguous())
            self._sync_from_local()
            return
        p = self._parameters[name]
        assert p is not None, f"{self.fqn}.{name} is None"
        if p.device.type == "meta":
            self._parameters[name] = nn.Parameter(
                value.to(device=device, dtype=self.float_dtype).clone(),
                requires_grad=p.requires_grad,
            )
        else:
            p.copy_(value.to(dtype=p.dtype))

    # ---- adapters -------------------------------------------------------------------------------
    def attach_expert_lora(
        self, names: list[str], r: int, scale: float, a_full: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        """Per-expert adapters on tensors `names`; `a_full[name]` is the whole (E*r, in) A."""
        for name in names:
            t = self.tensors[name]
            a = a_full[name].to(self.device_hint)
            out_rows = self.full_shapes[name][t.out_dim]
            if name in self.splits:
                sp = self.splits[name]
                if t.first:  # output split: B's rows follow it, A whole
                    out_rows = sp.size(self.tp_rank)
                else:  # input split: A's columns follow it, B whole
                    a = torch.cat([a[:, x:y] for x, y in sp.ranges(self.tp_rank)], dim=1)
            self.expert_lora[name] = ExpertAdapter.new(
                a, out_rows, experts=self.num_experts, r=r, scale=scale, dtype=dtype
            )

    def set_expert_adapter(self, name: str, adapter: ExpertLora) -> None:
        """Replace the adapter of expert tensor `name` (one it has; its place and name kept):
        a retuned ExpertAdapter, or a bank's adapter of many (serve/bank.py)."""
        if name not in self.expert_lora:
            raise KeyError(f"{self.fqn}.{name} has no adapter to replace")
        self.expert_lora[name] = adapter

    def expert_adapters(self) -> dict[str, ExpertAdapter]:
        """{tensor name: its adapter}, in registration order (trained adapters: not a bank's)."""
        out = {}
        for t, ad in self.expert_lora.items():
            if not isinstance(ad, ExpertAdapter):
                raise TypeError(
                    f"{self.fqn}.{t} holds {type(ad).__name__}, not one adapter (a server's bank "
                    "of adapters is not saved or loaded as one)"
                )
            out[t] = ad
        return out

    @torch.no_grad()
    def merged_local(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """This rank's slice `local` of expert tensor `name` (checkpoint layout, float) with its
        per-expert adapter merged in, W_e + scale * B_e @ A_e in fp32, in `local`'s dtype;
        `local` itself when the tensor has no adapter (`qm.export`).

        Example:
            >>> local = experts.checkpoint_tensors()["down_proj"]  # doctest: +SKIP
            >>> experts.merged_local("down_proj", local).shape  # doctest: +SKIP
            torch.Size([4, 64, 16])
        """
        ad = self.expert_adapters().get(name)
        if ad is None:
            return local
        delta = ad.weight_delta(self.transposed, None, self._factors(self.tensors[name]))
        return (local.float() + delta.float()).to(local.dtype)

    # ---- forward ------------------------------------------------------------------------------
    def _effective(
        self, hit: torch.Tensor | None = None, units: int = 0, deltas: bool = True
    ) -> dict[str, torch.Tensor]:
        """The tensors the experts forward reads: dequantized, plus the adapters' deltas (unless
        `deltas` is False); the second projection's bias on tp rank 0 only. With `hit` (expert
        ids, sorted): those experts' only, in that order. `units` > the module's experts: the ids
        are an adapter bank's (`ExpertLora.route`), expert `hit % E` of one adapter slot each."""
        out: dict[str, torch.Tensor] = {}
        g = self.group
        e = self.num_experts
        # the base experts read (`base`, None: all) and, for a bank's ids, each id's place among
        # them (`spread`): every base expert is dequantized once, however many slots use it
        base, spread = hit, None
        if units > e:
            if hit is None:  # every (slot, expert): all experts, tiled slot after slot
                hit = torch.arange(units, device=self.device_hint)
                spread = torch.arange(e, device=self.device_hint).repeat(units // e)
            else:
                base, spread = torch.unique(hit % e, return_inverse=True)
        for name, t in self.tensors.items():
            shape = self.local_shapes[name]
            if name in self.qlocal:
                assert self.fmt is not None  # quantized tensors have a format
                q = self.qlocal[name]
                if base is None:
                    w = self.fmt.compute_weight(q).view(shape)
                else:
                    w = self.fmt.compute_units(q, shape[0], base).view(len(base), *shape[1:])
                w = w.to(self.float_dtype)
            else:
                w = cast(torch.Tensor, self._parameters[name])
                if base is not None:
                    w = w.index_select(0, base)
            if spread is not None:
                w = w.index_select(0, spread)
            ad = cast(
                ExpertLora | None, self.expert_lora[name] if name in self.expert_lora else None
            )
            if ad is not None and deltas:
                factors = self._factors(t)
                w = w + ad.weight_delta(self.transposed, hit, factors).to(w.dtype)
            out[name] = w
            if t.bias is not None:
                bias = cast(torch.Tensor, self._parameters[t.bias])
                if base is not None:
                    bias = bias.index_select(0, base)
                if spread is not None:
                    bias = bias.index_select(0, spread)
                if not t.first and self.tp > 1:  # added to a partial sum: once, on rank 0
                    bias = copy_to_tp(bias, g) if bias.requires_grad else bias
                    bias = bias * (1.0 if self.tp_rank == 0 else 0.0)
                out[t.bias] = bias
        return out

    def _factors(self, t: ExpertTensor) -> Factors:
        """The adapter factors as tensor `t`'s delta reads them: at tp > 1 the whole factor meets
        split features, so it goes through copy_to_tp (its gradient reduced)."""
        g, tp = self.group, self.tp

        def factors(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if tp > 1:
                if t.first:
                    a = copy_to_tp(a, g)
                else:
                    b = copy_to_tp(b, g)
            return a, b

        return factors

    def _run(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        routed = self._routed(args, kwargs)
        if routed is None:
            routing = self._grouped_routing(args, kwargs)
            if routing is not None:
                return self._grouped_forward(x, *routing)
            return torch.func.functional_call(self.local, self._effective(), (x, *args), kwargs)
        hit, units, args, kwargs = routed
        local = cast(Any, self.local)
        whole = local.num_experts
        if hit is not None:
            self.last_routed = len(hit)
        local.num_experts = units if hit is None else len(hit)  # the model's loop counts these
        try:
            return torch.func.functional_call(
                local, self._effective(hit, units), (x, *args), kwargs
            )
        finally:
            local.num_experts = whole

    def uses_activation_adapters(self) -> bool:
        """Whether this module adds its expert adapters on the activations (module doc): asked
        for (`adapters_on_activations`), transformers' grouped experts forward, adapters of one
        expert tensor or both, each of a rank r whose rows grouped matmuls take (16 bytes), no
        expert parallelism; else they are weight deltas.

        Example:
            >>> experts.uses_activation_adapters()  # doctest: +SKIP
            False
        """
        local = cast(Any, self.local)
        ads = list(self.expert_lora.values())
        size = torch.finfo(self.float_dtype).bits // 8
        return (
            self.adapters_on_activations
            and self.grouped_mm is not None
            and getattr(getattr(local, "config", None), "_experts_implementation", None)
            == "grouped_mm"
            and not getattr(local, "_is_expert_parallel", False)
            and hasattr(local, "has_gate")
            and len(ads) > 0
            and all(isinstance(ad, ExpertAdapter) and ad.r * size % 16 == 0 for ad in ads)
        )

    def _grouped_routing(
        self, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(routing ids, routing weights) when this forward adds the adapters on the activations
        (`uses_activation_adapters`, and the forward's two arguments are those); else None (the
        weight-delta path)."""
        if kwargs or len(args) != 2 or not self.uses_activation_adapters():
            return None
        ids, weights = args if _is_ids(args[0]) else args[::-1]
        if not _is_ids(ids) or not (
            isinstance(weights, torch.Tensor) and weights.is_floating_point()
        ):
            return None
        return ids, weights

    def _grouped_forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' grouped experts forward (its experts interface's semantics) on the
        dequantized experts, each expert tensor's adapter added to its projection's output."""
        local = cast(Any, self.local)
        e = self.num_experts
        w = self._effective(deltas=False)
        k, tokens = top_k_index.size(-1), x.size(0)
        ids_g, perm = torch.sort(top_k_index.reshape(-1))  # grouped by expert
        xs = x[perm // k]
        routing = top_k_weights.reshape(-1)[perm]
        # histc: no data-dependent output size (CUDA graphs); float on CPU, integers on CUDA
        counts = ids_g.float() if x.device.type in ("cpu", "mps") else ids_g.int()
        offs = torch.cumsum(torch.histc(counts, bins=e, min=0, max=e - 1), 0, dtype=torch.int32)
        first, second = self.tensors.values()  # as build_experts made them
        h = self._grouped_linear(xs, first, w, offs, ids_g)
        h = local._apply_gate(h) if local.has_gate else local.act_fn(h)
        y = self._grouped_linear(h, second, w, offs, ids_g)
        if getattr(local, "has_post_expert_norm", False):
            y = local.post_expert_norm(y)
        y = y * routing.unsqueeze(-1)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[back].view(tokens, k, -1).sum(dim=1).to(x.dtype)

    def _grouped_linear(
        self,
        xs: torch.Tensor,
        t: ExpertTensor,
        w: dict[str, torch.Tensor],
        offs: torch.Tensor,
        ids_g: torch.Tensor,
    ) -> torch.Tensor:
        """One projection of the rows `xs` (grouped by expert): base, bias, then the adapter."""
        gmm = self.grouped_mm
        weight = w[t.name]
        y = gmm(xs, weight if self.transposed else weight.transpose(-2, -1), offs)
        if t.bias is not None:
            y = y + w[t.bias][ids_g]
        if t.name in self.expert_lora:
            ad = cast(ExpertAdapter, self.expert_lora[t.name])
            a, b = self._factors(t)(ad.lora_A.weight, ad.lora_B.weight)
            e, r, dt = self.num_experts, ad.r, weight.dtype
            a3 = permuted_copy(a, [e, r, a.shape[-1]], [0, 2, 1], dt)  # (E, in, r): A_e^T
            b3 = permuted_copy(b, [b.shape[0], r, e], [2, 1, 0], dt)  # (E, r, out): B_e^T
            low = gmm(xs, a3, offs)  # (S, r)
            y = y + gmm(low, b3, offs) * ad.scale
        return y

    def _routed(
        self, args: tuple, kwargs: dict
    ) -> tuple[torch.Tensor | None, int, tuple, dict] | None:
        """(the experts hit, sorted, or None: all; how many experts the ids count; the arguments
        with the routing ids renumbered) when the forward's one integer tensor (the routing ids)
        reaches fewer than all experts or an adapter bank renumbers them (one copy of every expert
        per slot, chosen by each token's row); None: run every expert as the module has them
        (compiling, no or several integer arguments, all experts hit, an id out of range)."""
        where: list[int | str] = [i for i, v in enumerate(args) if _is_ids(v)]
        where += [k for k, v in kwargs.items() if _is_ids(v)]
        # the module's banked adapters are one bank's: the first says how the rows route
        banked = next((ad for ad in self.expert_lora.values() if not isinstance(ad, ExpertAdapter)),
                      None)  # fmt: skip
        if banked is not None and len(where) != 1:
            raise RuntimeError(
                f"{self.fqn}: an adapter bank picks experts per row through the routing ids, "
                f"but this experts forward takes {len(where)} integer tensors, not one"
            )
        if len(where) != 1:
            return None
        at = where[0]
        ids = args[at] if isinstance(at, int) else kwargs[at]
        e = self.num_experts
        bank = cast(ExpertLora, banked).route(ids) if banked is not None else None
        if bank is not None:
            ids, e = bank
        if self.routed_only and not torch.compiler.is_compiling():
            hit = torch.unique(ids)  # sorted
            ends = hit[[0, -1]].tolist() if hit.numel() else [0, e]
            if hit.numel() < e and ends[0] >= 0 and ends[1] < e:
                lut = torch.zeros(e, dtype=ids.dtype, device=ids.device)
                lut[hit] = torch.arange(len(hit), dtype=ids.dtype, device=ids.device)
                return hit, e, *_with(args, kwargs, at, lut[ids])
        if bank is None:
            return None
        return None, e, *_with(args, kwargs, at, ids)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.tp > 1:  # every float input (hidden state, routing weights) meets split features
            x = copy_to_tp(x, self.group)
            args = tuple(self._copy_in(a) for a in args)
            kwargs = {k: self._copy_in(v) for k, v in kwargs.items()}
        if torch.is_grad_enabled() and (self.fmt is not None or len(self.expert_lora) > 0):
            # keeps only the inputs for backward: no dequantized (or delta-added) expert weight
            y = torch.utils.checkpoint.checkpoint(
                self._run, x, *args, use_reentrant=False, **kwargs
            )
        else:
            y = self._run(x, *args, **kwargs)
        return reduce_from_tp(y, self.group) if self.tp > 1 else y

    def _copy_in(self, v: Any) -> Any:
        """A float tensor that needs a gradient, through copy_to_tp: each rank's gradient of it
        is a partial sum over its features."""
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            return copy_to_tp(v, self.group)
        return v

    def extra_repr(self) -> str:
        q = f", quant={self.fmt.name}" if self.fmt is not None else ""
        shapes = ", ".join(f"{k}={tuple(v)}" for k, v in self.local_shapes.items())
        return f"Experts({self.num_experts}), local: {shapes}, tp {self.tp_rank}/{self.tp}{q}"


def _with(args: tuple, kwargs: dict, at: int | str, value: Any) -> tuple[tuple, dict]:
    """`args` and `kwargs` with the argument at `at` (a position or a name) replaced."""
    if isinstance(at, int):
        return (*args[:at], value, *args[at + 1 :]), kwargs
    return args, {**kwargs, at: value}


def _is_ids(v: Any) -> bool:
    """An integer tensor: the routing ids among an experts forward's arguments."""
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool
