"""Pipeline stages without processes: where plan_stages cuts, what it refuses, what a stage keeps
after drop_others, and the stages run one after another in one process giving the model's own
logits (the multi-rank schedules live in tests/distributed/test_pipeline.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantmesh as qm
from quantmesh.pipeline.cut import PipelineError, check_ties, drop_others, plan_stages
from quantmesh.pipeline.stage import StageModule, call_model, logits_of
from tests import models as M


def test_balanced_cut_of_a_llama():
    cut = plan_stages(M.llama(layers=5), 2)
    assert cut.blocks == [
        [f"model.layers.{i}" for i in range(3)],
        ["model.layers.3", "model.layers.4"],
    ]
    assert cut.stage_of("model.embed_tokens") == 0
    assert cut.stage_of("model.layers.1.self_attn.q_proj") == 0
    assert cut.stage_of("model.norm") == 1 and cut.stage_of("lm_head") == 1
    assert cut.stage_of("model.rotary_emb") is None  # no parameters: runs on every stage


def test_override_and_its_errors():
    model = M.llama(layers=4)
    assert plan_stages(model, 2, qm.PipelineConfig(stages=[3, 1])).blocks[1] == ["model.layers.3"]
    with pytest.raises(
        PipelineError,
        match=r"expected 2 counts >= 1 summing to the model's 4 blocks, e.g. stages=\[2, 2\]",
    ):
        plan_stages(model, 2, qm.PipelineConfig(stages=[4, 0]))
    with pytest.raises(
        PipelineError, match="has 4 blocks; every stage needs at least one: use pp <= 4"
    ):
        plan_stages(model, 8)


def test_models_that_cannot_be_cut():
    with pytest.raises(PipelineError, match="no repeated blocks"):
        plan_stages(M.mlp(), 2)
    with pytest.raises(PipelineError, match="several block lists"):
        plan_stages(M.nmt(), 2)

    class RootParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    with pytest.raises(PipelineError, match="root module holds parameter 'scale'"):
        plan_stages(RootParam(), 2)


def test_trainable_tie_across_stages_is_refused_frozen_is_kept():
    model = M.llama(layers=2, tie=True)
    cut = plan_stages(model, 2)
    with pytest.raises(PipelineError, match="tie_word_embeddings=False"):
        check_ties(model, cut, trainable=True)
    check_ties(model, cut, trainable=False)  # LoRA freezes the tie: both stages hold a copy


def test_a_stage_keeps_only_its_parameters_under_their_names():
    model = M.tiny_gpt(layers=4)
    names = set(model.state_dict())
    cut = plan_stages(model, 2)
    drop_others(model, cut, 1, torch.device("cpu"))
    kept = set(model.state_dict())
    assert kept < names
    assert {n.split(".")[0] for n in kept} == {"blocks", "ln_f", "head"}
    assert not any(n.startswith(("blocks.0.", "blocks.1.")) for n in kept)
    with pytest.raises(PipelineError, match="run the model through qm.train_step"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("build", [lambda: M.llama(layers=4, tie=False), lambda: M.tiny_gpt(layers=4)],
                         ids=["llama", "tiny_gpt"])  # fmt: skip
def test_stages_in_sequence_give_the_models_logits(build):
    whole = build()
    ids = torch.randint(0, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    want = logits_of(call_model(whole, ids))
    cut = plan_stages(whole, 3)
    x = ids
    for s in range(3):
        part = copy.deepcopy(whole)
        drop_others(part, cut, s, torch.device("cpu"))
        x = StageModule(part, cut, s)(x, input_ids=ids)
    assert torch.equal(x, want)


class _SideInput(nn.Module):
    """Blocks that read a learned table from outside the blocks by another path than the hidden
    state: that table lives on stage 0 only, so a cut would feed the later blocks its NaN stand-in."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.bias = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids):
        x, b = self.emb(ids), self.bias(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x) + b
        return x


def test_a_value_from_another_stage_shows_as_nan_never_as_a_number():
    model = _SideInput()
    ids = torch.randint(0, 50, (2, 5))
    cut = plan_stages(model, 2)
    part0, part1 = copy.deepcopy(model), copy.deepcopy(model)
    drop_others(part0, cut, 0, torch.device("cpu"))
    drop_others(part1, cut, 1, torch.device("cpu"))
    h = StageModule(part0, cut, 0)(ids, input_ids=ids)
    out = StageModule(part1, cut, 1)(h, input_ids=ids)
    assert torch.isnan(out).all()  # train_step's first-step check turns this into PipelineError


def test_train_step_without_a_mesh_accumulates_exactly():
    ids = torch.randint(0, 90, (4, 6), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (1, 4):
        model = M.tiny_gpt(layers=2)
        loss = qm.train_step(model, {"input_ids": ids, "labels": ids}, microbatches=m)
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    (l1, g1), (l4, g4) = grads
    assert torch.allclose(l1, l4, rtol=1e-6)
    for a, b in zip(g1, g4, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="does not split into microbatches=3 equal parts"):
        qm.train_step(model, {"input_ids": ids}, microbatches=3)
    with pytest.raises(ValueError, match="schedule='zb'; use one of gpipe, 1f1b"):
        qm.train_step(model, {"input_ids": ids}, schedule="zb")


def test_a_stand_in_runs_the_meta_forward_once_per_input_signature():
    from quantmesh.pipeline.cut import StandIn, active

    calls = []
    lin = nn.Linear(8, 3, device="meta")
    lin.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    s = StandIn("x", lin, 0, torch.device("cpu"))
    with active(object()):
        a = s(torch.zeros(2, 8))
        b = s(torch.zeros(2, 8))
        c = s(torch.zeros(5, 8))
    assert calls == [(2, 8), (5, 8)]
    assert a.shape == b.shape == (2, 3) and c.shape == (5, 3)
    assert torch.isnan(a).all() and a is not b  # fresh tensors every call


class _HeavyHead(nn.Module):
    """Four equal blocks and an output head as costly as two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_default_cut_balances_compute_with_the_head_on_the_last_stage():
    # equal counts would give the last stage 2 blocks + the head (4 units) against 2: 3 + 1 gives 3
    cut = plan_stages(_HeavyHead(), 2)
    assert [len(b) for b in cut.blocks] == [3, 1]
    assert cut.stage_of("head") == 1
    # a small head changes nothing: equal counts, extras on the first stages
    assert [len(b) for b in plan_stages(M.llama(layers=7), 3).blocks] == [3, 2, 2]
