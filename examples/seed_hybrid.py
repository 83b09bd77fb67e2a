"""The seed scenario on CPU ranks: dp=2 replicas x tp=2, nf4-quantized base + LoRA.

Run with 4 worker processes:
    quantmesh run --nproc 4 examples/seed_hybrid.py

A small Llama-shaped model with random weights learns a toy task (count upwards modulo the vocabulary),
so the loss visibly falls in a few dozen steps. Swap `LlamaForCausalLM(cfg)` for your own model: the
calls below are the same for any PyTorch architecture.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quantmesh as qm


def main(steps: int = 30) -> None:
    mesh = qm.init_mesh(tp=2, dp=-1)  # 4 ranks -> dp=2 x tp=2
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)  # same weights on every rank: each keeps only its own shard
    model = LlamaForCausalLM(cfg)
    lora = qm.LoraConfig(
        r=8,
        alpha=16,
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    qm.parallelize(model, mesh, quant="nf4", lora=lora)
    if mesh.rank == 0:
        print(qm.auto_plan(LlamaForCausalLM(cfg), tp=mesh.tp))
    opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        start = torch.randint(0, cfg.vocab_size, (8, 1), generator=g)  # global batch of 8
        ids = (start + torch.arange(32)) % cfg.vocab_size  # (8, 32): counting sequences
        mine = ids.chunk(mesh.dp)[mesh.dp_rank]  # this replica's share of the global batch
        loss = model(mine, labels=mine).loss
        loss.backward()
        qm.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        if mesh.rank == 0 and step % 5 == 0 or mesh.rank == 0 and step == steps - 1:
            sys.stdout.write(f"step {step:3d}  loss {loss.item():.4f}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
