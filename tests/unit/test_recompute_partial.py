"""checkpoint_blocks(blocks=k): only k blocks are recomputed (spread over all but the last), the
values do not change, and calling it again moves the choice (a block left out runs as before,
compiled if compile_blocks asked)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantmesh as qm
from quantmesh.blocks.recompute import is_checkpointed, spread
from tests.models import Stack


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # a checkpointed block runs twice per step: forward and recompute
        return x + self.mlp(x).tanh()


def _net(n: int = 4, d: int = 8) -> Stack:
    return Stack(_Block, n=n, d=d)


def _step(net: Stack, x: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    net.zero_grad()
    for b in net.layers:
        b.calls = 0
    net(x).pow(2).mean().backward()
    return [p.grad.clone() for p in net.parameters()], [b.calls for b in net.layers]


def test_spread_takes_k_blocks_never_the_last_unless_all() -> None:
    for n in range(1, 40):
        for k in range(1, n + 1):
            got = spread(n, k)
            assert len(got) == k and got <= set(range(n)), (n, k, got)
            assert (n - 1 in got) == (k == n), (n, k, got)
    assert sorted(spread(32, 8)) == [3, 7, 11, 15, 19, 23, 27, 30]


def test_only_the_chosen_blocks_are_recomputed_and_values_do_not_change() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 12, 8, requires_grad=True)
    net = _net()
    want, calls = _step(net, x)
    assert calls == [1, 1, 1, 1]
    assert qm.checkpoint_blocks(net, blocks=2) == 2
    got, calls = _step(net, x)
    assert calls == [1, 2, 2, 1]  # spread(4, 2): blocks 1 and 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert qm.checkpoint_blocks(net) == 4  # again, all of them
    assert _step(net, x)[1] == [2, 2, 2, 2]
    assert qm.checkpoint_blocks(net, blocks=1, offload=True) == 1
    got, calls = _step(net, x)
    assert calls == [1, 1, 2, 1]  # spread(4, 1): block 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    # the blocks left out run their own class forward again, nothing of the checkpoint left
    for i, b in enumerate(net.layers):
        assert is_checkpointed(b) == (i == 2)
        assert ("forward" in b.__dict__) == (i == 2)
        assert ("_quantmesh_offload" in b.__dict__) == (i == 2)
    net.eval()  # evaluation runs every block once, as it is
    for b in net.layers:
        b.calls = 0
    with torch.no_grad():
        net(x)
    assert [b.calls for b in net.layers] == [1, 1, 1, 1]


def test_a_block_left_out_gets_its_tiles_and_compile_back() -> None:
    net = _net(n=3)
    qm.checkpoint_blocks(net, tile_tokens=4)
    x = torch.randn(1, 12, 8, requires_grad=True)
    _step(net, x)  # the first training call proves the MLPs position-wise and tiles them
    assert [b.__dict__.get("_quantmesh_tiled") for b in net.layers] == [["mlp"]] * 3
    qm.compile_blocks(net)  # records the compile; checkpointed blocks compile inside (lazily)
    assert all(b._compiled_call_impl is None for b in net.layers)
    qm.checkpoint_blocks(net, blocks=1, tile_tokens=4)  # spread(3, 1): block 1
    kept = [net.layers[0], net.layers[2]]
    assert all(type(b.mlp) is nn.Sequential for b in kept)  # untiled: the original class
    assert all(b._compiled_call_impl is not None for b in kept)  # compiled again, as asked
    assert net.layers[1].__dict__["_quantmesh_tiled"] == ["mlp"]
    assert type(net.layers[1].mlp) is not nn.Sequential


@pytest.mark.parametrize("k", [0, 5, -1])
def test_blocks_out_of_range_is_refused_before_anything_changes(k: int) -> None:
    net = _net()
    with pytest.raises(ValueError, match=rf"blocks={k}\): Stack has 4 blocks; pass 1 to 4"):
        qm.checkpoint_blocks(net, blocks=k)
    assert not any(is_checkpointed(b) for b in net.layers)


@pytest.mark.parametrize("lean", [True, False])
def test_compiled_blocks_let_the_partitioner_recompute_only_while_they_compile(lean) -> None:
    """compile_blocks(recompute_elementwise=...) turns AOTAutograd's ban on recomputing what the
    backward holds for a matmul off while a block's graph is made (the backend runs inside the
    call), and leaves the process's setting as it was around and after every call."""
    import torch._functorch.config as aot_config

    seen: list[bool] = []

    def backend(gm, example_inputs):
        seen.append(aot_config.ban_recompute_materialized_backward)
        return gm.forward

    net = _net(n=3)
    assert qm.compile_blocks(net, backend=backend, recompute_elementwise=lean) == 3
    before = aot_config.ban_recompute_materialized_backward
    _step(net, torch.randn(1, 12, 8, requires_grad=True))
    assert seen and set(seen) == {not lean}  # one graph for the three blocks (or more), each so
    assert aot_config.ban_recompute_materialized_backward is before
