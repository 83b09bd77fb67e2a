"""Vocab-parallel cross-entropy: the loss from each tp rank's own columns of the logits.

An LM head split over tp (style colwise_gather) computes V / tp columns of the logits per rank and
gathers them before the loss. For a loss sum, the gather is not needed: with `m` the row maximum,
`S` the sum of exp(z - m) and `z_t` the target's logit, each taken over every rank's columns by
one all-reduce,

    loss_i = log S_i + m_i - z_{i, t_i}

and its gradient for this rank's columns is softmax(z)_ij - [j == t_i], computed from this rank's
columns alone (no collective in backward). Each rank then holds n x V / tp logits instead of n x V,
and three all-reduces of n numbers replace an all-gather of n x V (Megatron-LM's formulation).

Example:
    >>> with vocab_parallel_logits(head) as (start, group):         # doctest: +SKIP
    ...     z = head(h).float()                                     # (n, V_local)
    >>> loss = vocab_parallel_cross_entropy(z, targets, start, group)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..plan.styles import Style

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_logits", "splits_vocab"]


def splits_vocab(head: nn.Module) -> bool:
    """Whether `head` is a tp-split LM head whose loss can be computed from each rank's columns:
    colwise_gather at tp > 1, one contiguous range per rank, and no trainable bias (a trainable
    bias's gradient would need summing over the ranks' slices).

    Example:
        >>> splits_vocab(model.get_output_embeddings())  # doctest: +SKIP
        True
    """
    from .layers import ShardedModule

    if not (isinstance(head, ShardedModule) and head.style == Style.COLWISE_GATHER):
        return False
    if head.tp < 2 or head.split is None or not head.split.contiguous():
        return False
    bias = head._parameters.get("bias")
    return bias is None or not bias.requires_grad


@contextlib.contextmanager
def vocab_parallel_logits(head: nn.Module) -> Iterator[tuple[int, Any]]:
    """Within it, `head` (`splits_vocab`) returns this rank's columns of the logits, ungathered;
    yields (index of this rank's first column, the tp group).

    Example:
        >>> with vocab_parallel_logits(head) as (start, group):  # doctest: +SKIP
        ...     z_local = head(h)
    """
    from .layers import ShardedModule

    assert isinstance(head, ShardedModule) and head.split is not None and splits_vocab(head)
    ((start, _),) = head.split.ranges(head.tp_rank)
    with head.local_columns():
        yield start, head.group


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, z: torch.Tensor, target: torch.Tensor, start: int, group: Any
    ) -> torch.Tensor:
        n, width = z.shape  # (n, V_local): this rank's columns start .. start + width
        m = _all_reduce(z.detach().amax(dim=1), dist.ReduceOp.MAX, group)  # (n,)
        p = (z.detach() - m[:, None]).exp_()  # (n, V_local), becomes the softmax below
        s = _all_reduce(p.sum(dim=1), dist.ReduceOp.SUM, group)  # (n,)
        local = target - start
        mine = (local >= 0) & (local < width)  # rows whose target is one of our columns
        picked = z.detach().gather(1, local.clamp(0, width - 1)[:, None]).squeeze(1)
        zt = _all_reduce(torch.where(mine, picked, 0.0), dist.ReduceOp.SUM, group)  # (n,)
        p.div_(s[:, None])
        ctx.save_for_backward(p, local, mine)
        return (s.log() + m - zt).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        p, local, mine = ctx.saved_tensors
        rows = mine.nonzero().squeeze(1)
        g = p.clone()
        g[rows, local[rows]] -= 1.0
        return g.mul_(grad), None, None, None


def vocab_parallel_cross_entropy(
    z: torch.Tensor, target: torch.Tensor, start: int, group: Any
) -> torch.Tensor:
    """Summed cross-entropy of rows `z` (n, V_local: this rank's logits, columns start ..) against
    `target` (n,) (vocabulary ids, none ignored), over the whole vocabulary of the tp `group`.
    Every rank of the group must call it with its own columns and the same targets.

    Example:
        >>> vocab_parallel_cross_entropy(z_local.float(), t, start, head.group)  # doctest: +SKIP
        tensor(412.7, grad_fn=<_VocabParallelCEBackward>)
    """
    if z.dim() != 2 or target.shape != z.shape[:1]:
        raise ValueError(f"expected z (n, V_local) and target (n,); got {tuple(z.shape)} and "
                         f"{tuple(target.shape)}")  # fmt: skip
    return _VocabParallelCE.apply(z, target, start, group)
