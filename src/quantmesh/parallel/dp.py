"""Data parallel over the mesh's dp axis, through torch's own engine (composable `replicate` = DDP).

Only trainable parameters are handed to DDP: the frozen (quantized) base is never broadcast nor
reduced. The model keeps its class behaviour and FQNs (replicate hooks the root module in place).
Processes that drive several devices (layer split) run DDP with device_ids=None; the mesh already
checked that no two ranks share a device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .state import parallel_state

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = ["apply_dp", "no_sync"]


class _Frozen(nn.Module):
    """Holds the frozen parameters so that `replicate(ignored_modules=...)` skips them."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def apply_dp(model: nn.Module, mesh: Mesh, *, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Sync gradients of the trainable parameters over mesh.dp_group (no-op when dp == 1).

    Example:
        >>> qm.apply_dp(model, mesh)  # doctest: +SKIP  (parallelize calls it for you)
    """
    if mesh.dp == 1:
        return model
    from torch.distributed._composable.replicate import replicate

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            "data parallel needs trainable parameters, but every parameter is frozen; pass "
            "lora=qm.LoraConfig(...) or unfreeze what you want to train before parallelize"
        )
    frozen = [p for p in model.parameters() if not p.requires_grad]
    devices = {p.device for p in trainable}
    kwargs: dict[str, list[torch.device] | None] = {}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        kwargs["device_ids"] = [next(iter(devices))]
    else:
        kwargs["device_ids"] = None
    replicate(
        model,
        ignored_modules=[_Frozen(frozen)] if frozen else None,
        process_group=mesh.dp_group,
        bucket_cap_mb=bucket_cap_mb,  # DDP wraps a list of the trainable params: no buffers
        **kwargs,
    )
    st = parallel_state(model, required=False)
    if st is not None:
        st.dp = True
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the dp gradient all-reduce inside (gradient accumulation's non-final micro-steps).

    Example:
        >>> with qm.no_sync(model):          # doctest: +SKIP
        ...     loss_fn(model(x0)).backward()
        >>> loss_fn(model(x1)).backward()    # doctest: +SKIP  (syncs the accumulated sum)
    """
    if not hasattr(model, "set_requires_gradient_sync"):  # not under apply_dp (replicate)
        yield
        return
    replicated: Any = model  # replicate() added set_requires_gradient_sync to this instance
    replicated.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        replicated.set_requires_gradient_sync(True)
