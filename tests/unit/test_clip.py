"""qm.clip_grad_norm_ on one process equals torch's own clip_grad_norm_: the same norm, and the
gradients scaled to `max_norm` when above it and left exactly as they were when not (the
distributed cases: tests/distributed, against one rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantmesh as qm


def _model_with_grads(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)
    model[0].bias.requires_grad_(False)  # a parameter without a gradient
    model(torch.randn(8, 16, dtype=dtype)).square().sum().backward()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_scales_to_the_norm_or_leaves_the_gradients(dtype, max_norm) -> None:
    model = _model_with_grads(dtype)
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(before) == 3
    true = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in before]))
    norm = qm.clip_grad_norm_(model, max_norm)
    torch.testing.assert_close(norm, true, rtol=1e-5, atol=0)  # in fp32 whatever the dtype
    after = [p.grad for p in model.parameters() if p.grad is not None]
    if max_norm > float(true):  # not clipped: the very same values
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=False))
    else:
        coef = max_norm / (float(true) + 1e-6)
        assert coef < 0.5
        for a, b in zip(after, before, strict=False):
            torch.testing.assert_close(a, (b.float() * coef).to(dtype))


def test_clip_equals_torchs_in_fp32() -> None:
    ours, ref = _model_with_grads(torch.float32), _model_with_grads(torch.float32)
    norm = qm.clip_grad_norm_(ours, 0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.testing.assert_close(norm, ref_norm)
    for a, r in zip(ours.parameters(), ref.parameters(), strict=False):
        assert (a.grad is None) == (r.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, r.grad)


def test_clip_runs_a_number_of_ops_that_does_not_grow_with_the_gradients() -> None:
    # one op per gradient (norm, then scale) cost a GPU step ~1,800 tiny kernels for a 7B model's
    # 448 LoRA gradients; the multi-tensor kernels take them all at once
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(layers: int) -> int:
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        model(torch.randn(4, 8)).square().sum().backward()
        with Count() as count:
            qm.clip_grad_norm_(model, 1e-3)
        return count.n

    assert ops(2) == ops(20)
