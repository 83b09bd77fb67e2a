"""The one parallel layer: a wrapper around a *local* module holding only this rank's shard.

The wrapper sits in the model tree under the original name and registers the local module's
parameters under their original names, so `state_dict()` keys never change (no wrapper prefixes). The
local module may be nn.Linear, transformers' Conv1D, nn.Embedding, nn.Conv2d, or a quantized linear
built by a QuantFormat; this file never names a format. A layer owns one adapter (lora/adapter.py's
`Adapter`: a trainable `LoraAdapter`, or another object of that interface, such as the server's
bank), given, replaced and removed only through `set_adapter`; its child modules (`lora_A`,
`lora_B`, `lora_dropout`) are registered on the layer under their own names, so parameter names are
PEFT's. Everything else a layer holds is set by its own methods too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from ..lora.adapter import Adapter, LoraAdapter, LoraError, lora_splits
from ..plan.styles import FeatureSplit, Ranges, Style, slice_dim
from ..quant.kinds import is_quantized_linear
from .collectives import (
    CopyShare,
    copy_to_tp,
    copy_to_tp_once,
    gather_from_tp,
    reduce_from_tp,
    split_to_tp,
)
from .kinds import Kind, new_local
from .rng import RngRegions

__all__ = ["ShardedModule", "inside_sharded", "share_colwise_copies", "sharded_modules"]

# Styles whose bias lives whole on the wrapper and is added once to the complete output: after the
# reduction (rowwise: a per-rank bias would be summed tp times), or after the gather (colwise_gather:
# so a bias shared with another module's parameter, like BERT's cls.predictions.bias, stays one
# tensor that both modules update).
WRAPPER_BIAS_STYLES = (Style.ROWWISE, Style.COLWISE_GATHER)


class ShardedModule(nn.Module):
    """A module of `kind` split by `style` over a tp group (or replicated, for quant/LoRA only).

    Built empty (uninitialized or on meta); `load_param` fills it one parameter slice at a time.

    Example:
        >>> m = ShardedModule.build(nn.Linear(8, 16), "model.q", kind_of(lin), "colwise",
        ...                         split, rank=0, group=g, device="cpu")  # doctest: +SKIP
    """

    # Set by build() and the methods below (never from outside); declared here for type
    # checkers, which otherwise read every attribute of an nn.Module as `Tensor | Module`.
    fqn: str
    kind: Kind
    style: Style
    split: FeatureSplit | None  # None: replicated (quant / LoRA only)
    tp_rank: int
    tp: int
    group: Any  # the tp ProcessGroup
    fmt: Any  # a QuantFormat, or None
    in_full: int
    out_full: int
    in_local: int
    out_local: int
    float_dtype: torch.dtype
    padding_idx: int | None
    local: nn.Module
    device_hint: torch.device
    track_rng: bool
    rng: RngRegions
    loaded: bool  # every base parameter written (fill_from, or load_checkpoint: mark_loaded)
    copy_share: CopyShare | None
    local_output: bool  # colwise_gather at tp > 1: hand back this rank's columns, ungathered

    def __init__(self) -> None:
        super().__init__()

    @classmethod
    def build(
        cls,
        orig: nn.Module,
        fqn: str,
        kind: Kind,
        style: Style | str,
        split: FeatureSplit | None,
        *,
        rank: int,
        group,
        device: torch.device,
        dtype: torch.dtype | None = None,
        fmt=None,
    ) -> ShardedModule:
        self = cls()
        style = Style(style)
        self.fqn, self.kind, self.style, self.split = fqn, kind, style, split
        self.tp_rank, self.group, self.fmt = rank, group, fmt
        self.tp = 1 if split is None else len(split.per_rank)
        in_full, out_full = kind.in_out(orig)
        self.in_full, self.out_full = in_full, out_full
        in_l, out_l = in_full, out_full
        if style.is_colwise or style.splits_input:
            assert split is not None, f"{fqn}: style {style} needs a split"
            if style.is_colwise:
                out_l = split.size(rank)
            else:
                in_l = split.size(rank)
        self.in_local, self.out_local = in_l, out_l
        has_bias = getattr(orig, "bias", None) is not None
        # rowwise / colwise_gather: the wrapper holds the whole bias (same name) and adds it to the
        # complete output (see WRAPPER_BIAS_STYLES); the local module has none.
        local_bias = has_bias and style not in WRAPPER_BIAS_STYLES
        w = cast(torch.Tensor, orig.weight)
        b = getattr(orig, "bias", None)
        # a linear quantized already stores integer codes: its float dtype is its bias's (or fp32)
        dt: torch.dtype = dtype or (
            w.dtype if w.is_floating_point() else (b.dtype if b is not None else torch.float32)
        )
        self.float_dtype = dt
        if fmt is not None:
            local = fmt.new_linear(in_l, out_l, bias=local_bias, device=device, dtype=dt)
        else:
            local = new_local(kind, orig, in_l, out_l, local_bias, device, dt)
        if kind.name == "Embedding":
            self.padding_idx = cast(nn.Embedding, orig).padding_idx
            # the padding row gets no gradient: where it lives, in this rank's row numbering
            pad = cast(nn.Embedding, orig).padding_idx
            if pad is not None and style == Style.VOCAB and split is not None:
                ((start, stop),) = split.ranges(rank)
                pad = pad - start if start <= pad < stop else None
            local.padding_idx = pad
        for name, p in local.named_parameters(recurse=False):  # keep the original's frozen-ness
            op = getattr(orig, name, None)
            p.requires_grad_(
                isinstance(op, nn.Parameter) and op.requires_grad and p.is_floating_point()
            )
        object.__setattr__(self, "local", local)  # hidden: not a child, so no extra FQN level
        self._sync_from_local()
        if has_bias and style in WRAPPER_BIAS_STYLES:
            self.bias = nn.Parameter(
                torch.empty(out_full, device=device, dtype=dt),
                requires_grad=cast(nn.Parameter, orig.bias).requires_grad,
            )
        self.device_hint = torch.device(device)
        self.track_rng = True  # set_rng: off when the model has no active dropout
        self.rng = RngRegions()  # set_rng: every layer of a model gets the model's one instance
        self.loaded = False  # fill_from / mark_loaded
        self.copy_share = None  # set by share_colwise_copies
        self.local_output = False  # local_columns (the vocab-parallel loss)
        object.__setattr__(self, "_adapter", None)  # set_adapter
        return self

    # ---- the adapter ----------------------------------------------------------------------------
    @property
    def adapter(self) -> Adapter | None:
        """This layer's adapter (set by `set_adapter`), or None."""
        return cast("Adapter | None", self.__dict__.get("_adapter"))

    @property
    def lora(self) -> LoraAdapter | None:
        """The adapter when it is a trainable `LoraAdapter` (what is saved, loaded, merged and
        trained), else None (no adapter, or a server's bank)."""
        ad = self.adapter
        return ad if isinstance(ad, LoraAdapter) else None

    def set_adapter(self, adapter: Adapter | None) -> None:
        """Attach, replace or (None) remove this layer's adapter: the one way a layer's adapter
        changes. The adapter is held hidden and its child modules become the layer's, under their
        own names (`lora_A`, `lora_B`, `lora_dropout`), so every parameter keeps PEFT's name; the
        previous adapter's children leave. Its A and B must be sharded as `lora_splits` says for
        this layer's style (`lora.attach_lora` makes such adapters).

        Example:
            >>> layer.set_adapter(layer.lora.retuned(scale=2.0, dropout=0.0))  # doctest: +SKIP
        """
        if adapter is not None and not self.kind.linear_like:
            raise LoraError(
                f"{self.fqn} is a {self.kind.name}; LoRA applies to linear layers only; remove it "
                f"from LoraConfig(targets=...)"
            )
        old = self.adapter
        if old is not None:
            for name in old._modules:
                self._modules.pop(name, None)
        object.__setattr__(self, "_adapter", adapter)
        if adapter is not None:
            for name, child in adapter.named_children():
                self.add_module(name, child)
            adapter.train(self.training)

    # ---- filling, ties, random regions ------------------------------------------------------------
    @torch.no_grad()
    def fill_from(self, orig: nn.Module) -> None:
        """Fill this rank's slices from `orig`, the module this layer replaces, when it holds
        values (not on meta); quantized weights are cut as stored where the format can. Sets
        `loaded`.

        Example:
            >>> m.fill_from(model.get_submodule(m.fqn))  # doctest: +SKIP
        """
        w = cast(torch.Tensor, orig.weight)
        self.loaded = w.device.type != "meta"
        if not self.loaded:
            return
        for name, sl in self.param_slices().items():
            t = getattr(orig, name)
            if name == "weight" and is_quantized_linear(orig):  # cut as stored where it can
                dim, ranges = sl if sl is not None else (None, None)
                self.fmt.cut_from(self.local, orig, dim, ranges, self.device_hint)
                self._sync_from_local()
                continue
            self.load_param(name, slice_dim(t.detach(), *sl) if sl is not None else t.detach())

    def write_local(self, write: Callable[[nn.Module], None]) -> None:
        """Let `write` fill the local module in place (a quantized format loading codes as they
        were stored), then register its parameters on the layer again.

        Example:
            >>> m.write_local(lambda local: fmt.load_state(local, cb, scb))  # doctest: +SKIP
        """
        write(self.local)
        self._sync_from_local()

    def mark_loaded(self) -> None:
        """Every base parameter was written (load_checkpoint says so)."""
        self.loaded = True

    def keep_buffers(self, orig: nn.Module, device: Any) -> None:
        """Keep every buffer of `orig` (the module this layer replaces): its names, their order
        and each one's persistence (a non-persistent buffer, like Gemma's embed_scale, stays out
        of the state dict). Buffers the local module holds are the layer's too (the same
        tensors); one the local module does not hold (a linear subclass whose forward is
        nn.Linear's) stays on the layer, moved to `device`; buffers only the local module has (a
        quantized format's scales) come last, as it registered them."""
        local = self.__dict__.get("local")
        held = local._buffers if local is not None else {}
        for name, b in orig._buffers.items():
            if name in held:  # the one the local module's forward reads
                self._buffers[name] = held[name]
            elif name not in self._buffers:
                self._buffers[name] = b if b is None or b.device.type == "meta" else b.to(device)
        own = local._non_persistent_buffers_set if local is not None else set()
        order = [*orig._buffers, *(n for n in self._buffers if n not in orig._buffers)]
        self._buffers = {n: self._buffers[n] for n in order}
        self._non_persistent_buffers_set = set(orig._non_persistent_buffers_set) | {
            n for n in own if n not in orig._buffers
        }

    def tie_weight(self, other: ShardedModule) -> None:
        """Hold `other`'s weight (the same Parameter): tied weights split alike stay one tensor."""
        self.local._parameters["weight"] = other.local._parameters["weight"]
        self._sync_from_local()

    def set_rng(self, rng: RngRegions, track: bool) -> None:
        """The model's one `RngRegions`, and whether this layer keeps dropout masks aligned over
        tp (apply_tp: only when the model has active dropout; the bookkeeping costs otherwise)."""
        self.rng, self.track_rng = rng, track

    @contextlib.contextmanager
    def local_columns(self) -> Iterator[None]:
        """Within it, a colwise_gather layer at tp > 1 hands back this rank's columns of its
        output, ungathered (the vocab-parallel loss reads them).

        Example:
            >>> with head.local_columns():  # doctest: +SKIP
            ...     z_local = head(h)
        """
        self.local_output = True
        try:
            yield
        finally:
            self.local_output = False

    # ---- parameters shared with the hidden local module --------------------------------------
    def _sync_from_local(self) -> None:
        """(Re-)register the local module's parameters on the wrapper under the same names."""
        for name, p in self.local._parameters.items():
            if name == "bias" and self.style in WRAPPER_BIAS_STYLES:
                continue
            self._parameters[name] = p
        for name, b in self.local._buffers.items():
            self._buffers[name] = b

    def __setattr__(self, name: str, value: Any) -> None:
        """Set as nn.Module does; a Parameter under a name the local module shares is set there
        too. FSDP2 swaps sharded and gathered parameters through setattr (this override makes it
        take that path), and the local module's forward must see the one it set."""
        _refuse_adapter_setattr(name)
        super().__setattr__(name, value)
        local = self.__dict__.get("local")
        if (
            local is not None
            and isinstance(value, nn.Parameter)
            and name in local._parameters
            and not (name == "bias" and self.style in WRAPPER_BIAS_STYLES)
        ):
            local._parameters[name] = value

    def _apply(self, fn, recurse=True):
        shared = [n for n in self._parameters if n in self.local._parameters]
        for n in shared:
            del self._parameters[n]
        super()._apply(fn, recurse)  # own params (rowwise bias) and children (LoRA)
        self.local._apply(fn)
        self._sync_from_local()
        if self.adapter is not None:  # its own tensors (a bank's); its children were done above
            self.adapter._apply(fn, recurse=False)
        return self

    def train(self, mode: bool = True):
        super().train(mode)
        self.local.train(mode)
        if self.adapter is not None:
            self.adapter.train(mode)
        return self

    # ---- slices: where each parameter comes from in the full (checkpoint-layout) tensor -------
    def param_slices(self) -> dict[str, tuple[int, Ranges] | None]:
        """For each base parameter name: (dim, ranges) of the full tensor it holds, or None (whole)."""
        k, st, r = self.kind, self.style, self.tp_rank
        out: dict[str, tuple[int, Ranges] | None] = {"weight": None}
        if self.has_bias:
            out["bias"] = None
        if st.is_colwise:
            assert self.split is not None, f"{self.fqn}: style {st} needs a split"
            out["weight"] = (k.w_out_dim, self.split.ranges(r))
            if self.has_bias and st == Style.COLWISE:
                out["bias"] = (0, self.split.ranges(r))
        elif st.splits_input:
            assert self.split is not None, f"{self.fqn}: style {st} needs a split"
            out["weight"] = (k.w_in_dim, self.split.ranges(r))
        return out

    def tp_splits(self) -> dict[str, tuple[int, FeatureSplit]]:
        """{local parameter name: (dim, split)} of this layer's parameters split over tp (its
        adapter's included)."""
        if self.split is None:
            return {}
        out: dict[str, Any] = {}
        for name, sl in self.param_slices().items():
            if sl is not None:
                out[name] = (sl[0], self.split)
        if self.lora is not None:
            out.update(lora_splits(self.style, self.split))
        return out

    def checkpoint_tensors(self, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """This rank's tensors in checkpoint layout (quantized weights dequantized), adapter
        included."""
        out: dict[str, torch.Tensor] = {}
        for name in self.param_slices():
            if name == "weight" and self.fmt is not None:
                w = self.fmt.dequantize(self.local)  # (out, in)
                out[name] = w.t() if self.kind.name == "Conv1D" else w
            else:
                p = self._parameters[name]
                assert p is not None, f"{self.fqn}.{name} is None"
                out[name] = p.detach()
        if (ad := self.lora) is not None:
            out["lora_A.weight"] = ad.lora_A.weight.detach()
            out["lora_B.weight"] = ad.lora_B.weight.detach()
        return out

    @property
    def has_bias(self) -> bool:
        return self._parameters.get("bias") is not None

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Shape of this rank's slice of base parameter `name`, in checkpoint layout."""
        if name == "bias":
            return (self.out_full if self.style in WRAPPER_BIAS_STYLES else self.out_local,)
        return self._weight_shape(self.in_local, self.out_local)

    def full_shape(self, name: str) -> tuple[int, ...]:
        """Full (unsharded) shape of base parameter `name`, in checkpoint layout."""
        if name == "bias":
            return (self.out_full,)
        return self._weight_shape(self.in_full, self.out_full)

    def _weight_shape(self, in_f: int, out_f: int) -> tuple[int, ...]:
        shape = [0, 0]
        shape[self.kind.w_out_dim] = out_f
        shape[self.kind.w_in_dim] = in_f
        if self.kind.name == "Conv2d":
            shape += list(cast(nn.Conv2d, self.local).kernel_size)
        return tuple(shape)

    @torch.no_grad()
    def load_param(self, name: str, value: torch.Tensor) -> None:
        """Set base parameter `name` from this rank's slice (checkpoint layout, any device/dtype)."""
        expected = self.local_shape(name)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{self.fqn}.{name}: got a slice of shape {tuple(value.shape)}, expected {expected} "
                f"(style {self.style}, tp rank {self.tp_rank}/{self.tp})"
            )
        device = self.device_hint
        if name == "weight" and self.fmt is not None:
            w = value.t() if self.kind.name == "Conv1D" else value  # quantized layout is (out, in)
            w = w.to(
                device=device, dtype=torch.float32 if device.type == "cpu" else self.float_dtype
            )
            self.fmt.quantize_into(self.local, w.contiguous())
            self._sync_from_local()
            return
        owner = self if (name == "bias" and self.style in WRAPPER_BIAS_STYLES) else self.local
        p = owner._parameters[name]
        assert p is not None, f"{self.fqn}.{name} is None"
        if p.device.type == "meta":
            new = nn.Parameter(
                value.to(device=device, dtype=self.float_dtype).clone(),
                requires_grad=p.requires_grad,
            )
            owner._parameters[name] = new
            self._sync_from_local()
        else:
            p.copy_(value.to(dtype=p.dtype))

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        st, g, tp = self.style, self.group, self.tp
        if st == Style.VOCAB:
            return self._vocab_forward(x)
        if st == Style.ROWWISE:
            return self._rowwise_forward(x, *args, **kwargs)
        # colwise / colwise_gather / replicate: the input is whole on every rank
        dev = self.device_hint
        rng = tp > 1 and self.track_rng and self.training  # dropout anywhere: keep masks aligned
        ad = self.adapter
        # the adapter's delta added inside the base layer's own launch (a 4-bit gemv), or None
        lr = self._low_rank(x) if ad is not None else None
        if lr is not None:
            kwargs = dict(kwargs, low_rank=lr)
            ad = None  # (its delta is in the base's output)
        # the adapter's whole delta another way (stacked sibling adapters, decoding), or None
        d = ad.shortcut(x) if ad is not None else None
        if ad is not None and d is None:
            if rng:  # x is whole: its dropout mask must be the same on every rank (RngRegions)
                with self.rng.replicated(dev):
                    xd = ad.drop(x)
            else:
                xd = ad.drop(x)
        if rng:  # the output is split: random draws from here on are this rank's own
            self.rng.enter(dev, self.tp_rank)
        y = self.local(copy_to_tp_once(x, g, self.copy_share) if tp > 1 else x, *args, **kwargs)
        if ad is not None:
            if d is None:
                # A is whole and sees the whole input, so its gradient is complete on every
                # rank; the copy-to-tp op sits after A, where the tensor is only r wide.
                a = ad.down(xd)  # (..., r)
                if tp > 1:
                    a = copy_to_tp(a, g)
                d = ad.up(a)  # B, times the scale
            y = y + d.to(y.dtype)  # (..., out_local)
        bias: torch.Tensor | None = (
            self._parameters.get("bias") if st == Style.COLWISE_GATHER else None
        )
        if st == Style.COLWISE_GATHER and tp > 1:
            assert self.split is not None  # tp > 1
            if self.local_output:  # this rank's columns only (a vocab-parallel loss reads them)
                if bias is not None:  # its slice (frozen: vocab_parallel_logits)
                    ((start, stop),) = self.split.ranges(self.tp_rank)
                    bias = bias[start:stop]
            else:
                y = gather_from_tp(y, self.kind.feat_dim, self.split.sizes(), self.tp_rank, g)
            if rng:
                self.rng.exit(dev)  # whole again (or handed to the loss, which draws nothing)
        if bias is not None:  # after the gather (or the rank's slice): on the feature dim
            shape = [1] * y.dim()
            shape[self.kind.feat_dim] = -1
            y = y + bias.view(shape).to(y.dtype)
        return y

    def _low_rank(self, x: torch.Tensor) -> Any:
        """The adapter's `lora.adapter.LowRank` when the base layer adds it to this input inside
        its own launch (`takes_low_rank`: a 4-bit layer whose gemv takes `x`), else None."""
        takes = getattr(self.local, "takes_low_rank", None)
        if takes is None or self.adapter is None or not takes(x):
            return None
        lr = self.adapter.low_rank()
        return lr if lr is not None and takes(x, lr) else None

    def _rowwise_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        g, tp, fd = self.group, self.tp, self.kind.feat_dim
        if x.shape[fd] != self.in_local:  # a replicated input: keep our part (grads gathered)
            assert self.split is not None  # in_local != in_full
            if not self.split.contiguous() or x.shape[fd] != self.in_full:
                raise ValueError(
                    f"{self.fqn}: rowwise input has {x.shape[fd]} features; expected this rank's "
                    f"{self.in_local} (or all {self.in_full})"
                )
            x = split_to_tp(x, fd, self.split.sizes(), self.tp_rank, g)
        rng = tp > 1 and self.track_rng and self.training
        if rng:  # x is split (its writer entered already when it was colwise)
            self.rng.enter(self.device_hint, self.tp_rank)
        y = self.local(x, *args, **kwargs)  # (..., out) partial sum over this rank's inputs
        a = None
        ad = self.adapter
        if ad is not None:
            a = ad.down(ad.drop(x))  # (..., r) partial
            if tp > 1:  # one all-reduce carries both partial sums
                both = reduce_from_tp(torch.cat([y, a.to(y.dtype)], dim=-1), g)
                y, a = both.split([y.shape[-1], a.shape[-1]], dim=-1)
                # a copy, not a view: lora_B saves its input for backward, and a view would keep
                # the whole (..., out + r) reduction buffer alive until then
                a = a.to(ad.dtype, copy=True)
        elif tp > 1:
            y = reduce_from_tp(y, g)
        if rng:  # y is whole again: back to the shared random stream
            self.rng.exit(self.device_hint)
        bias = self._parameters.get("bias")
        if bias is not None:
            shape = [1] * y.dim()
            shape[fd] = -1
            y = y + bias.view(shape).to(y.dtype)
        if a is not None:  # B is whole and sees the summed A output: complete gradients
            assert ad is not None  # a comes from it
            y = y + ad.up(a).to(y.dtype)
        return y

    def _vocab_forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.split is not None  # the vocab style always splits
        ((start, stop),) = self.split.ranges(self.tp_rank)
        outside = (ids < start) | (ids >= stop)
        local_ids = (ids - start).masked_fill(outside, 0)
        y = self.local(local_ids)  # (..., E); rows of other ranks' tokens are zeroed, then summed
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return reduce_from_tp(y, self.group) if self.tp > 1 else y

    def extra_repr(self) -> str:
        q = f", quant={self.fmt.name}" if self.fmt is not None else ""
        return (
            f"{self.kind.name}({self.in_full} -> {self.out_full}), style={self.style}, "
            f"local=({self.in_local} -> {self.out_local}), tp {self.tp_rank}/{self.tp}{q}"
        )


def _refuse_adapter_setattr(name: str) -> None:
    if name in ("adapter", "lora", "_adapter"):
        raise AttributeError(f"a layer's {name} is set by its set_adapter method only")


def _clear_shares(shares: list[CopyShare], module: nn.Module, args, output) -> None:
    for share in shares:
        share.clear()


def share_colwise_copies(model: nn.Module) -> int:
    """Give the colwise sharded children of one module that read inputs of one width over one tp
    group (q, k, v; gate, up) one CopyShare, emptied by a forward hook on that module (run also when
    its forward raises): eager and compiled blocks then all-reduce one gradient per block input.
    Call once per model (apply_tp does). Returns the number of shares.

    Example:
        >>> share_colwise_copies(model)  # doctest: +SKIP
        4
    """
    n = 0
    for parent in model.modules():
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
            continue  # never called: nothing would empty its share
        siblings: dict[tuple[object, int], list[ShardedModule]] = {}
        for child in parent.children():
            if isinstance(child, ShardedModule) and child.tp > 1 and child.style.is_colwise:
                siblings.setdefault((child.group, child.in_full), []).append(child)
        shares = []
        for members in siblings.values():
            if len(members) > 1:
                share = CopyShare()
                for m in members:
                    m.copy_share = share
                shares.append(share)
        if shares:
            parent.register_forward_hook(functools.partial(_clear_shares, shares), always_call=True)
            n += len(shares)
    return n


def sharded_modules(model: nn.Module) -> dict[str, ShardedModule]:
    """{fqn: ShardedModule} of `model`, in model order: the one listing of sharded modules.

    Example:
        >>> list(sharded_modules(model))[:1]  # doctest: +SKIP
        ['model.layers.0.self_attn.q_proj']
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, ShardedModule)}


def inside_sharded(name: str, sharded: Mapping[str, ShardedModule]) -> bool:
    """True when the module or tensor `name` is one of `sharded` (from `sharded_modules`) or belongs
    to one (its own parameters, or its LoRA children's).

    Example:
        >>> inside_sharded("model.q_proj.lora_A.weight", {"model.q_proj": q})  # doctest: +SKIP
        True
    """
    parts = name.split(".") if name else []
    return any(".".join(parts[:i]) in sharded for i in range(len(parts), -1, -1))
