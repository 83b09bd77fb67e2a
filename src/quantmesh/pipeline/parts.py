"""What the stages of a pipelined model hold, seen from one rank: names the other stages keep
(a checkpoint's or an adapter's keys this rank skips), the whole model's module names, and the one
gather that brings every stage's part of an adapter to the writing rank.

Example:
    >>> "model.layers.3.mlp.up_proj.weight" in elsewhere_keys(stage0_model)  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from .cut import PipelineError, StandIn

if TYPE_CHECKING:
    from ..parallel.mesh import Mesh

__all__ = ["elsewhere_keys", "module_names", "gather_stages", "stage_lora_config"]


def elsewhere_keys(model: nn.Module) -> set[str]:
    """Names of the parameters and buffers other stages hold (a checkpoint's keys this rank skips).

    Example:
        >>> "model.layers.3.mlp.up_proj.weight" in elsewhere_keys(stage0_model)  # doctest: +SKIP
        True
    """
    out: set[str] = set()
    for m in model.modules():
        if isinstance(m, StandIn):
            out.update(
                f"{m.fqn}.{n}" for n, _ in m.original.named_parameters(remove_duplicate=False)
            )
            out.update(f"{m.fqn}.{n}" for n, _ in m.original.named_buffers(remove_duplicate=False))
    return out


def module_names(model: nn.Module) -> list[str]:
    """Every module name of the whole model, other stages' modules included (in model order)."""
    out = []
    for n, m in model.named_modules():
        out.append(n)
        if isinstance(m, StandIn):
            out += [f"{n}.{c}" for c, _ in m.original.named_modules() if c]
    return out


def gather_stages(obj: Any, mesh: Mesh) -> list[Any]:
    """Every stage's `obj`, in stage order, on global rank 0 (others get []). Called by the first
    tp rank of each stage of replica 0 (the pp group of rank 0). Adapters and their optimizer
    state are small, so one object gather carries them."""
    group_ranks = mesh.ranks_of("pp")
    parts: list[Any] | None = [None] * mesh.pp if mesh.rank == group_ranks[0] else None
    dist.gather_object(obj, parts, dst=group_ranks[0], group=mesh.pp_group)
    return list(parts or [])


def stage_lora_config(
    model: nn.Module,
    mods: dict[str, Any],
    make: Callable[[nn.Module, dict], dict],
    targets: Callable[[nn.Module, set[str]], Any],
    other_adapters: bool = False,
) -> tuple[dict[str, Any], dict]:
    """(this stage's adapter modules, the PEFT config of the whole model's adapters). Collective
    over the world: every rank that holds adapters (`mods`, or `other_adapters`: an experts
    module's) sends its modules' names and its config (`make`); the first config of a stage with
    adapter modules stands for all, with target_modules (`targets`) over every stage's modules
    and target_parameters (expert tensors) over every stage's."""
    mine = (sorted(mods), make(model, mods) if mods or other_adapters else None)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    names = {n for ns, _ in everyone for n in ns}
    configs = [c for _, c in everyone if c is not None]
    if not configs:
        raise PipelineError(
            f"{type(model).__name__} has no LoRA adapters on any pipeline stage to save; "
            f"parallelize it with lora=qm.LoraConfig(...) first"
        )
    first = next((c for ns, c in everyone if c is not None and ns), configs[0])
    for c in configs:
        if (c["r"], c["lora_alpha"]) != (first["r"], first["lora_alpha"]):
            raise PipelineError(
                f"pipeline stages hold adapters of r={c['r']}, alpha={c['lora_alpha']} and "
                f"r={first['r']}, alpha={first['lora_alpha']}; a PEFT adapter has one of each"
            )
    config = dict(first)
    config["target_modules"] = targets(model, names) if names else []
    params = sorted({t for c in configs for t in c.get("target_parameters") or []})
    config["target_parameters"] = params or None
    return mods, config
