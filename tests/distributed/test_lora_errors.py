"""Clear errors for LoRA and quantization requests, raised before anything is allocated."""

from __future__ import annotations

import pytest
import torch

import quantmesh as qm

from ._lora_cases import TinyCNN, result


def test_lora_rank_must_be_positive():
    with pytest.raises(qm.LoraError, match=r"LoRA rank r=0; use a positive int"):
        qm.LoraConfig(r=0)
    with pytest.raises(qm.LoraError, match=r"r=-4"):
        qm.LoraConfig(r=-4)


def test_lora_dropout_range():
    with pytest.raises(qm.LoraError, match=r"dropout=1.5; use a value in \[0, 1\)"):
        qm.LoraConfig(dropout=1.5)


def test_lora_target_matching_nothing_names_the_linears():
    from quantmesh.lora.adapter import lora_targets

    with pytest.raises(
        qm.LoraError,
        match=r"LoRA target 'q_proj' matches no module of TinyCNN; "
        r"linear layer names in this model: head",
    ):
        lora_targets(TinyCNN(), qm.LoraConfig(targets=["q_proj"]))
    from tests.models import gpt2

    with pytest.raises(  # GPT-2's Conv1D layers take LoRA too: they are named (they were not)
        qm.LoraError,
        match=r"the default LoRA targets .* match no module of GPT2LMHeadModel; linear layer "
        r"names in this model: c_attn, c_fc, c_proj, lm_head;",
    ):
        lora_targets(gpt2(), qm.LoraConfig())


def test_parallelize_errors():
    # one rank, in the spawn shared with test_lora_dp.py (_lora_cases.parallelize_errors)
    out = result(("parallelize_errors",))[0]
    assert "LoRA target conv is a Conv2d; LoRA applies to linear layers only" in out["lora_conv"]
    assert "conv is a Conv2d; bitsandbytes quantizes only linear layers" in out["quant_conv"]
    assert out["conv_dtype"] == str(torch.float32)
    assert out["head_quant"] == "ShardedModule"
    assert "pass qm.LoraConfig(r=..., targets=[...])" in out["lora_dict"]


def test_quant_config_errors():
    with pytest.raises(
        qm.QuantError, match=r"quant format 'nf3' is unknown; use one of nf4, fp4, int8"
    ):
        qm.QuantConfig(format="nf3")
    with pytest.raises(qm.QuantError, match=r"blocksize=48"):
        qm.QuantConfig(blocksize=48)
