"""The chunked causal-LM loss (train/loss.py): equal to the plain loss, bounded logits, and a
fallback (with a warning) for models whose logits are more than their head's output."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quantmesh.train.loss import chunked_loss_sum, plain_loss_sum
from tests.models import llama, token_ids


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_chunked_equals_plain_loss_and_gradients() -> None:
    ids = token_ids(100, batch=2, length=21)
    labels = ids.clone()
    labels[0, :5] = -100  # an ignored span
    ref = llama()
    total, n = plain_loss_sum(ref, ids, labels)
    (total / n).backward()
    model = llama()
    got, m = chunked_loss_sum(model, ids, labels, chunk_tokens=4)
    (got / m).backward()
    assert m == n
    torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-5)
    for g, w in zip(_grads(model), _grads(ref), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


class _RowCounter:
    """Records the most rows (tokens) the output head saw in one call."""

    def __init__(self, head: nn.Module) -> None:
        self.most = 0
        head.register_forward_hook(self._hook)

    def _hook(self, _m: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        self.most = max(self.most, args[0].numel() // args[0].shape[-1])


def test_the_first_call_check_never_holds_more_logits_than_a_chunk() -> None:
    model = llama()
    rows = _RowCounter(model.get_output_embeddings())
    ids = token_ids(100, batch=2, length=40)
    chunked_loss_sum(model, ids, ids, chunk_tokens=8)  # check (plain on a prefix), then chunked
    assert rows.most == 8, rows.most


class _SoftCapped(nn.Module):
    """A causal LM whose logits are its head's output scaled (as Gemma 2's soft-capping changes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = llama()

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False):  # noqa: ANN201
        out = self.inner(input_ids=input_ids, use_cache=use_cache)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out


def test_a_model_whose_logits_are_not_its_heads_output_falls_back_to_the_plain_loss() -> None:
    model = _SoftCapped()
    ids = token_ids(100, batch=2, length=12)
    with pytest.warns(UserWarning, match="logits are more than its output head"):
        got, n = chunked_loss_sum(model, ids, ids, chunk_tokens=4)
    want, m = plain_loss_sum(model, ids, ids)
    assert (n, got.item()) == (m, pytest.approx(want.item(), rel=1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then the plain loss silently by decision
        chunked_loss_sum(model, ids, ids, chunk_tokens=4)
