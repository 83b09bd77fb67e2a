"""Host data to the device without waiting for the device.

A copy from ordinary (pageable) host memory to a GPU waits until the work queued before it on the
stream is done: one such copy between two launched steps makes the host wait for the first, and
the device then waits for the host. `upload` stages the data in pinned memory first, so the copy
is queued like a kernel and the host goes on at once.

Example:
    >>> upload([3, 1, 2], torch.device("cpu")).tolist()
    [3, 1, 2]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["upload"]


def upload(data: Any, device: torch.device, dtype: torch.dtype | None = torch.long) -> torch.Tensor:
    """`data` (nested lists of numbers, or a CPU tensor) as a tensor on `device`, copied without
    waiting for the device's queued work (through pinned memory on a GPU). `dtype` None keeps a
    tensor's own (a list then takes torch's default).

    Example:
        >>> upload([[0, 1]], torch.device("cpu")).shape
        torch.Size([1, 2])
    """
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
