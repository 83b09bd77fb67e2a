"""empty_model(): build a model skeleton whose parameters are on meta (or uninitialized on CPU).

Only parameters move: buffers (rotary tables, position ids) are computed by the model's own __init__
as usual, because nothing in a checkpoint restores the non-persistent ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["empty_model"]


@contextlib.contextmanager
def empty_model(device: str | torch.device = "meta") -> Iterator[None]:
    """Inside this context, every parameter a module registers is placed on `device`, empty.

    With "meta" (default) nothing is allocated, and the usual weight initialization costs nothing
    (it runs on meta tensors). With "cpu" parameters are real but their values are not meaningful.

    Example:
        >>> with qm.empty_model():
        ...     model = torch.nn.Linear(4096, 4096)
        >>> model.weight.device
        device(type='meta')
    """
    device = torch.device(device)
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device != device:
            cls = type(param)
            kwargs = dict(param.__dict__)
            new = torch.empty_like(param, device=device)
            p = (
                cls(new, requires_grad=param.requires_grad)
                if cls is nn.Parameter
                else nn.Parameter(new, requires_grad=param.requires_grad)
            )
            p.__dict__.update(kwargs)
            self._parameters[name] = p

    # patched on the class for the duration of the block: that is what this context manager does
    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
