"""checkpoint_blocks: activation checkpointing of every repeated block (recompute in backward).

A block under checkpointing keeps only its inputs for backward; its inner activations are
recomputed when backward reaches it. Memory for activations falls from every layer's intermediates
to one block input per layer (plus one block's intermediates at a time), for about one extra block
forward per step.

It composes with the rest because it is torch's own non-reentrant `torch.utils.checkpoint`:
- tp: the recompute replays the random state (torch saves it at the block's forward), and the tp
  RNG regions derive their per-rank streams from that state, so dropout masks are the same again;
  the copy shares and RNG regions are per forward and are rebuilt by the recompute.
- dp (DDP), nf4/int8 bases, LoRA: nothing special (gradients come out of the same backward).
- compile_blocks: either order; the compiled block traces the checkpoint and trains to the same
  losses, but saves far more than the inputs (7B nf4 + LoRA at 8192 tokens on an H200: 26.6 GiB
  peak against 7.9 eager, docs/benchmarks.md). For memory, checkpoint eager blocks. Offload inside
  a compiled block breaks its graph (dynamo does not trace `save_on_cpu`).
- `offload=True`: the saved block inputs go to (pinned, on CUDA) host memory through
  `torch.autograd.graph.save_on_cpu` and come back when backward needs them. torch copies them back
  synchronously when the block's backward starts; there is no prefetch ahead of need yet.

Example:
    >>> qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16))  # doctest: +SKIP
    >>> qm.checkpoint_blocks(model)                                          # doctest: +SKIP
    32
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .plan.auto import blocks_of

__all__ = ["checkpoint_blocks"]

_MARK = "_quantmesh_checkpointed"


def checkpoint_blocks(model: nn.Module, *, offload: bool = False) -> int:
    """Recompute every repeated block of `model` in backward instead of keeping its activations.

    The blocks are the ones `compile_blocks` and the planner find (the elements of the largest
    ModuleLists). Only training forwards with gradients enabled are checkpointed; evaluation and
    generation run the block as it is. Calling it again changes `offload` and nothing else.
    Returns the number of blocks.

    Example:
        >>> qm.checkpoint_blocks(model, offload=True)  # doctest: +SKIP
        32
    """
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (no nn.ModuleList with children) to "
            "checkpoint; wrap the parts you want recomputed in torch.utils.checkpoint yourself"
        )
    for _, block in blocks:
        inner = block.__dict__.get(_MARK) or block.forward
        block.__dict__[_MARK] = inner
        block.forward = functools.partial(_checkpointed, block, inner, offload)
    return len(blocks)


def _checkpointed(
    block: nn.Module, inner: Callable[..., Any], offload: bool, *args: Any, **kwargs: Any
) -> Any:
    if not (block.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    ctx: contextlib.AbstractContextManager[Any] = (
        torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        if offload
        else contextlib.nullcontext()
    )
    with ctx:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
