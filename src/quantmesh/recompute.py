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
- compile_blocks: either order. The block's own forward is compiled *inside* the checkpoint, which
  stays eager (as does the offload) around the compiled graph. (Compiled around the checkpoint,
  the graph saved far more than the inputs: 26.6 GiB against 7.9 eager for 7B nf4 + LoRA at 8192
  tokens on an H200, and the offload broke the graph; docs/benchmarks.md.)
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

_MARK = "_quantmesh_checkpointed"  # block.__dict__: the block's own forward
_OFFLOAD = "_quantmesh_offload"
COMPILE_KWARGS = "_quantmesh_compile_kwargs"  # set by compile_blocks


def checkpoint_blocks(model: nn.Module, *, offload: bool = False) -> int:
    """Recompute every repeated block of `model` in backward instead of keeping its activations.

    The blocks are the ones `compile_blocks` and the planner find (the elements of the largest
    ModuleLists). Only training forwards with gradients enabled are checkpointed; evaluation and
    generation run the block as it is. Calling it again changes `offload` and nothing else. With
    `compile_blocks` (before or after), the block's own forward is compiled inside the checkpoint:
    the checkpoint and the offload stay eager around the compiled graph. Returns the number of
    blocks.

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
        block.__dict__.setdefault(_MARK, block.forward)
        block.__dict__[_OFFLOAD] = offload
        install(block)
    return len(blocks)


def install(block: nn.Module) -> None:
    """(Re)build a checkpointed block's forward from what is recorded on it: its own forward,
    compiled when compile_blocks asked for it (then not around the checkpoint), and the offload."""
    inner = block.__dict__[_MARK]
    kwargs = block.__dict__.get(COMPILE_KWARGS)
    if kwargs is not None:
        block._compiled_call_impl = None  # a compile around the checkpoint moves inside it
        inner = torch.compile(inner, **kwargs)
    offload = block.__dict__.get(_OFFLOAD, False)
    block.forward = functools.partial(_checkpointed, block, inner, offload)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether checkpoint_blocks wrapped `block`."""
    return _MARK in block.__dict__


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
