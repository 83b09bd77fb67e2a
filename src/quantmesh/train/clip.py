"""The true global gradient norm of a sharded model, and its clipping: clip_grad_norm_."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel.state import parallel_state
from ..tp.gather import tp_sharded
from ..tp.layers import ShardedModule

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by the true global 2-norm over tp shards (replicated parameters counted once)
    and pipeline stages.

    Call after backward (and after the dp sync, which averages gradients: dp replicas then agree).

    Example:
        >>> norm = qm.clip_grad_norm_(model, 1.0)  # doctest: +SKIP
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type}; only the 2-norm is supported")
    sharded_ids: set[int] = set()
    group = None
    for m in model.modules():
        if isinstance(m, ShardedModule) and m.split is not None:
            group = m.group
            for pname in tp_sharded(m):
                p = m.get_parameter(pname) if "." in pname else m._parameters[pname]
                sharded_ids.add(id(p))
    grads = [(p.grad, id(p) in sharded_ids) for p in model.parameters() if p.grad is not None]
    st = parallel_state(model, required=False)
    pp_group = st.mesh.pp_group if st is not None and st.mesh.pp > 1 else None
    if not grads and pp_group is None:
        return torch.tensor(0.0)
    dev = _device_of(model, grads[0][0]) if grads else st.mesh.device  # type: ignore[union-attr]
    dp_group = None  # FSDP: each gradient is a DTensor split over dp; its squares summed over dp
    tensors: list[torch.Tensor] = []
    for g, _ in grads:
        if isinstance(g, DTensor):
            dp_group = g.device_mesh.get_group()
            g = g.to_local()  # the same storage: scaling it scales the gradient
        tensors.append(g)
    local = _sum_of_squares([t for t, (_, sh) in zip(tensors, grads, strict=False) if sh], dev)
    repl = _sum_of_squares([t for t, (_, sh) in zip(tensors, grads, strict=False) if not sh], dev)
    if dp_group is not None:
        both = torch.stack([local, repl])
        dist.all_reduce(both, group=dp_group)
        local, repl = both[0], both[1]
    if group is not None:
        dist.all_reduce(local, group=group)
    squares = local + repl
    if pp_group is not None:  # each pipeline stage holds its own parameters: sum the stages
        dist.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    # scaled by at most 1 (x * 1.0 is x exactly), so nothing waits for the norm's value: a few
    # kernels per device, where one per gradient and a host sync left the GPU idle at every step
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for device, group_tensors in _by_device(tensors).items():
        torch._foreach_mul_(group_tensors, coef.to(device))
    return total


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _sum_of_squares(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `tensors` (any devices), in fp32 on `dev`: one
    multi-tensor norm kernel per device."""
    total = torch.zeros((), device=dev, dtype=torch.float32)
    for ts in _by_device(tensors).values():
        norms = torch._foreach_norm(ts, 2.0, dtype=torch.float32)
        total = total + torch.stack(norms).square().sum().to(dev)
    return total


def _device_of(model: nn.Module, g: torch.Tensor) -> torch.device:
    """Where the norm is summed: the mesh's device (FSDP may keep gradients in host memory)."""
    st = parallel_state(model, required=False)
    return st.mesh.device if st is not None else g.device
