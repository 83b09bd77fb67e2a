"""The whole model's tensors from a sharded one: full_state_dict."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.state import parallel_state
from ..tp.gather import gather_param, module_tensors, tp_sharded
from ..tp.layers import inside_sharded, sharded_modules

__all__ = ["full_state_dict"]


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
