"""In-process layer split: a rank that owns several devices spreads its replica's blocks over them.

Consecutive blocks go to consecutive devices; what comes before the blocks (embeddings) sits on the
first device, what comes after (final norm, head) on the last. A forward pre-hook on every placed
module moves its tensor inputs to its device, so activations follow the layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..plan.auto import blocks_of
from ..plan.styles import balanced_counts

__all__ = ["layer_placement", "split_layers", "device_of"]


def layer_placement(model: nn.Module, devices: list[torch.device]) -> dict[str, torch.device]:
    """{module FQN prefix: device}: the repeated blocks (`blocks_of`, the same ones the planner and
    compile_blocks see; an encoder's and a decoder's in model order) split evenly in order; what
    comes before the first block -> the first device, anything else -> the device of the block
    before it (so the final norm and head land on the last).

    Example:
        >>> layer_placement(model, [torch.device("cuda", 0), torch.device("cuda", 1)])  # doctest: +SKIP
        {'model.embed_tokens': cuda:0, 'model.layers.0': cuda:0, ..., 'lm_head': cuda:1}
    """
    devices = [torch.device(d) for d in devices]
    blocks = [n for n, _ in blocks_of(model)]
    if not blocks or len(devices) == 1:
        return {"": devices[0]}
    out: dict[str, torch.device] = {"": devices[0]}
    names = iter(blocks)
    for dev, c in zip(devices, balanced_counts(len(blocks), len(devices)), strict=True):
        for _ in range(c):
            out[next(names)] = dev
    order = [n for n, _ in model.named_modules()]
    pos = {n: i for i, n in enumerate(order)}
    lists = {b.rsplit(".", 1)[0] for b in blocks}
    for n in order:
        if not n or n in out or any(n.startswith(k + ".") for k in out if k):
            continue
        if any(n == lst or lst.startswith(n + ".") for lst in lists):
            continue  # a block list or one of its ancestors: a container
        before = [b for b in blocks if pos[b] < pos[n]]
        out[n] = out[before[-1]] if before else devices[0]
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
