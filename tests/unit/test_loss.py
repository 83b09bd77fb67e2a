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


def test_a_frozen_head_passes_once_per_chunk_and_gives_the_plain_gradients() -> None:
    """A head that does not train (a LoRA run's): each chunk's gradient is made in the forward,
    and backward never runs the head again."""
    ids = token_ids(100, batch=2, length=21)
    labels = ids.clone()
    labels[1, 3:9] = -100
    ref = llama()
    ref.get_output_embeddings().requires_grad_(False)
    total, n = plain_loss_sum(ref, ids, labels)
    (total / n).backward()
    model = llama()
    head = model.get_output_embeddings()
    head.requires_grad_(False)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    got, m = chunked_loss_sum(model, ids, labels, chunk_tokens=4)
    ran = len(calls)
    (got / m).backward()
    assert len(calls) == ran, "backward ran the head again"
    assert m == n
    torch.testing.assert_close(got, total, rtol=1e-5, atol=1e-5)
    grads, want = _grads(model), _grads(ref)
    assert len(grads) == len(want) > 0
    for g, w in zip(grads, want, strict=True):
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


def test_the_training_step_divides_by_the_targets_with_either_loss() -> None:
    """qm.train_step (the step the training loop runs) at pp = 1: the loss is the mean over the
    next-token targets (labels[:, 1:]), not over every label, whether it is computed plain or in
    chunks and however the batch is split into micro-batches."""
    import torch.nn.functional as F

    import quantmesh as qm

    ids = token_ids(100, batch=4, length=13)
    labels = ids.clone()
    labels[0, 3:9] = -100  # an ignored span; every row's first label stays: never a target
    ref = llama()
    logits = ref(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1))
    want.backward()  # the mean over labels[:, 1:] != -100
    over_labels = want * (labels[:, 1:] != -100).sum() / (labels != -100).sum()
    assert not torch.isclose(want, over_labels)  # the two counts differ here: the test can tell
    for chunk, m in ((0, 1), (0, 2), (5, 2)):
        model = llama()
        got = qm.train_step(model, {"input_ids": ids, "labels": labels}, microbatches=m,
                            chunk_tokens=chunk)  # fmt: skip
        # fp32 sums in another order (per micro-batch, per chunk): a few ulps of the loss
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
        for g, w in zip(_grads(model), _grads(ref), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    batch = {"input_ids": ids}
    with pytest.raises(qm.QuantmeshError, match="loss_fn and chunk_tokens=4 together"):
        qm.train_step(llama(), batch, loss_fn=lambda z, y: z.sum(), chunk_tokens=4)
    with pytest.raises(ValueError, match="chunk_tokens=-1; expected >= 0"):
        qm.train_step(llama(), batch, chunk_tokens=-1)
