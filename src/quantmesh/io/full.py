"""Whole-model views of a sharded model: full_state_dict, and the true global gradient norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..parallel.state import parallel_state
from ..plan.styles import FeatureSplit
from ..tp.collectives import all_gather_uneven
from ..tp.layers import ShardedModule, inside_sharded, sharded_modules

__all__ = ["full_state_dict", "clip_grad_norm_", "tp_sharded", "gather_param", "module_tensors"]


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


def _refuse_fsdp(model: nn.Module, what: str) -> None:
    """Raise before any collective when FSDP shards `model` (not supported by `what` yet)."""
    st = parallel_state(model, required=False)
    if st is not None and st.sharded is not None:
        raise ValueError(
            f"{what} of a model sharded with fsdp=True is not supported yet; save the adapter "
            "(qm.save_adapter) and load it into the model parallelized without fsdp, then "
            f"call {what} there"
        )


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Unsharded tensors under the original names (quantized weights dequantized, LoRA included).

    Collective over the tp group: every rank must call it. With rank0_only, ranks other than
    global rank 0 get an empty dict.

    Example:
        >>> sd = qm.full_state_dict(model)   # doctest: +SKIP
        >>> sorted(sd)[:2]                   # doctest: +SKIP
        ['lm_head.weight', 'model.embed_tokens.weight']
    """
    st = parallel_state(model, required=False)
    if st is not None and st.mesh.pp > 1:  # this rank holds one stage: the dict would be partial
        raise NotImplementedError(
            f"full_state_dict at pp={st.mesh.pp}: each rank holds only its pipeline stage, and "
            f"gathering the stages is not implemented; save the adapters (qm.save_adapter) or "
            f"the training state (qm.save_state), which work at any pp, or use pp=1"
        )
    _refuse_fsdp(model, "full_state_dict")
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    sharded = sharded_modules(model)
    for name, t in model.state_dict().items():
        if inside_sharded(name, sharded):
            continue
        if keep:
            out[name] = t.detach().cpu() if cpu else t.detach()
    for mname, m in sharded.items():
        split_params = tp_sharded(m)
        for pname, t in module_tensors(m).items():
            if pname in split_params:
                dim, split = split_params[pname]
                t = gather_param(t, dim, split, m.group)
            if keep:
                out[f"{mname}.{pname}"] = t.cpu() if cpu else t
    return out


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
