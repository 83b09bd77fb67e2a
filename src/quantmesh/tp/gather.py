"""A rank's slice of a split tensor and the whole tensor back: which parameters of a ShardedModule
are split over tp (tp_sharded), the all-gather that reassembles one (gather_param), and the local
tensors in checkpoint layout (module_tensors). Read by the saves, the loads, verify_plan and
full_state_dict."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.styles import FeatureSplit
from .collectives import all_gather_uneven
from .layers import ShardedModule

__all__ = ["tp_sharded", "gather_param", "module_tensors"]


def tp_sharded(m: ShardedModule) -> dict[str, tuple[int, FeatureSplit]]:
    """{local parameter name: (dim, split)} of the parameters of `m` that are split over tp."""
    return m.tp_splits()


def _assemble(parts: list[torch.Tensor], dim: int, split: FeatureSplit) -> torch.Tensor:
    """Put every rank's local slice back at its ranges of the full dimension."""
    shape = list(parts[0].shape)
    shape[dim] = split.full
    full = parts[0].new_empty(shape)
    for r, t in enumerate(parts):
        pos = 0
        for a, b in split.ranges(r):
            full.narrow(dim, a, b - a).copy_(t.narrow(dim, pos, b - a))
            pos += b - a
    return full


def gather_param(
    t: torch.Tensor, dim: int, split: FeatureSplit, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-gather a tp-sharded tensor and reassemble the full one (every rank gets it)."""
    sizes = split.sizes()
    joined = all_gather_uneven(
        t.detach(), dim, sizes, group
    )  # rank parts side by side, in rank order
    return _assemble(list(joined.split(sizes, dim=dim)), dim, split)


def module_tensors(m: ShardedModule, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
    """The local tensors of a ShardedModule in checkpoint layout (quantized weights dequantized)."""
    return m.checkpoint_tensors(dequantize=dequantize)
