"""Per-GPU memory of the 70B shape under FSDP, from `qm.estimate_memory` (estimates, no GPU).

The Llama-2-70B geometry (80 layers, hidden 8192, 64 heads, 8 KV heads, vocab 32000,
intermediate 28672) built on meta; torchao nf4 base, LoRA r=16 on the 7 projections, bf16,
sequence --seq x micro-batch 1, activation checkpointing and the chunked loss (1024 tokens), for
dp in {2, 4, 8} x tp in {1, 2}: the plain layout (a whole tp shard per dp rank), --fsdp, and
--fsdp --offload-base. Prints a markdown table (GiB per GPU; host GiB per rank when offloaded).

Usage:
    python benchmarks/fsdp_table.py [--seq 2048]
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=80)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaConfig

    import quantmesh as qm

    cfg = LlamaConfig(
        hidden_size=8192, num_hidden_layers=a.layers, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, intermediate_size=28672,
        max_position_embeddings=4096,
    )  # fmt: skip
    with qm.empty_model():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    quant = qm.QuantConfig(format="nf4", backend="torchao")
    lora = qm.LoraConfig(r=16)
    gib = 2**30
    print("| tp | dp | plain | --fsdp | --fsdp --offload-base (host per rank) |")
    print("|---:|---:|---:|---:|---:|")
    for tp in (1, 2):
        for dp in (2, 4, 8):
            row = []
            for fsdp, off in ((False, False), (True, False), (True, True)):
                est = qm.estimate_memory(
                    model, tp=tp, dp=dp, quant=quant, lora=lora, seq_len=a.seq, micro_batch=1,
                    dtype=torch.bfloat16, checkpointing=True, loss_chunk_tokens=1024, fsdp=fsdp,
                    offload_base=off,
                )  # fmt: skip
                cell = f"{est.total / gib:.1f}"
                if off:
                    cell += f" ({est.host / gib:.1f})"
                row.append(cell)
            print(f"| {tp} | {dp} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
