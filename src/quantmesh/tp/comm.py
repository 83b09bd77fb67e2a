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

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "split_to_tp"]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def _all_gather(t: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`; rank i contributes sizes[i] entries there."""
    dim = dim % t.dim()
    width = max(sizes)
    if t.shape[dim] < width:  # pad to the largest part (gloo needs equal shapes)
        pad_shape = list(t.shape)
        pad_shape[dim] = width - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


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
        return _all_gather(x, dim, sizes, group)

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
        return _all_gather(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `group` backward.

    Example:
        >>> y = local_linear(copy_to_tp(x, mesh.tp_group))  # doctest: +SKIP
    """
    return _CopyToTP.apply(x, group)


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
