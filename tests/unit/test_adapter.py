"""The adapter a sharded layer owns: set, replaced and removed through `set_adapter` only, with
PEFT's parameter names, on one rank (no process group: an unsplit layer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantmesh.lora.adapter import Adapter, LoraAdapter, LoraConfig, LoraError, attach_lora
from quantmesh.tp.kinds import kind_of
from quantmesh.tp.layers import ShardedModule


def _layer(orig: nn.Module) -> ShardedModule:
    kind = kind_of(orig)
    assert kind is not None  # a Linear or an Embedding
    m = ShardedModule.build(orig, "m", kind, "replicate", None, rank=0, group=None,
                            device=torch.device("cpu"))  # fmt: skip
    m.fill_from(orig)
    return m


def _adapted() -> tuple[nn.Linear, ShardedModule]:
    torch.manual_seed(0)
    orig = nn.Linear(8, 6)
    m = _layer(orig)
    attach_lora(m, LoraConfig(r=2, alpha=6), device="cpu")
    lora = m.lora
    assert lora is not None  # attached
    with torch.no_grad():
        lora.lora_B.weight.normal_()  # B starts at zero: make the delta show
    return orig, m


def test_the_adapter_keeps_peft_names_and_adds_its_delta() -> None:
    orig, m = _adapted()
    assert list(m.state_dict()) == ["weight", "bias", "lora_A.weight", "lora_B.weight"]
    assert [n for n, _ in m.named_modules()] == ["", "lora_A", "lora_B", "lora_dropout"]
    lora = m.lora
    assert lora is not None and m.adapter is lora and (lora.r, lora.scale) == (2, 3.0)
    x = torch.randn(4, 8)
    want = orig(x) + lora.lora_B(lora.lora_A(x)) * 3.0
    assert torch.equal(m(x), want)


def test_a_retuned_adapter_shares_its_factors_and_a_removed_one_leaves() -> None:
    orig, m = _adapted()
    old = m.lora
    assert old is not None
    m.set_adapter(old.retuned(scale=0.5, dropout=0.25))
    new = m.lora
    assert new is not None and new is not old
    assert new.lora_A is old.lora_A and new.lora_B is old.lora_B  # the same parameters
    assert isinstance(m.lora_dropout, nn.Dropout) and new.dropout == 0.25
    assert list(m.state_dict()) == ["weight", "bias", "lora_A.weight", "lora_B.weight"]
    m.eval()
    assert not new.lora_dropout.training  # the layer's mode reaches the adapter
    x = torch.randn(4, 8)
    assert torch.equal(m(x), orig(x) + new.lora_B(new.lora_A(x)) * 0.5)
    m.set_adapter(None)
    assert m.adapter is None and list(m.state_dict()) == ["weight", "bias"]
    assert list(m.children()) == []
    assert torch.equal(m(x), orig(x))


def test_only_set_adapter_sets_it() -> None:
    _, m = _adapted()
    for name in ("adapter", "lora"):
        with pytest.raises(AttributeError, match="set_adapter"):
            setattr(m, name, LoraAdapter.new(torch.zeros(2, 8), 6, scale=1.0))


def test_a_layer_that_is_not_linear_refuses_an_adapter() -> None:
    m = _layer(nn.Embedding(10, 4))
    with pytest.raises(LoraError, match="LoRA applies to linear layers only"):
        attach_lora(m, LoraConfig(r=2), device="cpu")
    assert m.adapter is None


class _Buffered(Adapter):
    """An adapter of tensors of its own (as the server's bank has): they move with the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a_t", torch.ones(2, 8), persistent=False)
        self.register_buffer("b_t", torch.ones(6, 2), persistent=False)

    @property
    def r(self) -> int:
        return 2

    @property
    def dtype(self) -> torch.dtype:
        return self.a_t.dtype

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a_t.t()

    def up(self, a: torch.Tensor) -> torch.Tensor:
        return a @ self.b_t.t()


def test_an_adapter_of_its_own_tensors_moves_with_the_layer() -> None:
    orig = nn.Linear(8, 6)
    m = _layer(orig)
    m.set_adapter(_Buffered())
    assert list(m.state_dict()) == ["weight", "bias"]  # not saved, not a parameter
    m.double()
    ad = m.adapter
    assert isinstance(ad, _Buffered) and ad.a_t.dtype == ad.b_t.dtype == torch.float64
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(m(x), orig.double()(x) + (x @ ad.a_t.t()) @ ad.b_t.t())


def test_one_row_compiled_without_autograd_takes_lean_products() -> None:
    """`lean_linear`: one row in a graph compiled without autograd is a product and a sum (no
    matmul in the graph), the same values to fp32 rounding, the layer's whole forward too; two
    rows, autograd, eager calls, a factor with a hook of its own and LEAN_ROWS off keep the
    matmul."""
    from quantmesh.lora import adapter

    _, m = _adapted()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def matmuls(gm: torch.fx.GraphModule) -> int:
        names = ("linear", "addmm", "mm", "matmul", "bmm")
        return sum(
            1 for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ in names
        )

    def lora_delta(x: torch.Tensor) -> torch.Tensor:
        ad = m.lora
        assert ad is not None
        return ad.up(ad.down(x))

    x1 = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = lora_delta(x1)
        lean = torch.compile(lora_delta, backend=backend, fullgraph=True)(x1)
        assert matmuls(graphs[-1]) == 0
        torch.testing.assert_close(lean, eager, rtol=1e-6, atol=1e-6)
        whole = torch.compile(m, backend=backend, fullgraph=True)(x1)
        assert matmuls(graphs[-1]) == 1  # the base layer's own
        torch.testing.assert_close(whole, m(x1), rtol=1e-6, atol=1e-6)
        two = torch.randn(2, 1, 8)
        torch.compile(lora_delta, backend=backend, fullgraph=True, dynamic=False)(two)
        assert matmuls(graphs[-1]) == 2  # two rows: the adapter's two matmuls
        saved = adapter.LEAN_ROWS
        adapter.LEAN_ROWS = False
        try:
            torch._dynamo.reset()
            torch.compile(lora_delta, backend=backend, fullgraph=True)(x1)
            assert matmuls(graphs[-1]) == 2
        finally:
            adapter.LEAN_ROWS = saved
            torch._dynamo.reset()
        ad = m.lora
        assert ad is not None
        seen: list[bool] = []
        hook = ad.lora_A.register_forward_pre_hook(lambda mod, args: seen.append(True))
        try:
            torch._dynamo.reset()
            torch.compile(lora_delta, backend=backend, fullgraph=True)(x1)
            assert matmuls(graphs[-1]) == 1 and seen  # A called as a module: its hook runs
        finally:
            hook.remove()
            torch._dynamo.reset()
    w = torch.randn(3, 8)
    assert torch.equal(adapter.lean_linear(x1, w), nn.functional.linear(x1, w))  # eager
    y = torch.compile(lora_delta, backend=backend, fullgraph=True)(x1)  # autograd on
    assert matmuls(graphs[-1]) == 2 and y.requires_grad


def test_low_rank_gives_the_delta_as_a_launch_adds_it_and_never_makes_it_while_traced(
    monkeypatch,
) -> None:
    """`LoraAdapter.low_rank` (the adapter's delta as the 4-bit gemv adds it in its launch): B's
    rows, zero columns, its scale, A as `down`; none under autograd, with an active dropout or
    for bf16 factors; its tensors made in an eager call and kept, never while a graph is traced
    (there it gives None: the delta stays outside the launch). The CPU joins the kernels'
    devices here, as in the interpreter's tests (elsewhere a CPU adapter makes none)."""
    from quantmesh.quant import kernel4

    monkeypatch.setattr(kernel4, "GEMV_LORA_ENABLED", True)
    monkeypatch.setattr(kernel4, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(kernel4, "_HAS_TRITON", True)
    _, m = _adapted()
    lora = m.lora
    assert isinstance(lora, LoraAdapter)
    x = torch.randn(1, 8)
    assert lora.low_rank() is None  # autograd on

    def traced(x: torch.Tensor):
        lr = lora.low_rank()
        return x if lr is None else x + lr.scale.sum()

    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), x)  # no tensors yet: None while traced, none made
        assert "_low_rank_vectors" not in lora.__dict__ or not lora.__dict__["_low_rank_vectors"]
        lr = lora.low_rank()  # eager: made and kept
        assert lr is not None and lr.e is lora.lora_B.weight and lr.whole is None
        assert lr.col.dtype == torch.int32 and not lr.col.any()
        assert torch.equal(lr.scale, torch.full((6,), lora.scale))
        assert torch.allclose(lr.down(x), x @ lora.lora_A.weight.t())
        again = lora.low_rank()
        assert again is not None and again.col is lr.col and again.scale is lr.scale
        torch._dynamo.reset()
        assert torch.equal(compiled(x), x + 6 * lora.scale)  # kept: the traced call has them
        drop = lora.retuned(scale=lora.scale, dropout=0.1).train()
        assert drop.low_rank() is None  # an active dropout
        assert drop.eval().low_rank() is not None  # (eval: none)
        lora.to(torch.bfloat16)
        assert lora.low_rank() is None  # bf16 factors: their delta is not the launch's fp32 one
