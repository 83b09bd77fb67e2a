"""Clear errors for LoRA and quantization requests, raised before anything is allocated."""

from __future__ import annotations

import re

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


def test_all_linear_is_peft_s_every_linear_layer_but_the_head():
    """PEFT's `target_modules="all-linear"` was refused as matching no module."""
    from quantmesh.lora.adapter import lora_targets
    from tests.models import gpt2, llama

    got = lora_targets(llama(), qm.LoraConfig(targets="all-linear"))
    leaves = {n.rsplit(".", 1)[-1] for n in got}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(got) == 7 * 2 and "lm_head" not in got
    got = lora_targets(gpt2(), qm.LoraConfig(targets=["all-linear"]))  # Conv1D layers are linear
    assert {n.rsplit(".", 1)[-1] for n in got} == {"c_attn", "c_fc", "c_proj"}
    # a model with no get_output_embeddings has no head to leave out
    assert lora_targets(TinyCNN(), qm.LoraConfig(targets="all-linear")) == ["head"]
    with pytest.raises(qm.LoraError, match=r"LoRA target 'all-linear' matches no module of "
                                           r"Sequential; it has no linear layers; pass"):  # fmt: skip
        lora_targets(torch.nn.Sequential(torch.nn.ReLU()), qm.LoraConfig(targets="all-linear"))


def test_a_selected_module_that_is_not_linear_is_refused_where_targets_are_read():
    """A target selecting a non-linear module (`mlp`: a MoE block) passed `plan` and finetune's
    checks before launch and failed on rank 0 after loading; experts modules are selectable."""
    import transformers as tf

    from quantmesh.tp.experts import select_lora

    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    with pytest.raises(qm.LoraError, match=re.escape(
            "LoRA target model.layers.0.mlp is a MixtralSparseMoeBlock, selected by ['mlp']; LoRA "
            "applies to linear layers (and the expert tensors of experts modules) only; narrow "
            "LoraConfig(targets=...) (CLI: --lora-targets)")):  # fmt: skip
        select_lora(model, qm.LoraConfig(targets=["q_proj", "mlp"]))
    selected, adapted = select_lora(model, qm.LoraConfig(targets=["experts"]))
    assert adapted == {"model.layers.0.mlp.experts": ["gate_up_proj", "down_proj"]}


def test_expert_tensors_of_an_undeclared_layout_take_no_adapter():
    """Llama 4's experts ((E, H, 2I), read by bmm, no is_transposed) are split and quantized by
    their shapes, but PEFT reads such tensors as (E, out, in): adapters on them are refused by
    name and left out of the default targets, with a warning."""
    import warnings

    import transformers as tf

    from quantmesh.tp.experts import select_lora

    cfg = tf.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                              intermediate_size_mlp=32, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, num_local_experts=4)  # fmt: skip
    with torch.device("meta"):
        model = tf.Llama4ForCausalLM(cfg)
    with pytest.raises(qm.LoraError, match="Llama4TextExperts .* does not declare is_transposed"):
        select_lora(model, qm.LoraConfig(targets=["q_proj", "gate_up_proj"]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        selected, adapted = select_lora(model, qm.LoraConfig())
    assert adapted == {} and not any("experts." in n for n in selected), selected
    assert "model.layers.0.self_attn.q_proj" in selected
    assert any("default LoRA targets leave out expert tensors" in str(x.message) for x in w)


def test_parallelize_errors():
    # one rank, in the spawn shared with test_lora_dp.py (_lora_cases.parallelize_errors)
    out = result(("parallelize_errors",))[0]
    assert (
        "LoRA target conv is a Conv2d, selected by ['conv']; LoRA applies to linear"
        in out["lora_conv"]
    )
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
