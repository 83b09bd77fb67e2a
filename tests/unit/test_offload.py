"""The Offloader's bookkeeping (offload.py): each saved tensor comes back to the op that saved it,
over several blocks and steps, and nothing from a finished step stays reachable."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from quantmesh.offload import Offloader


def _run(blocks: nn.ModuleList, x: torch.Tensor, off: Offloader | None) -> list[torch.Tensor]:
    for b in blocks:
        if off is None:
            x = checkpoint(b, x, use_reentrant=False)
        else:
            with off.block():
                x = checkpoint(b, x, use_reentrant=False)
    x.pow(2).sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def test_offloaded_blocks_give_the_same_gradients_and_release_finished_steps() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
    off = Offloader()
    for step in range(3):  # several steps through one offloader: the chain restarts each time
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        want = _run(blocks, x, None)
        blocks.zero_grad()
        got = _run(blocks, x, off)
        blocks.zero_grad()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        last = off._last
        assert last is not None and last.prev is None  # the backward cut the chain behind it
        assert all(s.used for s in last.items)
