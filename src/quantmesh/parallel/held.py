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


def _layers(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """The modules of a model with its sharded layers' local modules; a list as it is."""
    if not isinstance(model, nn.Module):
        return list(model)
    return [*model.modules(), *(m.local for m in sharded_modules(model).values())]


def keep_dequantized(model: nn.Module | Iterable[nn.Module], dtype: torch.dtype | None) -> int:
    """Hold the weight of every bitsandbytes 4-bit linear of `model` (parallelized or not; or of a
    list of layers) dequantized in `dtype` beside its codes (None: drop them).

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
    """
    return hold_dequantized(_layers(model), dtype)


def dequantized_bytes(model: nn.Module | Iterable[nn.Module], dtype: torch.dtype) -> int:
    """The bytes `keep_dequantized(model, dtype)` would hold, computed without allocating.

    Example:
        >>> dequantized_bytes(model, torch.bfloat16) / 2**30  # doctest: +SKIP
        12.1
    """
    return held_bytes(_layers(model), dtype)
