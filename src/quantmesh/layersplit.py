"""In-process layer split: a rank that owns several devices spreads its replica's blocks over them.

Consecutive blocks go to consecutive devices; what comes before the blocks (embeddings) sits on the
first device, what comes after (final norm, head) on the last. A forward pre-hook on every placed
module moves its tensor inputs to its device, so activations follow the layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .plan.styles import balanced_counts

__all__ = ["layer_placement", "split_layers", "device_of"]


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    return max(lists, key=lambda x: sum(p.numel() for p in x[1].parameters()))


def layer_placement(model: nn.Module, devices: list[torch.device]) -> dict[str, torch.device]:
    """{module FQN prefix: device}: blocks split evenly in order; before -> first, after -> last.

    Example:
        >>> layer_placement(model, [torch.device("cuda", 0), torch.device("cuda", 1)])  # doctest: +SKIP
        {'model.embed_tokens': cuda:0, 'model.layers.0': cuda:0, ..., 'lm_head': cuda:1}
    """
    devices = [torch.device(d) for d in devices]
    found = _block_list(model)
    if found is None or len(devices) == 1:
        return {"": devices[0]}
    lname, blocks = found
    counts = balanced_counts(len(blocks), len(devices))
    out: dict[str, torch.device] = {"": devices[0]}
    i = 0
    for dev, c in zip(devices, counts):
        for _ in range(c):
            out[f"{lname}.{i}"] = dev
            i += 1
    order = [n for n, _ in model.named_modules()]
    first_block = order.index(f"{lname}.0")
    for n in order:
        if not n or n.startswith(lname) or lname.startswith(n + ".") or n == lname:
            continue
        if any(n.startswith(k + ".") for k in out if k):
            continue
        if "." in n and n.rsplit(".", 1)[0] in out:
            continue
        out[n] = devices[0] if order.index(n) < first_block else devices[-1]
    return out


def device_of(placement: dict[str, torch.device], fqn: str) -> torch.device:
    """The device of module `fqn` under `placement` (the longest matching prefix)."""
    best = ""
    for k in placement:
        if k and (fqn == k or fqn.startswith(k + ".")) and len(k) > len(best):
            best = k
    return placement[best]


def _to(obj: object, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def install_moves(model: nn.Module, placement: dict[str, torch.device]) -> None:
    """Pre-hooks that move each placed module's tensor inputs onto its device."""
    for name, dev in placement.items():
        if not name:
            continue
        mod = model.get_submodule(name)

        def hook(
            module: nn.Module, args: tuple, kwargs: dict, _dev: torch.device = dev
        ) -> tuple[Any, Any]:
            return _to(args, _dev), _to(kwargs, _dev)

        mod.register_forward_pre_hook(hook, with_kwargs=True)


def split_layers(model: nn.Module, devices: list[torch.device]) -> nn.Module:
    """Move `model`'s blocks over `devices` (consecutive blocks per device) and route activations.

    Example:
        >>> mesh = qm.init_mesh(devices_per_rank=2)       # doctest: +SKIP
        >>> qm.split_layers(model, mesh.devices)           # doctest: +SKIP
    """
    placement = layer_placement(model, devices)
    for name, dev in placement.items():
        if name:
            model.get_submodule(name).to(dev)
    install_moves(model, placement)
    return model
