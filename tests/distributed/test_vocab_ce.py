"""Vocab-parallel cross-entropy: the loss from each tp rank's own columns equals the loss on the
gathered logits, and so do its gradients.

One launch of 3 ranks (uneven columns: 128 vocabulary rows are 43 + 43 + 42):
- the function itself on random logits, each rank handed its columns: the summed loss and the
  logits' gradient (gathered) against F.cross_entropy on the whole matrix, in fp64;
- the chunked loss of a tiny Llama at tp=3 with LoRA (head with and without a frozen bias, LoRA
  on the head too): its loss and every adapter gradient against the plain loss's, and the head
  never gathers its logits in the chunked loss (gathers counted).
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.distributed._lora_cases import TARGETS, VOCAB, tiny_llama, whole_lora
from tests.models import nonzero_lora_b_


def _function_case(rank: int, group) -> dict:
    import torch.nn.functional as F

    from quantmesh.tp.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(5)
    z = (4 * torch.randn(37, VOCAB, generator=g)).double()  # the same on every rank
    t = torch.randint(0, VOCAB, (37,), generator=g)
    want_full = z.clone().requires_grad_(True)
    want = F.cross_entropy(want_full, t, reduction="sum")
    want.backward()
    sizes = [43, 43, 42]
    start = sum(sizes[:rank])
    mine = z[:, start : start + sizes[rank]].clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(mine, t, start, group)
    (2.5 * got).backward()  # a scaled upstream gradient
    grad_err = (mine.grad - 2.5 * want_full.grad[:, start : start + sizes[rank]]).abs().max()
    return {"loss_err": abs(got.item() - want.item()) / want.item(), "grad_err": grad_err.item()}


def _model_case(mesh, bias: bool, head_lora: bool) -> dict:
    import quantmesh as qm
    import quantmesh.tp.layers as layers
    from quantmesh.train.loop import loss_sum

    model = tiny_llama()
    if bias:  # a head with a (frozen) bias: its slice is added to this rank's columns
        head = torch.nn.Linear(128, VOCAB, bias=True)
        torch.nn.init.normal_(head.bias, std=0.5)
        model.lm_head = head
    targets = TARGETS + (["lm_head"] if head_lora else [])
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4, targets=targets))
    # B random, not constant: with the same B in every output row, the head's A gradient is
    # sum_j (softmax - onehot)_j = 0 up to rounding, and the test would compare noise
    nonzero_lora_b_(model)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))
    out = {}
    gathers = []
    real = layers.gather_from_tp

    def counting(x, *a, **k):
        gathers.append(tuple(x.shape))
        return real(x, *a, **k)

    for name, chunk in (("plain", 0), ("chunked", 7)):
        model.zero_grad(set_to_none=True)
        layers.gather_from_tp = counting
        try:
            total, n = loss_sum(model, {"input_ids": ids, "labels": ids}, chunk)
            (total / n).backward()
        finally:
            layers.gather_from_tp = real
        out[name] = (float(total), whole_lora(model), len(gathers))
        gathers.clear()
    (lp, gp, n_plain), (lc, gc, n_chunked) = out["plain"], out["chunked"]
    err = max(((gc[k] - v).abs().max() / v.abs().max()).item() for k, v in gp.items())
    return {
        "loss_err": abs(lc - lp) / abs(lp),
        "grad_err": err,
        "head_lora": any("lm_head" in k for k in gp),
        "gathers": (n_plain, n_chunked),
        "local_output_reset": not model.lm_head.local_output,
    }


def _unlabelled_case(mesh) -> dict:
    """A micro-batch without one labelled token, through the chunked loss of a split head: it
    returned a zero outside the graph, and its backward raised ("element 0 of tensors does not
    require grad"; a packed example of prompt tokens alone does it). Its gradients are zero:
    the step equals the same batch in one micro-batch."""
    import quantmesh as qm

    model = tiny_llama()
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4, targets=TARGETS))
    nonzero_lora_b_(model)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[1] = -100  # the second micro-batch: prompt tokens only
    grads = []
    for microbatches in (2, 1):
        model.zero_grad(set_to_none=True)
        batch = {"input_ids": ids, "labels": labels}
        loss = qm.train_step(model, batch, microbatches=microbatches, chunk_tokens=7)
        grads.append((float(loss), whole_lora(model)))
    (l2, g2), (l1, g1) = grads
    err = max(((g2[k] - v).abs().max() / v.abs().max()).item() for k, v in g1.items())
    return {"loss_err": abs(l2 - l1) / abs(l1), "grad_err": err}


def _rank(rank: int) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=3)
    out = {"function": _function_case(rank, mesh.tp_group), "unlabelled": _unlabelled_case(mesh)}
    for bias in (False, True):
        for head_lora in (False, True):
            out[(bias, head_lora)] = _model_case(mesh, bias, head_lora)
    return out


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    return run_ranks(_rank, 3, timeout=600)


def test_the_function_equals_cross_entropy_on_the_whole_logits(facts: list[dict]) -> None:
    for rank, f in enumerate(facts):
        got = f["function"]
        assert got["loss_err"] < 1e-12 and got["grad_err"] < 1e-12, (rank, got)


def test_a_micro_batch_without_labels_adds_nothing_and_does_not_fail(facts: list[dict]) -> None:
    for rank, f in enumerate(facts):
        got = f["unlabelled"]
        assert got["loss_err"] < 1e-6 and got["grad_err"] < 1e-5, (rank, got)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head_lora", [False, True])
def test_the_chunked_loss_needs_no_gather_and_changes_nothing(
    facts: list[dict], bias: bool, head_lora: bool
) -> None:
    for rank, f in enumerate(facts):
        got = f[(bias, head_lora)]
        assert got["loss_err"] < 1e-6 and got["grad_err"] < 1e-5, (rank, got)
        assert got["head_lora"] == head_lora, got
        # the plain loss gathers the head's logits once; the chunked one never does (the first
        # call's check runs the plain head on a prefix: one gather)
        plain, chunked = got["gathers"]
        assert plain >= 1 and chunked <= 1, got["gathers"]
        assert got["local_output_reset"]
