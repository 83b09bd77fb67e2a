"""This rank's pipeline stage and its schedules, built on torch.distributed.pipelining.

`build_runtime(model, cut, mesh, swaps)` wraps each of the rank's stages in a `StageModule`; a
schedule (GPipe or 1F1B over M micro-batches with one stage per rank, Interleaved 1F1B with
several) is built on first use with `PipelineStage`s of its own over the pp group. The loss the last stage computes is the summed next-token cross-entropy divided by the
step's global label count, so gradients need no 1/M scaling (scale_grads=False).

Example:
    >>> rt = build_runtime(model, cut, mesh)           # doctest: +SKIP
    >>> rt.schedule("1f1b", 8).step(...)                # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import check_pp_schedule
from ..train.data import IGNORE_INDEX
from .cut import StageCut
from .stage import StageModule

if TYPE_CHECKING:
    from ..parallel.mesh import Mesh

__all__ = ["PipelineRuntime", "build_runtime", "causal_lm_targets", "ce_sum"]


def causal_lm_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: position t predicts labels[t + 1]; the last position predicts none."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of (B, T, V) logits against (B, T) labels."""
    t = causal_lm_targets(labels)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        t.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@dataclass
class PipelineRuntime:
    """This rank's pipeline: its stage modules (one per local stage), the cut, and schedules
    built on first use."""

    cut: StageCut
    stages: list[int]
    runners: list[StageModule]
    device: torch.device
    group: Any
    count: torch.Tensor | None = None  # the step's global label count (the loss divisor)
    checked: bool = False  # the first step's loss was finite (no stand-in NaN leaked)
    _schedules: dict[tuple[str, int, tuple[int, ...]], Any] = field(default_factory=dict)

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.cut.pp - 1 in self.stages

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.count is not None  # set by train_step before the schedule runs
        return ce_sum(logits, labels) / self.count

    def schedule(self, name: str, microbatches: int, shape: tuple[int, ...] = ()) -> Any:
        """The schedule `name` over `microbatches` for batches of `shape`, built once
        (PipelineStages of its own: a stage learns its activation shapes on its first step, so
        another batch shape gets another schedule)."""
        key = (name, microbatches, shape)
        if key in self._schedules:
            return self._schedules[key]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        check_pp_schedule(name, pp=self.cut.ranks, virtual=len(self.stages))
        several = len(self.stages) > 1
        stages = [
            PipelineStage(r, s, self.cut.pp, self.device, group=self.group)
            for r, s in zip(self.runners, self.stages, strict=True)
        ]
        # the loss is already divided by the global label count: no 1/M scaling of gradients
        kw: dict[str, Any] = dict(
            n_microbatches=microbatches, loss_fn=self.loss_fn, scale_grads=False
        )
        sched: Any
        if several:
            sched = ScheduleInterleaved1F1B(list[Any](stages), **kw)
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
            sched = cls(stages[0], **kw)
        self._schedules[key] = sched
        return sched


def leak_error(stage: int, first_block: str) -> str:
    return (
        f"the first pipelined step's loss is not finite (pipeline stage {stage} starts at "
        f"{first_block}): either the model diverged, or a value computed by another stage's module "
        f"(those stand in as NaN) reaches a stage's blocks other than through the first block's "
        f"hidden-state input; this model cannot be cut this way: use pp=1"
    )


def build_runtime(
    model: nn.Module, cut: StageCut, mesh: Mesh, swaps: dict[int, dict[str, Any]]
) -> PipelineRuntime:
    """This rank's stages of `model` (already cut by drop_others, which made `swaps`) over
    mesh.pp_group."""
    stages = cut.local(mesh.pp_rank)
    runners = [StageModule(model, cut, s, swaps.get(s)) for s in stages]
    return PipelineRuntime(cut, stages, runners, mesh.device, mesh.pp_group)
