"""Memory per pipeline rank: `estimate_memory` applied to what each pp rank holds, with the
activations of the micro-batches its schedule keeps in flight.

For each pp rank, a copy of the (meta) skeleton is cut as `parallelize` cuts it (`drop_others`), so
weights, adapters, their gradients and optimizer states count only that rank's modules (the
embedding on the first stage, the head on the last, a tied pair on both). Activations are
`estimate_memory`'s per-layer figure for one micro-batch, times the layers the rank holds, times
the micro-batches whose activations are alive at once under the schedule (the forward of a
micro-batch is kept until its backward):

  gpipe            every micro-batch: M
  1f1b             rank r: min(M, pp - r) (the warm-up forwards before its first backward)
  interleaved1f1b  rank r, V stages each: min(M V, 2 (pp - 1 - r) + (V - 1) pp + 1) stage
                   forwards (Megatron's warm-up count), each of one stage's layers

The logits and loss count on the last stage only (one micro-batch's at a time). At pp > 1 there
are no DDP buckets (train_step sums the gradients over dp in one flat buffer after the schedule:
counted as the same 4 bytes per adapter parameter). This is a model of the schedule, not a
measurement: the received and sent activation buffers (one micro-batch's hidden states each) and
the schedule's own bookkeeping are left out.

Example:
    >>> for r in estimate_stages(model, pp=2, microbatches=8, lora=qm.LoraConfig(r=16)):
    ...     print(r.rank, r.stages, r.estimate.total)                      # doctest: +SKIP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import PP_SCHEDULES, PipelineConfig
from ..plan.auto import auto_plan, blocks_of
from ..plan.memory import MemoryEstimate, estimate_memory
from ..plan.plan import Plan
from .cut import StandIn, drop_others, plan_stages

__all__ = ["StageMemory", "estimate_stages", "in_flight"]


@dataclass
class StageMemory:
    """One pp rank's estimate: its stages, their blocks, and the micro-batches in flight."""

    rank: int
    stages: list[int]
    blocks: int
    in_flight: int
    estimate: MemoryEstimate


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> int:
    """Stage forwards whose activations rank `rank` holds at its peak (module docstring).

    Example:
        >>> [in_flight("1f1b", 4, r, 8) for r in range(4)]
        [4, 3, 2, 1]
    """
    if schedule == "gpipe":
        return microbatches * virtual
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    if schedule == "interleaved1f1b":
        return min(microbatches * virtual, 2 * (pp - 1 - rank) + (virtual - 1) * pp + 1)
    raise ValueError(f"schedule={schedule!r}; use one of {', '.join(PP_SCHEDULES)}")


def estimate_stages(
    model: nn.Module,
    *,
    pp: int,
    microbatches: int,
    schedule: str = "1f1b",
    pipeline: PipelineConfig | None = None,
    tp: int = 1,
    **kw: Any,
) -> list[StageMemory]:
    """`estimate_memory` for each pp rank of `model` cut into pp stages (module docstring).
    `model` should be a meta skeleton (`qm.empty_model()`: it is copied once per rank); `kw` are
    estimate_memory's (quant, lora, seq_len, micro_batch = rows per micro-batch, dtype, ...).

    Example:
        >>> estimate_stages(model, pp=2, microbatches=8, quant="nf4")[1].estimate.total  # doctest: +SKIP
    """
    dp = kw.get("dp", 1)
    if dp < 1:
        raise ValueError(f"dp={dp}; expected >= 1")
    kw = {**kw, "dp": 1}  # no DDP buckets at pp > 1 (see the module docstring)
    virtual = pipeline.virtual if pipeline is not None else 1
    cut = plan_stages(model, pp, pipeline)
    whole_plan = kw.pop("plan", None) or auto_plan(model, tp)
    if isinstance(whole_plan, dict):
        whole_plan = Plan(whole_plan)
    per_layer = estimate_memory(model, tp=tp, plan=whole_plan, **kw)
    n_blocks = max(1, len(blocks_of(model)))
    out = []
    for rank in range(pp):
        stages = cut.local(rank)
        part = copy.deepcopy(model)
        drop_others(part, cut, stages, torch.device("meta"))
        gone = {n for n, m in part.named_modules() if isinstance(m, StandIn)}
        plan = Plan(
            {k: v for k, v in whole_plan.rules.items() if k not in gone},
            notes=whole_plan.notes,
            model=part,
            tp=tp,
            contiguous=whole_plan.contiguous,
        )
        est = estimate_memory(part, tp=tp, plan=plan, **kw)
        blocks = sum(len(cut.blocks[s]) for s in stages)
        flight = in_flight(schedule, pp, rank, microbatches, virtual)
        # one micro-batch's activations of this rank's layers, per stage forward in flight
        est.activations = int(per_layer.activations * blocks / n_blocks / len(stages) * flight)
        est.logits = per_layer.logits if cut.pp - 1 in stages else 0
        est.ddp = 4 * est.lora_params if dp > 1 else 0  # the flat dp all-reduce buffer
        est.notes.append(
            f"pp rank {rank}: stages {stages}, {blocks} of {n_blocks} blocks, {flight} stage "
            f"forward(s) in flight under {schedule} with {microbatches} micro-batches"
        )
        out.append(StageMemory(rank, stages, blocks, flight, est))
    return out
