"""Module kinds the parallel layers know: where each one keeps its input and output features.

A kind maps the feature-space split of a style onto parameter dimensions, and builds an empty local
module of the same kind with fewer features. Quantization applies to linear-like kinds only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..quant.kinds import is_conv1d, is_quantized_linear, not_a_linear

__all__ = ["ExpertTensor", "Kind", "expert_tensors", "kind_of"]


@dataclass(frozen=True)
class Kind:
    name: str
    w_out_dim: int  # dim of `weight` holding output features
    w_in_dim: int  # dim of `weight` holding input features
    feat_dim: int  # dim of the activations holding features (-1 for linears, 1 for conv2d)
    linear_like: bool  # y = x W^T + b, possibly with a transposed weight; quantizable

    def in_out(self, module: nn.Module) -> tuple[int, int]:
        if self.linear_like and is_quantized_linear(module):  # a packed weight: not (out, in)
            return int(cast(Any, module).in_features), int(cast(Any, module).out_features)
        w = cast(torch.Tensor, module.weight)  # every Kind's module has a weight
        return int(w.shape[self.w_in_dim]), int(w.shape[self.w_out_dim])


LINEAR = Kind("Linear", 0, 1, -1, True)
CONV1D = Kind("Conv1D", 1, 0, -1, True)  # transformers' GPT-2 Conv1D: weight (in, out)
EMBEDDING = Kind("Embedding", 1, 0, -1, False)  # rows: vocabulary ("in"), cols: features ("out")
CONV2D = Kind("Conv2d", 0, 1, 1, False)


def kind_of(module: nn.Module) -> Kind | None:
    """The Kind of `module`, or None when quantmesh cannot shard it (it is then replicated): an
    nn.Linear subclass whose own forward is not a linear's (`not_a_linear`) has none."""
    if is_quantized_linear(module):
        return LINEAR
    if isinstance(module, nn.Linear):
        return LINEAR if not_a_linear(module) is None else None
    if is_conv1d(module):
        return CONV1D
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return CONV2D
    return None


@dataclass(frozen=True)
class ExpertTensor:
    """One 3-D expert weight of an experts module: its dims and how it splits over tp."""

    name: str  # the parameter's name on the module ("gate_up_proj", "down_proj")
    first: bool  # the projection that reads the hidden state (its output is the intermediate)
    in_dim: int  # dim of the (E, ., .) tensor holding input features
    out_dim: int  # dim holding output features
    bias: str | None  # name of its per-expert bias (E, out), if the module has one

    @property
    def split_dim(self) -> int:
        """The dim of the weight cut over tp: the intermediate features."""
        return self.out_dim if self.first else self.in_dim


def expert_tensors(module: nn.Module) -> list[ExpertTensor] | None:
    """The expert weights of a transformers experts module, or None when `module` is not one.

    An experts module declares its layout the way transformers' experts interface reads it:
    `num_experts`, `is_transposed` and `has_gate` attributes and 3-D parameters named
    `gate_up_proj` (or `up_proj` without a gate) and `down_proj`, each (E, ., .), with
    `<name>_bias` (E, out) where `has_bias`. A module with `num_experts` and those two tensors
    but no `is_transposed` (Llama 4's experts: (E, H, 2I) and (E, I, H), read by `bmm`) is
    transposed where the shapes say so: the hidden size on the inner dim of both, the first's
    other dim twice the second's.

    Example:
        >>> [t.name for t in expert_tensors(model.model.layers[0].mlp.experts)]  # doctest: +SKIP
        ['gate_up_proj', 'down_proj']
    """
    transposed = getattr(module, "is_transposed", None)
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or not (transposed is None or isinstance(transposed, bool)):
        return None
    gated = bool(getattr(module, "has_gate", True))
    names = ("gate_up_proj" if gated else "up_proj", "down_proj")
    params = module._parameters
    if any(not isinstance(params.get(k), torch.Tensor) for k in names):
        return None
    w1, w2 = (cast(torch.Tensor, params[k]) for k in names)
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != n or w2.shape[0] != n:
        return None
    if transposed is None:  # undeclared: (E, H, 2I) and (E, I, H) only
        ratio = 2 if gated else 1
        if not (w1.shape[1] == w2.shape[2] and w1.shape[2] == ratio * w2.shape[1]):
            return None
        transposed = True
    i_dim, o_dim = (1, 2) if transposed else (2, 1)
    hidden, inter = int(w1.shape[i_dim]), int(w2.shape[i_dim])
    if int(w2.shape[o_dim]) != hidden or int(w1.shape[o_dim]) != (2 * inter if gated else inter):
        return None
    out = []
    for k, first in zip(names, (True, False), strict=True):
        b = f"{k}_bias"
        has_b = isinstance(params.get(b), torch.Tensor)
        out.append(ExpertTensor(k, first, i_dim, o_dim, b if has_b else None))
    return out


class Conv1DNoBias(nn.Module):
    """transformers' Conv1D layout without a bias: weight (in, out), y = x @ weight.

    The local module of a rowwise Conv1D: its bias is added once, after the reduction, by the
    wrapper, and transformers' own Conv1D cannot drop it (its forward is addmm(bias, x, weight)).
    """

    def __init__(self, in_f: int, out_f: int, *, device=None, dtype=None):
        super().__init__()
        self.nx, self.nf = in_f, out_f
        self.weight = nn.Parameter(torch.empty(in_f, out_f, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # (..., in) @ (in, out) -> (..., out)


def new_local(
    kind: Kind, orig: nn.Module, in_f: int, out_f: int, bias: bool, device, dtype
) -> nn.Module:
    """An empty module of `orig`'s kind with `in_f` -> `out_f` features, on `device` (uninitialized).

    A subclass of nn.Linear or nn.Embedding with a forward of its own (Gemma's embedding scales its
    output by sqrt(hidden)) keeps its class and its forward: the local module is a copy of `orig`
    holding the local shard, so the model's own code runs on it.
    """
    base: type[nn.Module] | None = {LINEAR: nn.Linear, EMBEDDING: nn.Embedding}.get(kind)
    if base is not None and type(orig) is not base and type(orig).forward is not base.forward:
        return _own_class_copy(orig, in_f, out_f, bias, device, dtype)
    if kind is LINEAR:
        return nn.Linear(in_f, out_f, bias=bias, device=device, dtype=dtype)
    if kind is CONV1D:
        if not bias:  # transformers' Conv1D.forward always adds its bias (addmm): use our own
            return Conv1DNoBias(in_f, out_f, device=device, dtype=dtype)
        with torch.device(device):
            m = type(orig)(out_f, in_f)  # Conv1D(nf, nx)
        return m.to(dtype)
    if kind is EMBEDDING:
        return nn.Embedding(in_f, out_f, device=device, dtype=dtype)
    if kind is CONV2D:
        conv: Any = orig  # an nn.Conv2d; its attributes are typed wider than its arguments
        return nn.Conv2d(
            in_f,
            out_f,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            1,
            bias,
            conv.padding_mode,
            device=device,
            dtype=dtype,
        )
    raise AssertionError(kind)


def _own_class_copy(
    orig: nn.Module, in_f: int, out_f: int, bias: bool, device: Any, dtype: torch.dtype
) -> nn.Module:
    """A shallow copy of `orig` with fresh (uninitialized) weight and bias of the local shape."""
    local: Any = copy.copy(orig)  # the original's class, attributes set below
    local._parameters = dict(orig._parameters)
    local._buffers = {k: (None if b is None else b.to(device)) for k, b in orig._buffers.items()}
    local._modules = dict(orig._modules)
    local._forward_hooks = type(orig._forward_hooks)()  # hooks belong to the wrapper's position
    local._forward_pre_hooks = type(orig._forward_pre_hooks)()
    if isinstance(orig, nn.Embedding):
        shape: tuple[int, ...] = (in_f, out_f)
        local.num_embeddings, local.embedding_dim = in_f, out_f
    else:
        shape = (out_f, in_f)
        local.in_features, local.out_features = in_f, out_f
    local.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    if "bias" in local._parameters:
        local.bias = nn.Parameter(torch.empty(out_f, device=device, dtype=dtype)) if bias else None
    return local
