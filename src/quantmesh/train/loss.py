"""Causal-LM loss without the whole logits: the head and cross-entropy run one chunk of tokens at a
time, so at most `chunk_tokens` rows of fp32 logits exist at once. A frozen head (no parameter
that needs a gradient: the usual LoRA run) has each chunk's gradient with respect to its hidden
states made in the forward, right after the chunk's loss, and kept (the size of the hidden states
the recompute would keep): backward only scales it, with no second pass through the head. A head
that trains, or one split over tp, recomputes each chunk in backward instead. A head split over
tp (colwise_gather) is not gathered: each rank computes the loss from its own columns
(tp/cross_entropy.py), so a rank holds chunk_tokens x V / tp logits.

The model's own forward runs with its output head swapped for a pass-through (its root forward and
every hook stay in place: DDP's, the tp RNG regions'), which hands back the final hidden states; the
head is then applied chunk by chunk. A model whose forward does more to the logits after its head
(Gemma 2's final soft-capping, a logit scale) would come out wrong that way, so the first call on a
model compares the chunked loss with the plain one on the same batch and, when they differ, falls
back to the plain loss for good and warns once: never a silently different loss. The check runs
on a prefix of the batch's first row no longer than one chunk, so it never holds more logits than a
chunk either (a check on the whole batch would itself hold them all: at 65,536 tokens and a
32,000-word vocabulary that is 7.8 GiB of fp32 logits).

Example:
    >>> total, n = chunked_loss_sum(model, ids, labels, chunk_tokens=1024)  # doctest: +SKIP
    >>> (total / n).backward()                                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..tp.cross_entropy import splits_vocab, vocab_parallel_cross_entropy, vocab_parallel_logits
from .data import IGNORE_INDEX

__all__ = ["chunked_loss_sum", "plain_loss_sum", "IGNORE_INDEX"]

_CHECKED = "_quantmesh_chunked_loss"  # model.__dict__: True (exact), False (fell back)
TOLERANCE = 1e-4


class _PassThrough(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@contextlib.contextmanager
def _headless(model: nn.Module) -> Iterator[nn.Module]:
    """The model with its output head replaced by a pass-through; yields the head."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    owner, name = next((m, n) for m in model.modules() for n, c in m.named_children() if c is head)
    owner._modules[name] = _PassThrough()
    try:
        yield head
    finally:
        owner._modules[name] = head


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """The next-token targets: position t predicts labels[t + 1]; the last position predicts none."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)


def plain_loss_sum(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over labelled tokens, their count), from the whole logits.

    Example:
        >>> total, n = plain_loss_sum(model, ids, ids)  # doctest: +SKIP
    """
    target = _targets(labels)
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    total = F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, int((target != IGNORE_INDEX).sum())


def _chunk_ce(head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if splits_vocab(head):  # each tp rank its own columns: (n, V / tp), no gather
        with vocab_parallel_logits(head) as (start, group):
            z = head(h).float()
        return vocab_parallel_cross_entropy(z, t, start, group)
    return F.cross_entropy(head(h).float(), t, reduction="sum")  # (n, V) lives only here


class _FrozenHeadLoss(torch.autograd.Function):
    """The summed cross-entropy of a frozen head's logits, chunk by chunk, its gradient with
    respect to the hidden states made in the forward: one pass through the head, not two."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        t: torch.Tensor,
        head: nn.Module,
        chunk_tokens: int,
    ) -> torch.Tensor:
        total = h.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(h)
        for s in range(0, h.shape[0], chunk_tokens):
            with torch.enable_grad():
                x = h[s : s + chunk_tokens].detach().requires_grad_()
                loss = F.cross_entropy(head(x).float(), t[s : s + chunk_tokens], reduction="sum")
                (grad[s : s + chunk_tokens],) = torch.autograd.grad(loss, x)
            total += loss.detach()
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * g.to(grad.dtype), None, None, None


def _frozen(head: nn.Module) -> bool:
    """A head whose own parameters need no gradient, and which is not split over tp."""
    return not splits_vocab(head) and not any(p.requires_grad for p in head.parameters())


def _chunked(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, int]:
    target = _targets(labels).reshape(-1)  # (B*T,)
    with _headless(model) as head:
        hidden = model(input_ids=input_ids, use_cache=False).logits  # (B, T, H): hidden states
    keep = (target != IGNORE_INDEX).nonzero().squeeze(1)  # labelled positions only
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (n, H)
    t = target.index_select(0, keep)
    if h.requires_grad and _frozen(head):
        return _FrozenHeadLoss.apply(h, t, head, chunk_tokens), int(keep.numel())
    if h.shape[0] == 0:
        # no labelled token (a packed example of prompt tokens alone): zero, but in the graph,
        # so that backward runs on every rank as on the others (DDP's reduction, tp's
        # collectives) and adds zero gradients
        return h.float().sum(), 0
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk_tokens):
        total = total + checkpoint(
            _chunk_ce, head, h[s : s + chunk_tokens], t[s : s + chunk_tokens], use_reentrant=False
        )
    return total, int(keep.numel())


def chunked_loss_sum(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, int]:
    """Like `plain_loss_sum`, holding at most `chunk_tokens` rows of logits at any time.

    The first call on a model checks it against `plain_loss_sum` on a prefix of the batch (the
    first row's first `chunk_tokens` tokens, split in two chunks: two extra forwards in eval mode,
    no backward, the random streams untouched, never more logits than one chunk); a model whose
    logits are more than its head's output falls back to the plain loss, with a warning.

    Example:
        >>> total, n = chunked_loss_sum(model, ids, labels, chunk_tokens=512)  # doctest: +SKIP
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}; expected >= 1")
    ok = model.__dict__.get(_CHECKED)
    if ok is None:  # dropout off, nothing drawn from the random streams, no gradient
        was_training = model.training
        devices = [input_ids.device.index or 0] if input_ids.device.type == "cuda" else []
        # the targets do not matter to the check (it compares two ways to the same logits), so
        # the prefix's own tokens serve: a prefix whose labels are all ignored still checks
        ids = input_ids[:1, : max(2, chunk_tokens)]  # (1, n): at most one chunk of logits
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            model.eval()
            try:
                want, _ = plain_loss_sum(model, ids, ids)
                got, _ = _chunked(model, ids, ids, max(1, (ids.shape[1] + 1) // 2))
            finally:
                model.train(was_training)
        ok = bool(((got - want).abs() <= TOLERANCE * want.abs().clamp_min(1.0)).item())
        model.__dict__[_CHECKED] = ok
        if not ok:
            warnings.warn(
                f"quantmesh: {type(model).__name__}'s logits are more than its output head's "
                f"output (chunked loss {got.item():.6g} vs {want.item():.6g}); using the plain "
                "loss, which holds the whole logits",
                stacklevel=2,
            )
    if not ok:
        return plain_loss_sum(model, input_ids, labels)
    return _chunked(model, input_ids, labels, chunk_tokens)
