"""checkpoint_blocks(tile_tokens=...): position-wise children are proven so before they are tiled,
and tiling changes no value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantmesh as qm
from tests.models import Stack


class _Mix(nn.Module):
    """Not position-wise: each token sees the running sum of the tokens before it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.cumsum(dim=1))


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mix = _Mix(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x) + self.mix(x)


def _net(n: int = 3, d: int = 8) -> Stack:
    return Stack(_Block, n=n, d=d)


def _grads(net: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    net(x).pow(2).mean().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_only_position_wise_children_are_tiled_and_values_do_not_change() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 21, 8)
    net = _net()
    want = _grads(net, x)
    net.zero_grad()
    qm.checkpoint_blocks(net, tile_tokens=4)
    with pytest.warns(UserWarning, match=r"keeps _Block\.mix \(_Mix\) whole"):
        got = _grads(net, x)
    assert [b.__dict__["_quantmesh_tiled"] for b in net.layers] == [["mlp"]] * 3
    # a weight's gradient is summed tile by tile instead of over all 21 tokens at once: fp32
    # rounding of a reordered sum (seen: 6.4e-6 on one element of a gradient near 0.35)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)


def test_tile_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tile_tokens=0"):
        qm.checkpoint_blocks(_net(), tile_tokens=0)
