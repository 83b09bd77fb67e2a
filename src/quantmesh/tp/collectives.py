"""Autograd-aware collectives over the tp group (Megatron's f / g pair and friends).

copy_to_tp:    forward identity,              backward all-reduce   (input of a colwise layer)
reduce_from_tp: forward all-reduce,            backward identity     (output of a rowwise layer)
gather_from_tp: forward all-gather along dim,  backward keep own part (gathered colwise output)
split_to_tp:   forward keep own part,         backward all-gather   (full input into a rowwise layer)

Uneven shards are legal (9 heads on 2 ranks): gathers pad every part to the largest and trim, because
gloo has no uneven all_gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "all_gather_uneven",
    "copy_to_tp",
    "copy_to_tp_once",
    "CopyShare",
    "reduce_from_tp",
    "gather_from_tp",
    "split_to_tp",
]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # A functional collective (no mutation): torch 2.11 traced the in-place form inside our
        # autograd Functions but dropped their gradients (the compiled blocks' adapters got none).
        return funcol.all_reduce(t.contiguous(), "sum", group)
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def all_gather_uneven(t: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`; rank i contributes sizes[i] entries there."""
    dim = dim % t.dim()
    width = max(sizes)
    if t.shape[dim] < width:  # pad to the largest part (gloo needs equal shapes)
        pad_shape = list(t.shape)
        pad_shape[dim] = width - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


def _own_part(t: torch.Tensor, dim: int, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t.narrow(dim, start, sizes[rank]).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, rank, group):
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, rank
        return all_gather_uneven(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _own_part(g, ctx.dim, ctx.sizes, ctx.rank), None, None, None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, rank, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _own_part(x, dim, sizes, rank)

    @staticmethod
    def backward(ctx, g):
        return all_gather_uneven(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `group` backward.

    Example:
        >>> y = local_linear(copy_to_tp(x, mesh.tp_group))  # doctest: +SKIP
    """
    return _CopyToTP.apply(x, group)


class CopyShare:
    """One copy_to_tp of a block input for sibling colwise layers (q, k, v; gate, up).

    Autograd then sums the siblings' input gradients *before* one all-reduce instead of
    all-reducing each layer's gradient of x: 1 collective per block input instead of 3 (attention)
    or 2 (gated MLP). apply_tp gives the colwise sharded children of one parent module that share a
    tp group and an input width one CopyShare, and the parent a forward hook that empties it. Within
    the parent's forward the first sibling copies its input and keeps (input, copy) here; a sibling
    given the very same tensor reuses the copy (dynamo traces `is` on tensors, so eager and compiled
    blocks issue the same collectives). Only colwise layers of one group meet here, so a replicated
    reader of the tensor keeps its own gradient. Emptied at the end of the parent's forward (also
    when it raises), it holds no tensor between forwards: a compiled block starts and ends with an
    empty share (no extra graph inputs or outputs, no guard on a stale tensor).
    """

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def copy(self, x: torch.Tensor, group) -> torch.Tensor:
        if self.x is x:
            assert self.y is not None  # set with x
            return self.y
        y = copy_to_tp(x, group)
        self.x, self.y = x, y
        return y

    def clear(self) -> None:
        self.x = self.y = None


def copy_to_tp_once(x: torch.Tensor, group, share: CopyShare | None = None) -> torch.Tensor:
    """copy_to_tp, shared through `share` by every colwise sibling that reads the same tensor.

    Example:
        >>> s = CopyShare()                                                       # doctest: +SKIP
        >>> copy_to_tp_once(x, g, s) is copy_to_tp_once(x, g, s)                  # doctest: +SKIP
        True
    """
    if not x.requires_grad:
        return x  # no gradient to reduce
    return copy_to_tp(x, group) if share is None else share.copy(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over `group` forward; gradient passed through unchanged backward.

    Example:
        >>> y = reduce_from_tp(local_linear(x_shard), mesh.tp_group)  # doctest: +SKIP
    """
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, dim: int, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Concatenate the ranks' shards along `dim` (rank i holds sizes[i]); backward keeps own part.

    Example:
        >>> logits = gather_from_tp(local_logits, -1, [24576, 24576], mesh.tp_rank, mesh.tp_group)  # doctest: +SKIP
    """
    return _GatherFromTP.apply(x, dim, list(sizes), rank, group)


def split_to_tp(x: torch.Tensor, dim: int, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Keep this rank's contiguous part of a replicated `x` along `dim`; backward all-gathers.

    Example:
        >>> x_shard = split_to_tp(x, -1, [288, 288], mesh.tp_rank, mesh.tp_group)  # doctest: +SKIP
    """
    return _SplitToTP.apply(x, dim, list(sizes), rank, group)
