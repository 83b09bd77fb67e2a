"""Models wrapped by peft (`get_peft_model`, `PeftModel`) with LoRA adapters, taken as they are.

`unwrap_peft` finds peft's LoRA layers, puts each one's base layer back at its name and returns
the adapters' values with the one LoraConfig they share; parallelize then builds its own
adapters on those layers and `restore_adapters` copies peft's values into them, each rank its
slice. The root (a PeftModel) stays the object the user holds: its names keep peft's
`base_model.model.` prefix, and `qm.save_adapter` writes the file peft's `save_pretrained` writes.
Other peft methods (prefix tuning, IA3, DoRA, several adapters, LoRA on embeddings or convolutions)
are refused before anything is allocated, with the fix.

peft is never imported here: its layers are recognised by their attributes and class names.

Example:
    >>> peft_model = get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj"]))  # doctest: +SKIP
    >>> qm.parallelize(peft_model, mesh)                                                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adapter import LoraConfig, LoraError

__all__ = [
    "PeftAdapters",
    "inner_model",
    "is_peft_model",
    "restore_adapters",
    "rewrap",
    "unwrap_peft",
]


@dataclass
class PeftAdapters:
    """peft's adapters taken out of a model: the LoraConfig they share and their full values."""

    config: LoraConfig
    weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """{module fqn (in the inner model): {"lora_A.weight": (r, in), "lora_B.weight": (out, r)}}."""
    layers: dict[str, nn.Module] = field(default_factory=dict)
    """{module fqn: peft's layer}, to put back when parallelize fails (`rewrap`)."""


def _mro(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def is_peft_model(model: nn.Module) -> bool:
    """True for a peft `PeftModel` (what `get_peft_model` returns).

    Example:
        >>> is_peft_model(nn.Linear(2, 2))
        False
    """
    return "PeftModel" in _mro(model) and hasattr(model, "get_base_model")


def inner_model(model: nn.Module) -> nn.Module:
    """The user's model inside a PeftModel (`get_base_model()`), else `model` itself.

    Example:
        >>> lin = nn.Linear(2, 2); inner_model(lin) is lin
        True
    """
    return model.get_base_model() if is_peft_model(model) else model  # type: ignore[operator]


def _refuse(what: str) -> LoraError:
    return LoraError(
        f"{what}; qm.parallelize takes peft models with LoRA adapters only (one adapter, no "
        "DoRA, on linear layers). Fix: merge the adapter into the base "
        "(peft_model.merge_and_unload()) and pass qm.LoraConfig(...) for new adapters, or "
        "recreate it with peft.LoraConfig"
    )


def unwrap_peft(model: nn.Module, lora: LoraConfig | None) -> PeftAdapters | None:
    """Put every peft LoRA layer's base layer back in its place (in `inner_model(model)`), in
    place, and return the adapters; None when the model holds no peft layers.

    Raises LoraError (nothing changed yet) for other peft methods, several adapters, DoRA,
    per-layer ranks or scales, adapters merged into the base, or `lora=` given as well.

    Example:
        >>> unwrap_peft(nn.Linear(2, 2), None) is None
        True
    """
    inner = inner_model(model)
    if is_peft_model(model):
        cfgs = getattr(model, "peft_config", {}) or {}
        kinds = {str(getattr(getattr(c, "peft_type", None), "value", c)) for c in cfgs.values()}
        if kinds - {"LORA"}:
            raise _refuse(f"the model is a peft {'/'.join(sorted(kinds))} model")
    layers: dict[str, Any] = {}
    for fqn, m in inner.named_modules():
        names = _mro(m)
        if "BaseTunerLayer" not in names:
            continue
        if "LoraLayer" not in names:
            raise _refuse(f"{fqn} is a peft {type(m).__name__}")
        layers[fqn] = m
    if not layers:
        return None
    if lora is not None:
        raise LoraError(
            "the model carries peft LoRA adapters already, and lora= asks for new ones; pass "
            "lora=None to keep peft's adapters (or merge them first: merge_and_unload())"
        )
    found: list[tuple[int, float, float]] = []
    for fqn, m in layers.items():
        adapters = list(m.lora_A.keys())
        if len(adapters) != 1 or getattr(m, "lora_embedding_A", None):
            raise _refuse(f"{fqn} holds adapters {adapters} (embedding adapters count too)")
        (ad,) = adapters
        if getattr(m, "merged_adapters", None):
            raise _refuse(f"{fqn} has its adapter merged into the base weight")
        if getattr(m, "use_dora", {}).get(ad, False) or getattr(m, "lora_bias", {}).get(ad, False):
            raise _refuse(f"{fqn} uses DoRA or a LoRA bias")
        base = m.get_base_layer()
        if not (
            isinstance(base, nn.Linear)
            or "Linear4bit" in _mro(base)
            or "Linear8bitLt" in _mro(base)
        ):
            raise _refuse(f"{fqn} adapts a {type(base).__name__}")
        drop = m.lora_dropout[ad]
        p = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
        found.append((int(m.r[ad]), float(m.scaling[ad]), p))
    if len(set(found)) > 1:
        raise _refuse(f"the adapters differ in (r, scale, dropout): {sorted(set(found))}")
    r, scale, p = found[0]
    cfg = LoraConfig(r=r, alpha=scale * r, dropout=p, targets=list(layers))
    out = PeftAdapters(cfg)
    for fqn, m in layers.items():
        (ad,) = list(m.lora_A.keys())
        out.weights[fqn] = {
            "lora_A.weight": m.lora_A[ad].weight.detach().clone(),
            "lora_B.weight": m.lora_B[ad].weight.detach().clone(),
        }
        out.layers[fqn] = m
        parent, _, child = fqn.rpartition(".")
        setattr(inner.get_submodule(parent), child, m.get_base_layer())
    return out


def rewrap(model: nn.Module, adapters: PeftAdapters) -> None:
    """Put peft's layers back where `unwrap_peft` took them (parallelize failed before using them).

    Example:
        >>> rewrap(peft_model, adapters)  # doctest: +SKIP
    """
    inner = inner_model(model)
    for fqn, layer in adapters.layers.items():
        parent, _, child = fqn.rpartition(".")
        setattr(inner.get_submodule(parent), child, layer)


@torch.no_grad()
def restore_adapters(model: nn.Module, adapters: PeftAdapters) -> None:
    """Copy peft's adapter values into the parallelized model's adapters, each rank its slice.

    Example:
        >>> restore_adapters(peft_model, adapters)  # doctest: +SKIP
    """
    from ..plan.styles import slice_dim

    inner = inner_model(model)
    for fqn, tensors in adapters.weights.items():
        m: Any = inner.get_submodule(fqn)
        split = m.tp_splits()  # a ShardedModule's {name: (dim, split)} of its split tensors
        for name, full in tensors.items():
            cut = split.get(name)
            part = full if cut is None else slice_dim(full, cut[0], cut[1].ranges(m.tp_rank))
            p = m.get_parameter(name)
            p.copy_(part.to(device=p.device, dtype=p.dtype))
