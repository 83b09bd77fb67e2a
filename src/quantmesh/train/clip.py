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
    local = torch.zeros((), device=dev, dtype=torch.float32)
    repl = torch.zeros((), device=dev, dtype=torch.float32)
    dp_group = None  # FSDP: each gradient is a DTensor split over dp; its squares summed over dp
    for g, is_sharded in grads:
        if isinstance(g, DTensor):
            dp_group = g.device_mesh.get_group()
            g = g.to_local()
        sq = g.detach().float().pow(2).sum().to(dev)
        if is_sharded:
            local += sq
        else:
            repl += sq
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
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g, _ in grads:
            g.mul_(coef.to(g.device))
    return total


def _device_of(model: nn.Module, g: torch.Tensor) -> torch.device:
    """Where the norm is summed: the mesh's device (FSDP may keep gradients in host memory)."""
    st = parallel_state(model, required=False)
    return st.mesh.device if st is not None else g.device
