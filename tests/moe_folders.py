"""Mixture-of-experts folders as transformers saves them, from tiny configs with random weights.

transformers 5 holds the experts fused (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`
(E, H, I)) and `save_pretrained` writes them back one tensor per expert, as on the Hub
(`mlp.experts.3.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.3.w1.weight`). gpt-oss has
no conversion rule: its folder holds the fused, transposed (E, H, 2I) tensors and expert biases.

Example:
    >>> folder = moe_dir("qwen3_moe", tmp_path)            # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models import randomize_

VOCAB = 64
# name -> (config class, model class, MoE fields); shared: hidden 32, 2 layers, 4 heads / 2 KV
# (DeepSeek-V3's attention is MLA, whose real configs have as many KV heads as heads)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                     router_jitter_noise=0.0)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, decoder_sparse_step=1)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                     head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                         kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=8, n_shared_experts=1, num_key_value_heads=4)),
}  # fmt: skip
PER_EXPERT = [n for n in ARCHS if n != "gpt_oss"]  # folders with one tensor per expert


def moe_dir(name: str, root: Path, seed: int = 0, **overrides: object) -> Path:
    """`save_pretrained` of a random tiny `name` model into `root` (created), its config's fields
    changed by `overrides`; returns `root`."""
    import transformers as tf

    config_cls, model_cls, fields = ARCHS[name]
    shared = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)  # fmt: skip
    cfg = getattr(tf, config_cls)(**{**shared, **fields, **overrides})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_(getattr(tf, model_cls)(cfg).float(), seed)
    model.save_pretrained(root, safe_serialization=True)
    return root


def expert_keys(folder: Path) -> list[str]:
    """The stored keys of `folder` that hold one expert each (`...experts.<n>....`)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return [k for k in f.keys() if ".experts." in k and k.split(".experts.")[1][0].isdigit()]


def quantized_per_expert(folder: Path, root: Path, kind: str) -> tuple[Path, Path]:
    """A bitsandbytes folder as transformers 4 saved one, from the float `folder`: every decoder
    linear, each expert's too, stored quantized (`kind`: nf4, nf4_dq, fp4 or int8; 4-bit in 64
    blocks with float32 statistics dtype, as `Linear4bit` quantizes). Returns (that folder, a float
    folder holding bitsandbytes' dequantized values of the same weights: the reference).

    transformers 5 cannot write this layout (it fuses the experts and quantizes only linears), so
    the codes come from bitsandbytes' functions, which `Linear4bit` / `Linear8bitLt` call.
    """
    import json
    import shutil

    import bitsandbytes.functional as F
    from safetensors.torch import load_file, save_file

    fmt, dq = kind.split("_")[0], kind.endswith("_dq")
    quant, floats = {}, {}
    for k, v in load_file(str(folder / "model.safetensors")).items():
        if (
            not (k.endswith("proj.weight") or ".experts." in k)
            or v.dim() != 2
            or "layers." not in k
        ):
            quant[k] = floats[k] = v
            continue
        if fmt == "int8":
            cb, scb, _ = F.int8_vectorwise_quant(v.half())
            quant[k], quant[k[: -len("weight")] + "SCB"] = cb, scb
            quant[k[: -len("weight")] + "weight_format"] = torch.tensor(0, dtype=torch.uint8)
            floats[k] = F.int8_vectorwise_dequant(cb, scb)
            continue
        codes, qs = F.quantize_4bit(v, blocksize=64, compress_statistics=dq, quant_type=fmt,
                                    quant_storage=torch.uint8)  # fmt: skip
        quant[k] = codes
        quant.update({f"{k}.{s}": t for s, t in qs.as_dict(packed=True).items()})
        floats[k] = F.dequantize_4bit(codes, qs)
    cfg = json.loads((folder / "config.json").read_text())
    ref = root / "reference"
    for out, tensors in ((root / kind, quant), (ref, floats)):
        out.mkdir(parents=True)
        shutil.copy(folder / "config.json", out / "config.json")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if fmt == "int8":
        qc = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
    else:
        qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": fmt,
              "bnb_4bit_use_double_quant": dq, "bnb_4bit_compute_dtype": "float32"}  # fmt: skip
    (root / kind / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return root / kind, ref


def fp8_folder(folder: Path, root: Path, block: int = 128) -> tuple[Path, Path]:
    """An fp8 folder as DeepSeek-V3's and Qwen3's `-FP8` checkpoints are stored, from the float
    `folder`: every decoder projection (each expert's too) as float8_e4m3fn with one float32
    `weight_scale_inv` per `block` x `block` block (the block's largest |value| / 448). Returns
    (that folder, a float folder of its values: the fp8 value times its block's scale)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    quant, floats = {}, {}
    for k, v in load_file(str(folder / "model.safetensors")).items():
        if not k.endswith("proj.weight") or v.dim() != 2 or "layers." not in k:
            quant[k] = floats[k] = v
            continue
        rows, cols = -(-v.shape[0] // block), -(-v.shape[1] // block)
        pad = torch.zeros(rows * block, cols * block)
        pad[: v.shape[0], : v.shape[1]] = v.float()
        blocks = pad.view(rows, block, cols, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # (rows, cols)
        big = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        big = big[: v.shape[0], : v.shape[1]]
        q = (v.float() / big).to(torch.float8_e4m3fn)
        quant[k], quant[k[: -len("weight")] + "weight_scale_inv"] = q, scale
        floats[k] = q.float() * big
    cfg = json.loads((folder / "config.json").read_text())
    ref = root / "reference"
    for out, tensors in ((root / "fp8", quant), (ref, floats)):
        out.mkdir(parents=True)
        shutil.copy(folder / "config.json", out / "config.json")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [block, block]}  # fmt: skip
    (root / "fp8" / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return root / "fp8", ref


def mxfp4_folder(folder: Path, root: Path) -> tuple[Path, Path]:
    """A gpt-oss folder as its Hub checkpoints store the experts (quant_method "mxfp4"), from the
    float gpt-oss `folder`: each expert tensor replaced by random `<t>_blocks` (E, out, in/32, 16)
    uint8 codes and `<t>_scales` (E, out, in/32) exponents near 2^-7. Returns (that folder, the
    float folder transformers' own dequantize makes of it: `Mxfp4Config(dequantize=True)`, saved)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    g = torch.Generator().manual_seed(0)
    out = {}
    for k, v in load_file(str(folder / "model.safetensors")).items():
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k] = v
            continue
        e, n_in, n_out = v.shape  # gpt-oss holds its experts (E, in, out)
        out[k + "_blocks"] = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8,
                                           generator=g)  # fmt: skip
        out[k + "_scales"] = torch.randint(118, 124, (e, n_out, n_in // 32), dtype=torch.uint8,
                                           generator=g)  # fmt: skip
    q = root / "mxfp4"
    q.mkdir(parents=True)
    save_file(out, str(q / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (q / "config.json").write_text(json.dumps(cfg))
    ref = AutoModelForCausalLM.from_pretrained(
        q, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    ref.config.quantization_config = None
    delattr(ref.config, "quantization_config")
    ref.save_pretrained(root / "reference")
    return q, root / "reference"
