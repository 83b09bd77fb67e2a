"""Prototype: cross-entropy over vocabulary-sharded logits, without gathering them.

With the output head split colwise over tp ranks, every rank holds logits (N, V/tp) for all N
tokens. quantmesh's default plan gathers them ("colwise_gather": an all-gather of N*V values,
then the full N*V softmax in fp32 on every rank, computed tp times over). Here each rank works on
its own columns only, and two all-reduces of N floats (max; then target logit and sum, stacked)
stitch the result together:

    m     = max_v logits                      (all-reduce MAX;  for numerical stability)
    z_t   = logits[target] - m                (all-reduce SUM;  only the owner of the target adds)
    s     = sum_v exp(logits - m)             (all-reduce SUM)
    loss  = log(s) - z_t
    dloss/dlogits_v = softmax_v - [v == target]    (local: this rank's columns only)

Memory per rank: one fp32 (N, V/tp) softmax saved for backward instead of (N, V) logits and
their (N, V) gradient. Communication: 3 * N * 4 bytes instead of an N * V all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group, ignore_index):
        # logits (N, V_local) any float dtype; target (N,) int64 in the full vocabulary
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
        n, v_local = x.shape
        m = x.max(dim=-1).values  # (N,)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        valid = target != ignore_index
        mine = (target >= start) & (target < start + v_local) & valid
        idx = (target - start).clamp(0, v_local - 1)  # (N,) column of the target, where mine
        z_t = x.gather(1, idx.unsqueeze(-1)).squeeze(-1) * mine
        e = x.exp_()  # (N, V_local), in place on the fp32 copy
        s = e.sum(dim=-1)
        if group is not None:
            both = torch.stack([z_t, s])  # one all-reduce for both (2, N)
            dist.all_reduce(both, group=group)
            z_t, s = both[0], both[1]
        loss = (s.log() - z_t) * valid
        e.div_(s.unsqueeze(-1))  # softmax of this rank's columns
        ctx.save_for_backward(e, idx, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine, valid = ctx.saved_tensors
        g = g * valid
        grad = softmax.mul_(g.unsqueeze(-1))  # softmax is not needed after this
        grad.scatter_add_(1, idx.unsqueeze(-1), (-g * mine).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group=None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean token cross-entropy of logits split on the vocabulary over `group`.

    `local_logits` (..., V_local) holds vocabulary columns [vocab_start, vocab_start + V_local) of
    the full logits; `target` (...) holds ids in the full vocabulary. Every rank returns the same
    loss. With group=None it is an ordinary cross-entropy (one rank holding everything).

    Example:
        >>> logits = torch.randn(6, 10, requires_grad=True)
        >>> t = torch.randint(0, 10, (6,))
        >>> a = vocab_parallel_cross_entropy(logits, t, 0)
        >>> b = torch.nn.functional.cross_entropy(logits, t)
        >>> bool(torch.allclose(a, b))
        True
    """
    v_local = local_logits.shape[-1]
    flat = local_logits.reshape(-1, v_local)
    tgt = target.reshape(-1)
    per_token = _VocabParallelCE.apply(flat, tgt, vocab_start, group, ignore_index)
    count = (tgt != ignore_index).sum().clamp(min=1)
    return per_token.sum() / count
