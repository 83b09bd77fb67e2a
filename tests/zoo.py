"""The architecture zoo: third-party model classes from tiny random configs, for tensor parallelism.

`ZOO` maps a name to a `ZooCase`: `build(seed)` returns the model in eval mode with every parameter
random (biases and norm weights included: zero biases and unit norms hide bugs, see
`tests.models.randomize_`), and `inputs()` returns the keyword arguments of one forward.

The configs are tiny (hidden 32-64, 2 layers, vocabulary 128, fp32, eager attention, no dropout)
and several use a head count that two or three ranks cannot share evenly (3, 5 or 6 heads), so
uneven splits are exercised. The vocabulary (128) splits 64+64 over two ranks and 43+43+42 over
three. Nothing here touches quantmesh: the distributed test (`tests/distributed/test_zoo.py`)
parallelizes these models and compares them with themselves in one process.

Example:
    >>> model = ZOO["llama"].build(0)
    >>> model(**ZOO["llama"].inputs()).logits.shape
    torch.Size([2, 7, 128])
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tests.models import randomize_

VOCAB, BATCH, LENGTH = 128, 2, 7

__all__ = ["ZOO", "ZooCase", "output_of", "linear_names", "output_head"]


@dataclass(frozen=True)
class ZooCase:
    """One architecture: how to build it and what to feed it."""

    family: str  # "decoder", "encoder", "encdec", "moe", "vision"
    build: Callable[[int], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    notes: str = ""  # what this config exercises (heads, GQA, fused projections, ...)
    lora_skip: tuple[str, ...] = field(default_factory=tuple)  # name suffixes left out of LoRA
    # (linear layers and expert tensors)


# ---------------------------------------------------------------------------------- inputs


def _ids(vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (BATCH, LENGTH), generator=g)  # ids 0 / 1: pad, bos, ...


def _mask() -> torch.Tensor:
    """The second sequence is right-padded by two positions: masks reach every attention."""
    m = torch.ones(BATCH, LENGTH, dtype=torch.long)
    m[-1, -2:] = 0
    return m


def lm_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(), "attention_mask": _mask()}


def encdec_inputs() -> dict[str, torch.Tensor]:
    dec = _ids(seed=1)[:, :5]
    return {"input_ids": _ids(), "attention_mask": _mask(), "decoder_input_ids": dec}


def image_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}


def output_of(out) -> torch.Tensor:
    """The tensor a zoo model's forward is judged by: its logits."""
    return out.logits if hasattr(out, "logits") else out


# ---------------------------------------------------------------------------------- builders


def _hf(config_cls: str, model_cls: str, **cfg) -> Callable[[int], nn.Module]:
    """A builder of transformers' `model_cls` from `config_cls(**cfg)`, randomized from `seed`."""

    def build(seed: int = 0) -> nn.Module:
        tf = importlib.import_module("transformers")
        config = getattr(tf, config_cls)(**cfg)
        # eager attention and experts: the same math on every rank, in the reference, and in fp64
        # (transformers' grouped_mm experts have no fp64 kernel)
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        torch.manual_seed(seed)
        model = getattr(tf, model_cls)(config).float().eval()
        return randomize_(model, seed)

    return build


# dropout and friends off everywhere: an eval() model must not draw, and train mode is not tested
_NO_DROP = dict(attention_dropout=0.0, hidden_dropout=0.0)

ZOO: dict[str, ZooCase] = {
    # ---- decoders with separate q / k / v projections (the models carry a tp plan)
    "llama": ZooCase(
        "decoder",
        _hf(
            "LlamaConfig",
            "LlamaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
        lm_inputs,
        "GQA 6 heads / 3 KV, biases, tied head",
    ),
    "mistral": ZooCase(
        "decoder",
        _hf(
            "MistralConfig",
            "MistralForCausalLM",
            vocab_size=VOCAB,
            hidden_size=40,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=5,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=4,
        ),
        lm_inputs,
        "5 heads (uneven), sliding window 4",
    ),
    "qwen2": ZooCase(
        "decoder",
        _hf(
            "Qwen2Config",
            "Qwen2ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        lm_inputs,
        "q/k/v biases, 6 heads / 2 KV",
    ),
    "qwen3": ZooCase(
        "decoder",
        _hf(
            "Qwen3Config",
            "Qwen3ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        ),
        lm_inputs,
        "per-head q_norm / k_norm",
    ),
    "gemma": ZooCase(
        "decoder",
        _hf(
            "GemmaConfig",
            "GemmaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
        ),
        lm_inputs,
        "embeddings scaled by sqrt(hidden), MQA (1 KV head)",
    ),
    "gemma2": ZooCase(
        "decoder",
        _hf(
            "Gemma2Config",
            "Gemma2ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            sliding_window=4,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        lm_inputs,
        "soft-capping, sliding + global layers",
    ),
    "gemma3_text": ZooCase(
        "decoder",
        _hf(
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            sliding_window=4,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        lm_inputs,
        "q/k norms, scaled embeddings",
    ),
    "phi": ZooCase(
        "decoder",
        _hf(
            "PhiConfig",
            "PhiForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            partial_rotary_factor=0.5,
            max_position_embeddings=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "parallel attention + MLP, partial rotary, dense",
    ),
    "phi3": ZooCase(
        "decoder",
        _hf(
            "Phi3Config",
            "Phi3ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=64,
            pad_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "fused qkv_proj (q|k|v segments), fused gate_up_proj",
    ),
    "gpt2": ZooCase(
        "decoder",
        _hf(
            "GPT2Config",
            "GPT2LMHeadModel",
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=48,
            n_layer=2,
            n_head=6,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lm_inputs,
        "Conv1D (in, out), fused c_attn",
    ),
    "gpt_neox": ZooCase(
        "decoder",
        _hf(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            rotary_pct=0.5,
            max_position_embeddings=64,
            use_parallel_residual=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        ),
        lm_inputs,
        "fused query_key_value laid out per head",
    ),
    "gptj": ZooCase(
        "decoder",
        _hf(
            "GPTJConfig",
            "GPTJForCausalLM",
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=48,
            n_layer=2,
            n_head=6,
            rotary_dim=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        lm_inputs,
        "parallel block, interleaved rotary",
    ),
    "falcon": ZooCase(
        "decoder",
        _hf(
            "FalconConfig",
            "FalconForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            bias=True,
            alibi=False,
            max_position_embeddings=64,
            **_NO_DROP,
        ),
        lm_inputs,
        "classic: multi-query fused query_key_value",
    ),
    "falcon_new": ZooCase(
        "decoder",
        _hf(
            "FalconConfig",
            "FalconForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_kv_heads=2,
            new_decoder_architecture=True,
            bias=False,
            alibi=False,
            max_position_embeddings=64,
            **_NO_DROP,
        ),
        lm_inputs,
        "new architecture: GQA fused qkv grouped per KV head",
    ),
    "codegen": ZooCase(
        "decoder",
        _hf(
            "CodeGenConfig",
            "CodeGenForCausalLM",
            vocab_size=VOCAB,
            n_positions=64,
            n_ctx=64,
            n_embd=48,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        lm_inputs,
        "fused qkv_proj in mp_num=4 blocks",
    ),
    "bloom": ZooCase(
        "decoder",
        _hf(
            "BloomConfig",
            "BloomForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            n_layer=2,
            n_head=6,
            **_NO_DROP,
        ),
        lm_inputs,
        "ALiBi, fused query_key_value per head, embedding LayerNorm",
    ),
    "opt": ZooCase(
        "decoder",
        _hf(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=3,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=1,
        ),
        lm_inputs,
        "3 heads, learned positions with offset",
    ),
    "stablelm": ZooCase(
        "decoder",
        _hf(
            "StableLmConfig",
            "StableLmForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=64,
            qk_layernorm=True,
            use_qkv_bias=True,
            partial_rotary_factor=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "per-head q / k LayerNorm, partial rotary",
    ),
    "mpt": ZooCase(
        "decoder",
        _hf(
            "MptConfig",
            "MptForCausalLM",
            vocab_size=VOCAB,
            d_model=48,
            n_layers=2,
            n_heads=6,
            expansion_ratio=2,
            max_seq_len=64,
            resid_pdrop=0.0,
            emb_pdrop=0.0,
            attn_config={"attn_pdrop": 0, "alibi": True},
        ),
        lm_inputs,
        "ALiBi, fused Wqkv",
    ),
    "olmo": ZooCase(
        "decoder",
        _hf(
            "OlmoConfig",
            "OlmoForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            max_position_embeddings=64,
            clip_qkv=8.0,
            pad_token_id=1,
        ),
        lm_inputs,
        "non-parametric LayerNorm, qkv clipping",
    ),
    "starcoder2": ZooCase(
        "decoder",
        _hf(
            "Starcoder2Config",
            "Starcoder2ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=None,
            residual_dropout=0.0,
            embedding_dropout=0.0,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "LayerNorm + biases, c_fc / c_proj MLP, GQA",
    ),
    # ---- encoders
    "bert": ZooCase(
        "encoder",
        _hf(
            "BertConfig",
            "BertForMaskedLM",
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        lm_inputs,
        "MLM head tied, shared decoder bias",
    ),
    "roberta": ZooCase(
        "encoder",
        _hf(
            "RobertaConfig",
            "RobertaForMaskedLM",
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        lm_inputs,
        "padding-offset positions",
    ),
    "vit": ZooCase(
        "vision",
        _hf(
            "ViTConfig",
            "ViTForImageClassification",
            image_size=16,
            patch_size=8,
            num_channels=3,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            intermediate_size=64,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        image_inputs,
        "Conv2d patch embedding, CLS token, classifier",
    ),
    # ---- encoder-decoders
    "t5": ZooCase(
        "encdec",
        _hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=48,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=6,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        encdec_inputs,
        "relative position bias (per head), no 1/sqrt(d) scaling",
    ),
    "bart": ZooCase(
        "encdec",
        _hf(
            "BartConfig",
            "BartForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=48,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=6,
            decoder_attention_heads=3,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=1,
            decoder_start_token_id=2,
        ),
        encdec_inputs,
        "cross-attention, final_logits_bias, 6 / 3 heads",
    ),
    # ---- mixtures of experts
    "mixtral": ZooCase(
        "moe",
        _hf(
            "MixtralConfig",
            "MixtralForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
        ),
        lm_inputs,
        "4 experts, top-2",
    ),
    "qwen2_moe": ZooCase(
        "moe",
        _hf(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            max_position_embeddings=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            use_sliding_window=False,
        ),
        lm_inputs,
        "4 experts top-2 + gated shared expert",
    ),
    "qwen3_moe": ZooCase(
        "moe",
        _hf(
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
        lm_inputs,
        "4 experts top-2, q/k norms, renormalized top-k",
    ),
    "olmoe": ZooCase(
        "moe",
        _hf(
            "OlmoeConfig",
            "OlmoeForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            max_position_embeddings=64,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        lm_inputs,
        "4 experts top-2, q/k norms over all heads",
    ),
    "gpt_oss": ZooCase(
        "moe",
        _hf(
            "GptOssConfig",
            "GptOssForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
        lm_inputs,
        "experts transposed (E, H, 2I), gate/up interleaved, expert biases, attention sinks",
    ),
    "deepseek_v3": ZooCase(
        "moe",
        _hf(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            max_position_embeddings=64,
            rope_interleave=True,
        ),
        lm_inputs,
        "MLA (low-rank q / kv), 1 dense + 1 MoE layer",
        # peft 0.21 maps the MLP names (gate_proj, up_proj, down_proj) of transformers 5 MoE models
        # onto the fused routed experts and leaves the named linears (dense MLP, shared experts)
        # without adapters: no reference for those
        lora_skip=("gate_proj", "up_proj", "down_proj"),
    ),
    "phimoe": ZooCase(
        "moe",
        _hf(
            "PhimoeConfig",
            "PhimoeForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            input_jitter_noise=0.0,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "router: an nn.Linear whose forward returns a tuple (left whole, in float)",
        lora_skip=("router",),  # not a linear (peft's LoRA on it fails too)
    ),
    "hunyuan_v1_moe": ZooCase(
        "moe",
        _hf(
            "HunYuanMoEV1Config",
            "HunYuanMoEV1ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            num_experts=4,
            moe_topk=2,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "router linear before the shared MLP's (verify keeps it whole), q/k norms after rotary",
        # as deepseek_v3: peft maps the MLP names onto the fused experts (no reference for the
        # shared MLP's linears)
        lora_skip=("gate_proj", "up_proj", "down_proj"),
    ),
    "afmoe": ZooCase(
        "moe",
        _hf(
            "AfmoeConfig",
            "AfmoeForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            num_dense_layers=1,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "a dense first layer, then experts whose router linear precedes the shared MLP's",
        lora_skip=("gate_proj", "up_proj", "down_proj"),  # as deepseek_v3 (peft's mapping)
    ),
    "llama4": ZooCase(
        "moe",
        _hf(
            "Llama4TextConfig",
            "Llama4ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=32,
            intermediate_size_mlp=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=1,
            attention_dropout=0.0,
        ),
        lm_inputs,
        "experts (E, H, 2I) read by bmm, no is_transposed (layout from shapes); router: an "
        "nn.Linear returning a tuple",
        # the router is not a linear; the experts declare no is_transposed (no PEFT layout)
        lora_skip=("router", "experts.gate_up_proj", "experts.down_proj"),
    ),
}

DECODERS = [n for n, c in ZOO.items() if c.family in ("decoder", "moe")]


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output projection (LM head / classifier), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None and hasattr(model, "classifier"):
        head = model.classifier
    return head


def linear_names(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Full names of every linear layer (nn.Linear, transformers' Conv1D) except the output head
    and names ending in one of `skip`: the LoRA targets of the zoo."""
    head = output_head(model)
    out = []
    for name, m in model.named_modules():
        if m is head or name.endswith(skip):
            continue
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out.append(name)
    return out
