"""TP-aware LoRA: the adapter types, and A and B sharded as derived from the base layer's style.

  colwise base (output split):  A (r, in) whole, applied before the copy-to-tp op; B (out_local, r)
  rowwise base (input split):   A (r, in_local) split on in; its partial sums are reduced together
                                with the base output in one all-reduce; B (out, r) whole
  replicated base:              A and B whole

A is drawn from the full logical (r, in) tensor with a generator seeded by (seed, module name), then
sliced: tp=1 and tp=4 start from identical adapters. B starts at zero (PEFT's default), so a fresh
adapter leaves the model's outputs unchanged.

A layer owns one `Adapter` (`LoraAdapter`: A, B, dropout, scale, rank) and runs it in two halves
around its own collectives (`down`, then `up`); the layer holds it through one method,
`set_adapter` (tp/layers.py). Nothing here knows the layer: `attach_lora` reads the few facts it
needs of any `LoraHost`. `ExpertAdapter` is the per-expert adapter of a fused experts tensor (an `ExpertLora`).
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..config import ALL_LINEAR, DEFAULT_TARGETS, LoraConfig, LoraError
from ..plan.styles import FeatureSplit, Style, slice_dim
from ..quant import kernel4
from ..tp.kinds import kind_of

__all__ = [
    "Adapter",
    "ExpertAdapter",
    "ExpertLora",
    "Factors",
    "LoraAdapter",
    "LoraConfig",
    "LoraError",
    "LoraHost",
    "LowRank",
    "attach_lora",
    "expert_products",
    "lean_linear",
    "lora_splits",
    "lora_targets",
    "trainable_parameters",
]

# One row inside a compiled graph without autograd (the decode step): an adapter's matmuls as a
# product and a sum (`lean_linear`), which the compiler fuses with the ops around them, instead of
# a library matmul kernel each (a few microseconds of launch for a few of work). False: matmuls.
LEAN_ROWS = True


def lean_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` (no bias): for one row (`x` of `in` elements) while a graph is compiled
    without autograd or autocast, and `LEAN_ROWS`, as `(x[..., None, :] * w).sum(-1)`, which the
    compiler makes a reduction kernel of its own, fused with its neighbours (a decode step's
    adapters: one small matmul each otherwise). The same sums in another order: fp32 adapters
    agree to fp32 rounding.

    Example:
        >>> x, w = torch.ones(1, 1, 4), torch.ones(3, 4)
        >>> lean_linear(x, w).shape
        torch.Size([1, 1, 3])
    """
    if (
        LEAN_ROWS
        and x.numel() == x.shape[-1]
        and not torch.is_grad_enabled()
        and torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(x.device.type)
        and type(w) in (torch.Tensor, nn.Parameter)  # not a DTensor (sharded: its own matmul)
    ):
        return (x.unsqueeze(-2) * w).sum(-1)
    return torch.nn.functional.linear(x, w)


def _linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mod(x)` for an adapter's bias-free `nn.Linear` (`lean_linear` of its weight where the
    module has no hooks of its own: a hooked one, FSDP's, is called)."""
    if (
        isinstance(mod, nn.Linear)
        and mod.bias is None
        and not (mod._forward_hooks or mod._forward_pre_hooks)
    ):
        return lean_linear(x, mod.weight)
    out: torch.Tensor = mod(x)
    return out


def lora_targets(model: nn.Module, config: LoraConfig, extra: list[str] | None = None) -> list[str]:
    """FQNs of the modules (and of the `extra` tensor names: expert tensors) `config.targets`
    selects, in the model's order; raises LoraError when a target given explicitly matches
    nothing, the default matches nothing at all, or a selected module is neither linear-like nor
    an experts module (the owner of `extra` tensors). `"all-linear"` is PEFT's: every linear
    layer but the output head (`get_output_embeddings()`; a model without it has none), expert
    tensors not among them (name them beside it).

    Example:
        >>> lora_targets(model, LoraConfig(targets=["q_proj"]))  # doctest: +SKIP
        ['model.layers.0.self_attn.q_proj', ...]
        >>> lora_targets(llama, LoraConfig(targets=["all-linear"]))[-1]  # doctest: +SKIP
        'model.layers.31.mlp.down_proj'
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    modules = [(n, m) for n, m in model.named_modules() if n]
    linear = {n for n, m in modules if (k := kind_of(m)) is not None and k.linear_like}
    every_linear = {n for n, m in modules if n in linear and m is not head}  # "all-linear"
    names = [n for n, _ in modules] + list(extra or [])
    every = ALL_LINEAR in config.targets
    found = [n for n in names if config.matches(n) or (every and n in every_linear)]
    default = config.default_targets
    flag = " (CLI: --lora-targets)"
    for t in config.targets if not (default and found) else []:
        if default:
            t = ", ".join(DEFAULT_TARGETS)
        if t == ALL_LINEAR:
            hit = bool(every_linear)
        else:
            hit = any(_selects(t, n) for n in names)
        if not hit:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})  # GPT-2's Conv1D among them
            what = (
                f"the default LoRA targets ({t}) match" if default else f"LoRA target {t!r} matches"
            )
            tensors = ""
            if extra:  # expert tensors: by leaf name, full name or a glob
                glob = "*" + ".".join(extra[0].split(".")[-2:])
                kinds = sorted({e.rsplit(".", 1)[-1] for e in extra})
                tensors = f"; expert tensors: {', '.join(kinds)} (or a glob such as {glob!r})"
            have = (
                f"linear layer names in this model: {', '.join(leaves[:20])}"
                if leaves else "it has no linear layers"
            )  # fmt: skip
            raise LoraError(
                f"{what} no module of {type(model).__name__}; {have}{tensors}; pass "
                f"LoraConfig(targets=[...]){flag}"
            )
    owners = {e.rsplit(".", 1)[0] for e in extra or []}  # experts modules: their tensors
    named = set(extra or [])
    for n in found:
        if n not in linear and n not in owners and n not in named:
            m = model.get_submodule(n)
            raise LoraError(
                f"LoRA target {n} is a {type(m).__name__}, selected by "
                f"{[t for t in config.targets if _selects(t, n)]}; LoRA "
                "applies to linear layers (and the expert tensors of experts modules) only; "
                f"narrow LoraConfig(targets=...){flag}"
            )
    return found


def _selects(target: str, fqn: str) -> bool:
    """Whether one LoRA target names `fqn`: its last name, its full name or a glob on it."""
    return target == fqn.rsplit(".", 1)[-1] or target == fqn or fnmatch.fnmatchcase(fqn, target)


def _init_A(fqn: str, r: int, in_full: int, seed: int) -> torch.Tensor:
    """The full (r, in_full) A of module `fqn`: kaiming-uniform as PEFT does, from its own seed."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63)
    a = torch.empty(r, in_full)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


class LowRank(NamedTuple):
    """An adapter's delta in the form a 4-bit layer adds in its own matmul's launch (the gemv:
    `quant.kernel4.check_low_rank`): output feature n gets `scale[n] * (e[n] @ t[..., col[n]:
    col[n] + r])`, t = `down(x)` the adapters' A products (fp32), e the B rows. `whole`: the same
    for every sibling of a stack (`infer.decode.AdapterStack`) at once, which a joined launch of
    the siblings' codes adds (`members`: the ids of the siblings' base layers, in order); None
    for a lone adapter.

    Example:
        >>> ad = LoraAdapter.new(torch.randn(4, 64), 32, scale=2.0)
        >>> with torch.no_grad():
        ...     lr = ad.low_rank()
        >>> lr.e.shape, lr.col.dtype, float(lr.scale[0]), lr.down(torch.ones(1, 64)).shape
        (torch.Size([32, 4]), torch.int32, 2.0, torch.Size([1, 4]))
    """

    e: torch.Tensor
    col: torch.Tensor
    scale: torch.Tensor
    down: Callable[[torch.Tensor], torch.Tensor]
    whole: LowRank | None = None
    members: tuple[int, ...] = ()


class Adapter(nn.Module):
    """What a layer runs of its adapter, in two halves around the layer's own collectives:
    `down(drop(x))` gives (..., r) (a partial sum when the layer's input is split), the layer
    reduces or copies it over tp, and `up(a)` gives the scaled delta (..., out) it adds to its
    output. `shortcut(x)` may give that whole delta another way (stacked decode adapters), or None.

    A layer holds its adapter hidden and registers the adapter's child modules as its own, under
    their names (`lora_A`, `lora_B`, `lora_dropout`): parameter names are PEFT's. Tensors of the
    adapter's own (a bank's buffers) move with the layer (`.to()`), not through its state dict.

    Example:
        >>> layer.set_adapter(LoraAdapter.new(torch.zeros(8, 64), 128, scale=2.0))  # doctest: +SKIP
        >>> layer.adapter.r  # doctest: +SKIP
        8
    """

    @property
    def r(self) -> int:
        """The rank: the width of `down`'s output."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype `down` reads and `up` takes."""
        raise NotImplementedError

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input dropout (none by default)."""
        return x

    def cast_in(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input: under autocast the matmul casts it anyway, so no fp32 copy of x
        (it would be kept for backward, once per adapter); otherwise in the adapter's dtype."""
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.dtype)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., r): A on `x` (already through `drop`)."""
        raise NotImplementedError

    def up(self, a: torch.Tensor) -> torch.Tensor:
        """(..., r) -> (..., out): B on the (reduced) output of `down`, times the scale."""
        raise NotImplementedError

    def shortcut(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole scaled delta of `x` computed another way, or None (the layer then runs
        `drop`, `down` and `up`)."""
        return None

    def low_rank(self) -> LowRank | None:
        """The delta as a 4-bit layer's launch adds it (`LowRank`), or None: this adapter's
        delta is added after the layer's product (the default)."""
        return None


class LoraAdapter(Adapter):
    """One layer's trainable LoRA: `lora_A` (r, in), `lora_B` (out, r), `lora_dropout` on the
    input, and `scale` (alpha / r); its delta is `B(A(dropout(x))) * scale`.

    Example:
        >>> ad = LoraAdapter.new(torch.randn(8, 64), 128, scale=2.0, dropout=0.05)
        >>> (ad.r, tuple(ad.lora_B.weight.shape))
        (8, (128, 8))
    """

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module

    def __init__(
        self, lora_A: nn.Linear, lora_B: nn.Linear, lora_dropout: nn.Module, scale: float
    ) -> None:
        super().__init__()
        self.lora_A, self.lora_B, self.lora_dropout = lora_A, lora_B, lora_dropout
        self.scale = float(scale)

    @classmethod
    def new(
        cls,
        a: torch.Tensor,
        out: int,
        *,
        scale: float,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> LoraAdapter:
        """A fresh adapter: A holds `a` (r, in), B (out, r) is zero."""
        dev = a.device if device is None else device
        r, in_f = a.shape
        lora_A = nn.Linear(in_f, r, bias=False, device=dev, dtype=dtype)
        lora_B = nn.Linear(r, out, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            lora_A.weight.copy_(a)
            lora_B.weight.zero_()
        return cls(lora_A, lora_B, _dropout(dropout), scale)

    def retuned(self, *, scale: float, dropout: float) -> LoraAdapter:
        """The same A and B (the very modules) with another scale and dropout."""
        return LoraAdapter(self.lora_A, self.lora_B, _dropout(dropout), scale)

    @property
    def r(self) -> int:
        return int(self.lora_A.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_A.weight.dtype

    @property
    def dropout(self) -> float:
        """The input dropout's probability (0 for none)."""
        d = self.lora_dropout
        return float(d.p) if isinstance(d, nn.Dropout) else 0.0

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        xd: torch.Tensor = self.lora_dropout(x)
        return xd

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.lora_A, self.cast_in(x))

    def up(self, a: torch.Tensor) -> torch.Tensor:
        return _linear(self.lora_B, a) * self.scale

    def low_rank(self) -> LowRank | None:
        """`LowRank` of this adapter: B's rows, its scale, A as `down` (fp32 adapters of plain
        tensors, without autograd, autocast or an active dropout; else None)."""
        b = self.lora_B.weight
        if not _adds_in_launch(self, b):
            return None
        key = (str(b.device), int(b.shape[0]), self.scale)
        # (read with getattr, written only eagerly: torch 2.11's compiler cannot trace a
        # `__dict__.setdefault`)
        vectors: dict[Any, Any] | None = getattr(self, "_low_rank_vectors", None)
        if vectors is None or key not in vectors:  # made in an eager call and kept (fixed
            if torch.compiler.is_compiling():  # addresses), never while a graph is traced
                return None  # (fast_decode's prefill makes them first: prepare_low_rank)
            if vectors is None:
                vectors = self.__dict__["_low_rank_vectors"] = {}
            n = key[1]
            col = torch.zeros(n, dtype=torch.int32, device=b.device)
            sc = torch.full((n,), self.scale, dtype=torch.float32, device=b.device)
            vectors[key] = (static_on_cuda(col), static_on_cuda(sc))
        col, sc = vectors[key]
        return LowRank(b, col, sc, self.down)


def _adds_in_launch(ad: LoraAdapter, *weights: torch.Tensor) -> bool:
    """Whether `ad`'s delta may be added inside a 4-bit layer's launch now: where the launch takes
    deltas (`kernel4.gemv_lora_on`), fp32 factors of plain tensors (`weights`: those the launch
    reads), no autograd, no autocast, no active dropout."""
    drop = ad.lora_dropout
    return (
        kernel4.gemv_lora_on(weights[0].device)
        and not torch.is_grad_enabled()
        and ad.lora_A.weight.dtype == torch.float32
        and all(kernel4.plain_tensor(w) and w.is_contiguous() for w in weights)
        and not torch.is_autocast_enabled(weights[0].device.type)
        and (isinstance(drop, nn.Identity) or not drop.training)
    )


def static_on_cuda(t: torch.Tensor) -> torch.Tensor:
    """`t`, marked as a fixed address (CUDA graphs read it in place, never copy it) when on CUDA.

    Example:
        >>> static_on_cuda(torch.zeros(2)).shape
        torch.Size([2])
    """
    if t.is_cuda:
        torch._dynamo.mark_static_address(t)
    return t


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class LoraHost(Protocol):
    """What `attach_lora` reads of a layer (tp/layers.py's ShardedModule is one): its name, how
    its features are split over tp, and the one method that gives it an adapter."""

    fqn: str
    style: Style
    split: FeatureSplit | None
    tp_rank: int
    in_full: int
    out_full: int
    out_local: int

    def set_adapter(self, adapter: Adapter | None) -> None: ...


def lora_splits(style: Style, split: FeatureSplit | None) -> dict[str, tuple[int, FeatureSplit]]:
    """{adapter tensor: (dim, split)} of the factors a layer of `style` splits over tp: a rowwise
    base splits A on its input features, any other split base B on its output features; an
    unsplit one neither.

    Example:
        >>> lora_splits(Style.ROWWISE, split)  # doctest: +SKIP
        {'lora_A.weight': (1, split)}
    """
    if split is None:
        return {}
    if style == Style.ROWWISE:
        return {"lora_A.weight": (1, split)}
    return {"lora_B.weight": (0, split)}


def attach_lora(
    module: LoraHost,
    config: LoraConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Give a layer a fresh `LoraAdapter` of `config`, sharded to follow its style
    (`module.set_adapter`; a layer that is not linear refuses it).

    Example:
        >>> attach_lora(sharded_q_proj, LoraConfig(r=8), device="cpu")  # doctest: +SKIP
    """
    a = _init_A(module.fqn, config.r, module.in_full, config.seed)  # (r, in)
    out_b = module.out_local  # colwise: B split on out; replicate: whole
    if module.style == Style.ROWWISE:  # A split on in (r, in_local), B whole (lora_splits)
        assert module.split is not None  # rowwise splits its input
        a = slice_dim(a, 1, module.split.ranges(module.tp_rank))
        out_b = module.out_full
    module.set_adapter(
        LoraAdapter.new(
            a, out_b, scale=config.scaling, dropout=config.dropout, device=device, dtype=dtype
        )  # fmt: skip
    )


Factors = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(A, B) -> the (A, B) an expert delta reads: a tp layer wraps the whole factor (copy_to_tp)."""


class ExpertLora(nn.Module):
    """What an experts module runs of an expert tensor's adapter: `weight_delta` gives the
    scaled weight deltas of some experts, `route` may renumber the routing ids onto more experts
    than the module has (a bank of adapters: one copy of every expert per adapter slot, chosen
    per row). The experts module holds it through `set_expert_adapter`.

    Example:
        >>> experts.set_expert_adapter("down_proj", ExpertAdapter.new(a, 32, experts=4, r=2,
        ...                                                          scale=1.0))  # doctest: +SKIP
    """

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """(the routing ids renumbered, the number of experts they count) or None: the module's
        own ids and experts (the default)."""
        return None

    def weight_delta(
        self,
        transposed: bool,
        experts: torch.Tensor | None,
        factors: Factors,
    ) -> torch.Tensor:
        """The scaled deltas (n, out, in), or (n, in, out) for a transposed layout, of experts
        `experts` (ids, as `route` numbers them), or of every expert (None). `factors(a, b)`
        gives the factors the computation reads (a tp layer wraps the whole one so that its
        gradient is reduced)."""
        raise NotImplementedError


class ExpertAdapter(ExpertLora):
    """LoRA of one expert tensor in PEFT's `target_parameters` layout: `lora_A` (E*r, in) and
    `lora_B` (out, E*r), expert e's delta `B[:, e::E] @ A[e*r:(e+1)*r]` (out, in) times `scale`.

    Example:
        >>> ad = ExpertAdapter.new(torch.randn(4 * 2, 16), 32, experts=4, r=2, scale=1.0)
        >>> tuple(ad.delta(ad.lora_A.weight, ad.lora_B.weight, False).shape)
        (4, 32, 16)
    """

    lora_A: nn.Linear
    lora_B: nn.Linear

    def __init__(
        self, lora_A: nn.Linear, lora_B: nn.Linear, experts: int, r: int, scale: float
    ) -> None:
        super().__init__()
        self.experts, self.r, self.scale = experts, r, float(scale)
        self.lora_A, self.lora_B = lora_A, lora_B

    @classmethod
    def new(
        cls, a: torch.Tensor, b_rows: int, *, experts: int, r: int, scale: float,
        dtype: torch.dtype = torch.float32,
    ) -> ExpertAdapter:  # fmt: skip
        """A fresh adapter: A holds `a` (E*r, in), B (b_rows, E*r) is zero."""
        lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False, device=a.device, dtype=dtype)
        lora_B = nn.Linear(a.shape[0], b_rows, bias=False, device=a.device, dtype=dtype)
        with torch.no_grad():
            lora_A.weight.copy_(a)
            lora_B.weight.zero_()
        return cls(lora_A, lora_B, experts, r, scale)

    def retuned(self, *, scale: float) -> ExpertAdapter:
        """The same A and B (the very modules) with another scale."""
        return ExpertAdapter(self.lora_A, self.lora_B, self.experts, self.r, scale)

    def weight_delta(
        self,
        transposed: bool,
        experts: torch.Tensor | None,
        factors: Factors,
    ) -> torch.Tensor:
        a, b = factors(self.lora_A.weight, self.lora_B.weight)
        return self.delta(a, b, transposed, experts) * self.scale

    def delta(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        transposed: bool,
        experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every expert's delta (E, out, in), or (E, in, out) for a transposed layout, from the
        factors `a`, `b` (this adapter's weights, as the layer hands them over), unscaled; with
        `experts` (ids), those experts' only, in that order."""
        e, r = self.experts, self.r
        a3 = a.reshape(e, r, a.shape[-1])  # (E, r, in)
        b3 = b.reshape(b.shape[0], r, e).permute(2, 0, 1)  # (E, out, r)
        if experts is not None:
            a3, b3 = a3.index_select(0, experts), b3.index_select(0, experts)
        return expert_products(a3, b3, transposed)


def expert_products(a3: torch.Tensor, b3: torch.Tensor, transposed: bool) -> torch.Tensor:
    """B @ A per expert: `a3` (n, r, in), `b3` (n, out, r) -> (n, out, in), or (n, in, out) for
    a transposed layout.

    Example:
        >>> expert_products(torch.ones(2, 1, 3), torch.ones(2, 4, 1), False).shape
        torch.Size([2, 4, 3])
    """
    if transposed:
        return torch.bmm(a3.transpose(1, 2), b3.transpose(1, 2))  # (n, in, out)
    return torch.bmm(b3, a3)  # (n, out, in)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should see: those with requires_grad (LoRA adapters by default).

    Example:
        >>> opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=2e-4)  # doctest: +SKIP
    """
    return [p for p in model.parameters() if p.requires_grad]
