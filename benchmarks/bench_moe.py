"""Mixture-of-experts LoRA training on one GPU: quantmesh (nf4 experts) against transformers +
bitsandbytes + peft (experts left in bf16: bitsandbytes quantizes linears only) and against
Unsloth's MoE path (its `FastLanguageModel` with `load_in_4bit`), same call.

The model is Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, top-8, 32 heads / 4 KV heads,
vocabulary 151,936) at `--layers` of its 48 layers, random weights. Both sides train LoRA r=16
(alpha 32) on q/k/v/o and on every expert tensor (peft and Unsloth: `target_parameters`), bf16
autocast, AdamW, `--warmup` + `--steps` steps of `--mb` rows of `--seq` tokens. The peers load a
folder written by transformers' `save_pretrained` (`--model-dir`, written once and reused).

Reports tokens/s, peak GPU memory, quantmesh's memory estimate for the same run, and the
estimate at full depth (48 layers) at tp=1 and tp=2.

Usage (one GPU):
    python benchmarks/bench_moe.py --mode qm --out DIR [--compile]
    python benchmarks/bench_moe.py --mode peft --out DIR
    python benchmarks/bench_moe.py --mode unsloth --out DIR [--unsloth-gc off]
      (Unsloth is imported before transformers, so each mode runs in its own process)
    python benchmarks/bench_moe.py --mode qm --smoke --out DIR   (tiny shapes, CPU)
Writes DIR/result_moe_<mode>.json; a failure is recorded there, not raised.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmbench as qb  # noqa: E402
from bench_train import hf_loss, pipelined, profile_steps  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=["qm", "peft", "unsloth"], required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mb", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="qm: compile_blocks")
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="qm: the chunked loss (qm.train_step, N tokens per chunk); 0: the model's",
    )
    p.add_argument(
        "--checkpoint",
        choices=["none", "blocks", "offload"],
        default="none",
        help="qm: checkpoint_blocks (offload: its activations to the host)",
    )
    p.add_argument("--profile", action="store_true", help="GPU time by kernel of 2 more steps")
    p.add_argument(
        "--triton-dequant",
        action="store_true",
        help="qm: quantmesh's Triton dequantize for the 4-bit weights, experts' included "
        "(kernel4.DEQUANT_ENABLED; as QUANTMESH_TRITON_DEQUANT=1)",
    )
    p.add_argument(
        "--expert-adapters",
        choices=["built", "activations", "deltas"],
        default="built",
        help="qm: expert adapters on the activations or as weight deltas (the reference); built: "
        "as parallelize made them ($QUANTMESH_EXPERT_ADAPTERS_ON_ACTIVATIONS)",
    )
    p.add_argument(
        "--unsloth-gc",
        choices=["unsloth", "off"],
        default="unsloth",
        help="unsloth: its gradient checkpointing (default) or none",
    )
    p.add_argument(
        "--model-dir", default=None, help="peers: the saved model folder (default: a temporary one)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def config(a, layers: int | None = None):
    from transformers import Qwen3MoeConfig

    if a.smoke:
        shape = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128,
                     num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
    else:
        shape = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936)  # fmt: skip
    cfg = Qwen3MoeConfig(
        num_hidden_layers=layers or a.layers, max_position_embeddings=max(4096, a.seq),
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, use_cache=False,
        tie_word_embeddings=False, **shape,
    )  # fmt: skip
    cfg._attn_implementation = "eager" if a.smoke else "sdpa"
    cfg._experts_implementation = "eager" if a.smoke else "grouped_mm"
    return cfg


def skeleton(cfg):
    from transformers import Qwen3MoeForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        return Qwen3MoeForCausalLM(cfg)


def estimates(a) -> dict:
    """quantmesh's estimate for this run, and for the full 48-layer model at tp=1 and tp=2."""
    import quantmesh as qm

    out = {}
    lora = qm.LoraConfig(r=16, alpha=32)
    for name, layers, tp in (("this_run", a.layers, 1), ("full_tp1", 48, 1), ("full_tp2", 48, 2)):
        if a.smoke and layers == 48:
            continue
        est = qm.estimate_memory(
            skeleton(config(a, layers)), tp=tp, quant="nf4", lora=lora, seq_len=a.seq,
            micro_batch=a.mb, dtype=torch.bfloat16, compiled=a.compile,
            checkpointing=a.checkpoint != "none", offload_activations=a.checkpoint == "offload",
            loss_chunk_tokens=a.loss_chunk,
        )  # fmt: skip
        out[name] = {"total_GiB": round(est.total / 2**30, 2),
                     "weights_GiB": round(est.weights / 2**30, 2)}  # fmt: skip
    return out


def run_qm(a, device) -> tuple:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=1)
    model = skeleton(config(a))
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16, alpha=32),
                   dtype=torch.bfloat16)  # fmt: skip
    qb.fill_random(model, seed=0)
    from quantmesh.tp.experts import ShardedExperts

    for m in model.modules():
        if isinstance(m, ShardedExperts) and a.expert_adapters != "built":
            m.adapters_on_activations = a.expert_adapters == "activations"
    if a.compile:
        qm.compile_blocks(model)
    if a.checkpoint != "none":
        qm.checkpoint_blocks(model, offload=a.checkpoint == "offload")
    model.train()
    return model, qm.trainable_parameters(model)


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer of exactly `vocab_size` entries (the peers' loaders read one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"<unk>": vocab_size - 2, "<eos>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<unk>", model_max_length=1 << 16)  # fmt: skip


def saved_model(a, device) -> str:
    """The model as a user's checkpoint is: transformers' `save_pretrained` of random weights, in
    bf16, with a tokenizer; written once into `--model-dir` and reused by later modes."""
    from transformers import Qwen3MoeForCausalLM

    path = a.model_dir or tempfile.mkdtemp(prefix="moe-")
    if os.path.exists(os.path.join(path, ".complete")):
        return path
    cfg = config(a)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    word_tokenizer(cfg.vocab_size).save_pretrained(path)
    del model
    open(os.path.join(path, ".complete"), "w").write("ok\n")
    return path


def run_peft(a, device) -> tuple:
    import peft
    from transformers import BitsAndBytesConfig, Qwen3MoeForCausalLM

    path = saved_model(a, device)  # quantized on load, as a user's checkpoint is
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = Qwen3MoeForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=torch.bfloat16, device_map={"": device}
    )
    lc = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )  # fmt: skip
    model = peft.get_peft_model(model, lc)
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def run_unsloth(a, device) -> tuple:
    """Unsloth's own loader and adapter call, on the same saved folder (4-bit unless --smoke)."""
    from unsloth import FastLanguageModel  # imported by main() before transformers

    path = saved_model(a, device)
    gc_mode = "unsloth" if a.unsloth_gc == "unsloth" else False
    model, _tok = FastLanguageModel.from_pretrained(
        model_name=path, max_seq_length=a.seq, dtype=torch.bfloat16, load_in_4bit=not a.smoke,
        use_gradient_checkpointing=gc_mode, local_files_only=True,
    )  # fmt: skip
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0, bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        use_gradient_checkpointing=gc_mode, random_state=0,
    )  # fmt: skip
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def expert_path(model) -> str:
    """Which path the expert adapters take: on the activations (the grouped forward) or as weight
    deltas."""
    from quantmesh.tp.experts import ShardedExperts

    m = next(m for m in model.modules() if isinstance(m, ShardedExperts))
    return "activations" if m.uses_activation_adapters() else "weight deltas"


def expert_storage(model) -> dict:
    """How the first layer's experts are stored: float or packed (quantized) bytes."""
    for name, p in model.named_parameters():
        if "experts" in name and "lora" not in name:
            return {"name": name, "dtype": str(p.dtype), "shape": list(p.shape),
                    "class": type(p).__name__}  # fmt: skip
    for name, b in model.named_buffers():
        if "experts" in name:
            return {"name": name, "dtype": str(b.dtype), "shape": list(b.shape)}
    return {}


def main(argv=None) -> int:
    a = parse(argv)
    if a.smoke:
        a.seq, a.mb, a.warmup, a.steps = 16, 1, 1, 2
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    R: dict = {"mode": a.mode, "layers": a.layers, "seq": a.seq, "mb": a.mb,
               "compile": a.compile, "env": qb.env_report()}  # fmt: skip
    name = f"result_moe_{a.mode}{'_compiled' if a.compile else ''}"
    name += f"_chunk{a.loss_chunk}" if a.loss_chunk else ""
    name += f"_{a.checkpoint}" if a.checkpoint != "none" else ""
    name += f"_{a.expert_adapters}" if a.expert_adapters != "built" else ""
    if a.triton_dequant:
        from quantmesh.quant import kernel4

        kernel4.DEQUANT_ENABLED = True
        name += "_tdq"
    R.update(loss_chunk=a.loss_chunk, checkpoint=a.checkpoint, triton_dequant=a.triton_dequant)
    if a.mode == "unsloth":
        R["unsloth_gc"] = a.unsloth_gc
        name += "" if a.unsloth_gc == "unsloth" else "_nogc"
    with qb.record_errors(R):
        if a.mode == "unsloth":
            import unsloth  # noqa: F401  (it patches transformers and peft: first)

            R["versions"] = qb.versions()
        else:
            R["estimate"] = estimates(a)
        run = {"qm": run_qm, "peft": run_peft, "unsloth": run_unsloth}[a.mode]
        model, params = run(a, device)
        R["experts_stored_as"] = expert_storage(model)
        if a.mode == "qm":
            R["expert_adapters"] = expert_path(model)
        R["trainable_parameters"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-4)
        vocab = config(a).vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (a.mb, a.seq), generator=g).to(device)
        # the chunked loss through the training loop's step (qm.train_step, which runs backward)
        chunked = a.mode == "qm" and a.loss_chunk
        loss_fn = pipelined(1, "1f1b", chunk_tokens=a.loss_chunk) if chunked else hf_loss
        qb.reset_peaks(device)
        autocast = device.type == "cuda"
        losses = []
        t0 = 0.0
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                qb.sync(device)
                t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(model, ids)
            if not getattr(loss_fn, "backpropagated", False):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        qb.sync(device)
        dt = time.perf_counter() - t0
        R["tokens_per_s"] = round(a.steps * a.mb * a.seq / dt, 1)
        R["losses"] = [round(float(x), 4) for x in losses]
        R["memory"] = qb.gpu_mem(device)
        if a.profile:
            R["profile"] = profile_steps(model, opt, ids, device, autocast, loss_fn)
    qb.write_json(os.path.join(a.out, name + ".json"), R)
    keys = (
        "tokens_per_s",
        "memory",
        "estimate",
        "experts_stored_as",
        "trainable_parameters",
        "error",
    )
    print({k: R.get(k) for k in keys})
    return 0


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
