"""Clear errors for LoRA and quantization requests, raised before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantmesh as qm
from quantmesh.testing import run_ranks


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def test_lora_rank_must_be_positive():
    with pytest.raises(qm.LoraError, match=r"LoRA rank r=0; use a positive int"):
        qm.LoraConfig(r=0)
    with pytest.raises(qm.LoraError, match=r"r=-4"):
        qm.LoraConfig(r=-4)


def test_lora_dropout_range():
    with pytest.raises(qm.LoraError, match=r"dropout=1.5; use a value in \[0, 1\)"):
        qm.LoraConfig(dropout=1.5)


def test_lora_target_matching_nothing_names_the_linears():
    from quantmesh.lora import lora_targets

    with pytest.raises(
        qm.LoraError,
        match=r"LoRA target 'q_proj' matches no module of TinyCNN; "
        r"linear layer names in this model: head",
    ):
        lora_targets(TinyCNN(), qm.LoraConfig(targets=["q_proj"]))


def _errors(rank):
    mesh = qm.init_mesh(tp=1)
    out = {}
    try:
        qm.parallelize(TinyCNN(), mesh, lora=qm.LoraConfig(targets=["conv"]))
    except qm.LoraError as e:
        out["lora_conv"] = str(e)
    try:
        qm.parallelize(TinyCNN(), mesh, quant=qm.QuantConfig(format="nf4", targets=["conv"]))
    except qm.QuantError as e:
        out["quant_conv"] = str(e)
    m = TinyCNN()
    qm.parallelize(m, mesh, quant="nf4")  # default targets: every linear; the conv stays float
    out["conv_dtype"] = str(m.conv.weight.dtype)
    out["head_quant"] = type(m.head).__name__
    try:
        qm.parallelize(TinyCNN(), mesh, lora={"r": 4})
    except qm.LoraError as e:
        out["lora_dict"] = str(e)
    return out


def test_parallelize_errors():
    out = run_ranks(_errors, 1, timeout=120)[0]
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
