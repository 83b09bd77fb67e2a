"""One training step for every layout: `loss = qm.train_step(model, batch, microbatches=M)`.

The training loop (`train/loop.py`) runs every optimizer step through it, at every pp; it is also
public for a loop of one's own. Forward and backward of one global batch, split into M
micro-batches; the optimizer step stays the caller's. The loss is the mean next-token
cross-entropy over every labelled target of the global batch (all micro-batches, all dp
replicas), returned on every rank; each micro-batch's summed loss is divided by that global count,
so any (dp, pp, tp, M) split of one batch gives the same gradient.

The count is of targets, not of labels: position t is trained to predict labels[t + 1], so a row
of T labels has at most T - 1 targets, and a row's first label is never one (no position comes
before it). The count is `(causal_lm_targets(labels) != -100).sum()`, the same positions the
cross-entropy sums over; counting `labels != -100` would also count each row's first label and
make every loss (and gradient) slightly too small.

- pp = 1: plain gradient accumulation; non-final micro-batches run under `qm.no_sync` (the dp
  all-reduce of DDP happens once), and the loss is scaled by dp for DDP's average. With
  `chunk_tokens` > 0 the loss is the chunked one (`train/loss.py`: the head and cross-entropy a
  chunk of tokens at a time, never the whole logits); on CUDA the forward runs under bf16 autocast.
- pp > 1: `torch.distributed.pipelining` runs the micro-batches through a `PipelineStage` of this
  rank's `StageModule` with the chosen schedule (GPipe or 1F1B). The last stage computes the loss;
  it is broadcast over the pp group. Over dp, whole pipelines are replicas: after the schedule the
  trainable gradients are summed over the dp group in one flat all-reduce (what DDP does at the end
  of a no_sync accumulation; DDP itself cannot hook a module that runs forward M times before any
  backward).

Example:
    >>> loss = qm.train_step(model, {"input_ids": ids, "labels": ids}, microbatches=4)  # doctest: +SKIP
    >>> opt.step(); opt.zero_grad()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..blocks.compile import replays_cuda_graphs
from ..config import TrainError, check_pp_schedule
from ..parallel.state import parallel_state
from ..pipeline.cut import PipelineError
from ..pipeline.schedule import PipelineRuntime, causal_lm_targets, ce_sum, leak_error
from ..pipeline.stage import call_model, logits_of
from .data import IGNORE_INDEX
from .loss import chunked_loss_sum

__all__ = ["TrainError", "autocast", "eval_loss_sum", "train_step"]


def autocast(device: torch.device) -> Any:
    """The forward's precision policy: bf16 autocast on CUDA (the adapters stay fp32, the matmuls
    run in bf16), fp32 throughout on CPU.

    Example:
        >>> with autocast(torch.device("cpu")):
        ...     pass
    """
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _check(batch: Any, microbatches: int, schedule: str, pp: int) -> None:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TrainError(
            "train_step needs batch={'input_ids': (B, T) ids, 'labels': (B, T) ids (optional, "
            "-100 = ignored)}"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise TrainError(f"microbatches={microbatches!r}; use a positive int")
    b = batch["input_ids"].shape[0]
    if b % microbatches:
        raise TrainError(
            f"batch of {b} rows does not split into microbatches={microbatches} equal parts; use "
            f"a batch size that is a multiple of the micro-batch count"
        )
    check_pp_schedule(schedule, pp=pp, microbatches=microbatches)


def train_step(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    microbatches: int = 1,
    schedule: str = "1f1b",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """Forward + backward of one global batch; returns the mean loss of the global batch on every
    rank (a detached 0-d fp32 tensor). Gradients accumulate into `.grad`; step and zero them.

    Args:
        batch: {"input_ids": (B, T), "labels": (B, T)} (labels default to the ids; -100 = ignored).
            Every rank of one dp replica passes the same batch; dp replicas pass their own.
        microbatches: M; B must be a multiple of M.
        schedule: at pp > 1, "1f1b" (M >= pp) or "gpipe" with one stage per rank,
            "interleaved1f1b" with several (PipelineConfig(virtual=...)); ignored at pp = 1.
        loss_fn: pp = 1 only: (logits, labels) -> summed loss; default next-token cross-entropy.
        chunk_tokens: pp = 1 only: > 0 computes the default loss chunk by chunk
            (`chunked_loss_sum`, at most this many rows of logits at once); 0 = from the whole
            logits, which the pipelined step's last stage always uses.

    Example:
        >>> loss = qm.train_step(model, batch, microbatches=8, schedule="1f1b")  # doctest: +SKIP
    """
    st = parallel_state(model, required=False)
    mesh = st.mesh if st is not None else None
    pp = mesh.pp if mesh is not None else 1
    _check(batch, microbatches, schedule, pp)
    if pp > 1 and loss_fn is not None:
        raise TrainError("loss_fn is not supported at pp > 1 yet; use the default causal-LM loss")
    if loss_fn is not None and chunk_tokens:
        raise TrainError(
            f"loss_fn and chunk_tokens={chunk_tokens} together: the chunked loss is the default "
            "causal-LM loss; pass one of them"
        )
    if chunk_tokens < 0:
        raise TrainError(f"chunk_tokens={chunk_tokens}; expected >= 0 (0 = the whole logits)")
    if pp > 1 and chunk_tokens:
        raise TrainError(
            f"chunk_tokens={chunk_tokens} at pp={pp}: the pipeline's last stage computes the loss "
            "from the whole logits (the chunked loss is not pipelined yet); pass 0"
        )
    device = mesh.device if mesh is not None else next(model.parameters()).device
    ids = batch["input_ids"].to(device)  # (B, T)
    labels = batch.get("labels", batch["input_ids"]).to(device)  # (B, T)
    # the global label count: the divisor of every micro-batch's summed loss
    count = (causal_lm_targets(labels) != IGNORE_INDEX).sum().to(torch.float64)
    if mesh is not None and mesh.dp > 1:
        dist.all_reduce(count, group=mesh.dp_group)
    count = count.clamp_min(1.0).to(torch.float32)
    if pp > 1:
        assert st is not None and st.pipeline is not None  # parallelize built it at pp > 1
        loss = _pipelined(st.pipeline, mesh, ids, labels, count, microbatches, schedule)
    else:
        loss_sum = _loss_sum(loss_fn, chunk_tokens)
        loss = _accumulated(model, ids, labels, count, microbatches, loss_sum, st)
    if mesh is not None and mesh.dp > 1:
        dist.all_reduce(loss, group=mesh.dp_group)
    return loss


LossSum = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _loss_sum(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, chunk_tokens: int
) -> LossSum:
    """(model, ids, labels) -> one micro-batch's summed loss."""
    if chunk_tokens > 0:
        return lambda model, x, y: chunked_loss_sum(model, x, y, chunk_tokens=chunk_tokens)[0]
    fn = loss_fn or ce_sum
    return lambda model, x, y: fn(logits_of(call_model(model, x)), y)


def _accumulated(
    model: nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    count: torch.Tensor,
    microbatches: int,
    loss_sum: LossSum,
    st: Any,
) -> torch.Tensor:
    from ..parallel.dp import no_sync

    scale = st.mesh.dp if st is not None and st.dp else 1  # DDP averages over dp
    if replays_cuda_graphs(model):
        # CUDA graph trees hand out a block's gradients in their pool, and the next replay reuses
        # it: AccumulateGrad would keep such a tensor as .grad. A .grad of its own (zeros) is
        # added into in place instead, over every micro-batch.
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    pairs = list(
        zip(ids.tensor_split(microbatches), labels.tensor_split(microbatches), strict=True)
    )
    for i, (x, y) in enumerate(pairs):  # x, y: (B/M, T)
        ctx = no_sync(model) if i < len(pairs) - 1 else contextlib.nullcontext()
        with ctx:
            with autocast(ids.device):
                s = loss_sum(model, x, y) / count
            (s * scale).backward()
        total += s.detach().float()
    return total


def _pipelined(
    pipe: PipelineRuntime,
    mesh: Any,
    ids: torch.Tensor,
    labels: torch.Tensor,
    count: torch.Tensor,
    microbatches: int,
    schedule: str,
) -> torch.Tensor:
    sched = pipe.schedule(schedule, microbatches, tuple(ids.shape))
    pipe.count = count
    first, last = pipe.first, pipe.last
    losses: list[torch.Tensor] = []
    args = (ids,) if first else ()
    sched.step(
        *args,
        target=labels if last else None,
        losses=losses if last else None,
        return_outputs=False,
        input_ids=ids,
    )
    pipe.count = None
    if last:
        loss = torch.stack([x.detach().float() for x in losses]).sum()
    else:
        loss = torch.zeros((), dtype=torch.float32, device=ids.device)
    src = mesh.ranks_of("pp")[(pipe.cut.pp - 1) % mesh.pp]  # the rank of the last stage
    dist.broadcast(loss, src=src, group=mesh.pp_group)
    if not pipe.checked:  # every pp rank sees the same loss: all raise together, none hangs
        if not bool(torch.isfinite(loss)):
            raise PipelineError(leak_error(pipe.stages[0], pipe.runners[0].first_name))
        pipe.checked = True
    if mesh.dp > 1:
        _sum_grads(pipe.runners[0].model, mesh.dp_group)  # every local stage's parameters
    return loss


def _sum_grads(module: nn.Module, group: Any) -> None:
    """Sum the trainable gradients over `group` (dp replicas of one stage), one flat buffer per
    dtype. Every replica of a stage holds the same parameters, so the buffers match."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in module.parameters():
        if p.requires_grad and p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


@torch.no_grad()
def eval_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over the batch's labelled tokens, their count), forward
    only, on every rank of this replica (not summed over dp). At pp > 1 the batch runs through the
    stages as one micro-batch (GPipe, forward only) and the last stage's sum is broadcast.

    Example:
        >>> total, n = eval_loss_sum(model, {"input_ids": ids, "labels": ids})  # doctest: +SKIP
    """
    st = parallel_state(model, required=False)
    mesh = st.mesh if st is not None else None
    device = mesh.device if mesh is not None else next(model.parameters()).device
    ids = batch["input_ids"].to(device)  # (B, T)
    labels = batch.get("labels", batch["input_ids"]).to(device)  # (B, T)
    count = int((causal_lm_targets(labels) != IGNORE_INDEX).sum())
    if mesh is None or mesh.pp == 1:
        return ce_sum(logits_of(call_model(model, ids)), labels), count
    assert st is not None and st.pipeline is not None
    pipe = st.pipeline
    name = "interleaved1f1b" if len(pipe.stages) > 1 else "gpipe"
    sched = pipe.schedule(name, 1, tuple(ids.shape))
    pipe.count = torch.ones((), device=device)  # the loss function then returns the sum
    losses: list[torch.Tensor] = []
    try:
        sched.eval(
            *((ids,) if pipe.first else ()),
            target=labels if pipe.last else None,
            losses=losses if pipe.last else None,
            input_ids=ids,
        )
    finally:
        pipe.count = None
    total = torch.stack([x.float() for x in losses]).sum() if pipe.last else None
    total = total if total is not None else torch.zeros((), dtype=torch.float32, device=device)
    dist.broadcast(total, src=mesh.ranks_of("pp")[(pipe.cut.pp - 1) % mesh.pp], group=mesh.pp_group)
    return total, count
