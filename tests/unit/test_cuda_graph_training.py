"""Training with blocks replayed from CUDA graphs (`finetune --cuda-graphs`), what a CPU can check:
which compiles replay graphs (`replays_cuda_graphs`), and that `train_step` then keeps every
gradient in memory of its own before the first backward (the graph trees' pool is reused by the
next replay). The replay itself runs in tests/distributed/test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantmesh.blocks.compile import compile_blocks, replays_cuda_graphs


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


@pytest.mark.parametrize(
    ("kwargs", "replays"),
    [
        ({}, False),
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"mode": "reduce-overhead", "backend": "aot_eager"}, False),
    ],
)
def test_which_compiles_replay_cuda_graphs(kwargs: dict, replays: bool, monkeypatch) -> None:
    """Compiling is lazy: nothing runs here, the recorded keywords say it. Without a backend the
    one quantmesh picks is used: inductor here (make test picks aot_eager, which has no modes)."""
    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "inductor")
    model = _Blocks()
    assert not replays_cuda_graphs(model)
    compile_blocks(model, **kwargs)
    assert replays_cuda_graphs(model) is replays


@pytest.mark.parametrize(("mode", "marks"), [("reduce-overhead", 3), ("default", 0)])
def test_each_forward_begins_a_graph_step_when_blocks_replay(mode: str, marks: int,
                                                             monkeypatch) -> None:  # fmt: skip
    """A model whose blocks replay CUDA graphs marks a new step of the graph trees as each forward
    starts (an evaluation under no_grad, the next micro-batch: without it torch raised on a GPU
    that a block's output had been overwritten), once per forward however often compile_blocks
    ran; a model compiled otherwise marks nothing. The blocks run eagerly here (compile_module
    stubbed: the marks are the question, not inductor on CPU). A forward traced whole marks
    nothing."""
    import quantmesh.blocks.compile as bc

    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(bc, "compile_module", lambda block, kwargs: None)
    seen: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: seen.append(1))
    model = _Blocks()
    compile_blocks(model, mode=mode)
    compile_blocks(model, mode=mode)  # again: still one mark a forward
    x = torch.randn(2, 8)
    model(x).sum().backward()
    with torch.no_grad():
        model(x)
        model(x)
    assert len(seen) == marks
    # a forward traced whole (as fast_decode compiles its step) marks nothing, and does not break
    torch._dynamo.reset()
    traced = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        traced(x)
    assert len(seen) == marks
    # compiled again without graphs: no mark any more
    compile_blocks(model)
    model(x)
    assert len(seen) == marks


def test_train_step_owns_the_gradients_when_blocks_replay_graphs(monkeypatch) -> None:
    """With graphs replayed, every trainable parameter gets a .grad of its own (zeros) before the
    first micro-batch's backward, which then adds into it in place: after the step each .grad is
    that same tensor, holding the gradient of the step (equal to the one without graphs)."""
    import quantmesh as qm
    from quantmesh.train import step

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    class Model(_Blocks):
        def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
            return super().forward(self.embed(input_ids))

    torch.manual_seed(0)
    model = Model()
    model.embed = nn.Embedding(16, 8)
    model.embed.weight.requires_grad_(False)
    ids = torch.randint(0, 16, (4, 6))
    batch = {"input_ids": ids, "labels": ids}
    qm.train_step(model, batch, microbatches=2, loss_fn=loss_fn)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(step, "replays_cuda_graphs", lambda m: m is model)
    given: dict[str, torch.Tensor] = {}
    real_backward = torch.Tensor.backward

    def backward(self: torch.Tensor, *a: object, **k: object) -> None:
        if not given:  # the first micro-batch: what .grad holds before its backward
            given.update({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
        real_backward(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    qm.train_step(model, batch, microbatches=2, loss_fn=loss_fn)
    assert given and all(g is not None for g in given.values()), given
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is given[n], n  # added into in place, never replaced
            torch.testing.assert_close(p.grad, want[n])
    assert model.embed.weight.grad is None


@pytest.mark.parametrize("env", ["", "0", "1"])
def test_finetune_compiles_for_graphs_and_takes_the_triton_dequantize(
    env: str, monkeypatch
) -> None:
    """`finetune --cuda-graphs` (`worker.compile_for_training`): the blocks compiled to replay
    graphs, and Triton's dequantize under autograd unless $QUANTMESH_TRITON_DEQUANT_TRAINING says
    otherwise; without the flag neither."""
    from quantmesh.cli.worker import compile_for_training
    from quantmesh.quant import kernel4

    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "inductor")
    monkeypatch.setenv("QUANTMESH_TRITON_DEQUANT_TRAINING", env)
    monkeypatch.setattr(kernel4, "DEQUANT_TRAINING", env == "1")  # as read at import
    plain, graphs = _Blocks(), _Blocks()
    assert compile_for_training(plain) == 2
    assert not replays_cuda_graphs(plain) and kernel4.DEQUANT_TRAINING is (env == "1")
    assert compile_for_training(graphs, cuda_graphs=True) == 2
    assert replays_cuda_graphs(graphs) and kernel4.DEQUANT_TRAINING is (env != "0")
