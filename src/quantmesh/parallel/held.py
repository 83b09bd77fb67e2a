"""keep_dequantized: a model's 4-bit weights held dequantized beside their codes, for speed.

A model's 4-bit linears are its own modules and, once parallelized, the local modules of its
sharded layers (`ShardedModule.local`: not a child, so that names stay the original's). This is
the one walk over both; quant/bnb.py holds the weight of each layer it is given.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..quant.bnb import held_bytes, hold_dequantized
from ..tp.layers import sharded_modules

__all__ = ["dequantized_bytes", "keep_dequantized"]


def _layers(model: nn.Module | Iterable[nn.Module], blocks: int | None = None) -> list[nn.Module]:
    """The modules of a model with its sharded layers' local modules, of its first `blocks`
    repeated blocks only when given (`plan.auto.blocks_of`); a list as it is."""
    if not isinstance(model, nn.Module):
        if blocks is not None:
            raise TypeError("blocks= takes a model (its repeated blocks are found), not a list")
        return list(model)
    if blocks is None:
        return [*model.modules(), *(m.local for m in sharded_modules(model).values())]
    from ..plan.auto import blocks_of

    found = blocks_of(model)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= len(found):
        raise ValueError(
            f"blocks={blocks!r}: {type(model).__name__} has {len(found)} repeated blocks; pass "
            f"1 to {len(found)} (or None: every 4-bit linear of the model)"
            if found
            else f"blocks={blocks!r}: {type(model).__name__} has no repeated blocks (no "
            "nn.ModuleList with children); pass blocks=None to hold every 4-bit linear"
        )
    return [m for _, b in found[:blocks] for m in _layers(b)]


def keep_dequantized(
    model: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None, *, blocks: int | None = None
) -> int:
    """Hold the weight of every bitsandbytes 4-bit linear of `model` (parallelized or not; or of a
    list of layers) dequantized in `dtype` beside its codes (None: drop them). `blocks`: only
    those of the model's first `blocks` repeated blocks (the decoder layers `compile_blocks` and
    `checkpoint_blocks` find), for a run with memory for some of them: each held block saves its
    share of the dequantizing.

    A speed for memory trade. Serving: a step of many rows otherwise dequantizes every weight
    again (bitsandbytes' path past the gemv's `GEMV_MAX_ROWS` rows, or from 2 rows with the gemv
    off). Training: every matmul otherwise dequantizes its weight in forward and again in
    backward. Held, one row without autograd keeps the 4-bit kernel, which reads a quarter of the
    bytes; two rows or more, and any input under autograd, multiply the held weight. The values
    are bitsandbytes' own dequantize's: for training, hold them in the layers' compute dtype
    (`QuantConfig.compute_dtype`; bf16 on GPUs, fp32 on CPU), and forward and backward give the
    codes' path's values. Experts' fused 4-bit tensors are not held. Returns the bytes held (2
    bytes per weight in bf16: about 4x the codes).

    Example:
        >>> qm.keep_dequantized(model, torch.bfloat16) / 2**30  # doctest: +SKIP
        12.1
        >>> qm.keep_dequantized(model, torch.bfloat16, blocks=8) / 2**30  # 8 of 32  # doctest: +SKIP
        3.0
    """
    return hold_dequantized(_layers(model, blocks), dtype)


def dequantized_bytes(
    model: nn.Module | Iterable[nn.Module], dtype: torch.dtype, *, blocks: int | None = None
) -> int:
    """The bytes `keep_dequantized(model, dtype, blocks=blocks)` would hold, computed without
    allocating.

    Example:
        >>> dequantized_bytes(model, torch.bfloat16) / 2**30  # doctest: +SKIP
        12.1
    """
    return held_bytes(_layers(model, blocks), dtype)
