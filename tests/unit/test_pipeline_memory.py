"""The memory of each pp rank (quantmesh.pipeline.memory): the stages share the model's weights
out, activations follow the schedule's micro-batches in flight, logits live on the last stage."""

from __future__ import annotations

import argparse

import pytest

import quantmesh as qm
from quantmesh.cli.plan_cmd import plan_report
from quantmesh.pipeline.memory import estimate_stages, in_flight
from quantmesh.plan.memory import estimate_memory


def _skeleton(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)  # fmt: skip
    with qm.empty_model():
        return LlamaForCausalLM(cfg)


def test_in_flight_per_schedule():
    assert [in_flight("gpipe", 4, r, 8) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 2, 1]
    assert [in_flight("interleaved1f1b", 2, r, 8, 2) for r in range(2)] == [5, 3]
    with pytest.raises(ValueError, match="use one of"):
        in_flight("zb", 2, 0, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_split_the_whole_models_estimate(schedule):
    model = _skeleton()
    kw = dict(quant="nf4", lora=qm.LoraConfig(r=8), seq_len=64, micro_batch=1)
    whole = estimate_memory(model, **kw)
    ranks = estimate_stages(model, pp=2, microbatches=4, schedule=schedule, **kw)
    assert [r.stages for r in ranks] == [[0], [1]] and [r.blocks for r in ranks] == [2, 2]
    assert sum(r.estimate.weights for r in ranks) == whole.weights  # every weight on one stage
    assert sum(r.estimate.lora for r in ranks) == whole.lora
    assert [r.estimate.logits for r in ranks] == [0, whole.logits]
    half = whole.activations / 2  # one micro-batch's activations of 2 of the 4 layers
    flight = [4, 4] if schedule == "gpipe" else [2, 1]
    assert [r.estimate.activations for r in ranks] == [int(half * f) for f in flight]


def test_plan_report_shows_the_stages():
    args = argparse.Namespace(tp=1, dp=1, pp=2, microbatches=4, pp_schedule="1f1b", pp_virtual=1,
                              quant="nf4", lora_r=8, lora_targets=None, lora_dropout=0.0, seq=64,
                              micro_batch=1, device="cpu")  # fmt: skip
    text = plan_report(_skeleton(), args)
    assert "Pipeline: pp=2 (1f1b, 4 micro-batches of 1)" in text
    rows = [ln.split() for ln in text.splitlines() if ln[:2] in ("0 ", "1 ")]
    assert [r[:4] for r in rows] == [["0", "0", "2", "2"], ["1", "1", "2", "1"]]
