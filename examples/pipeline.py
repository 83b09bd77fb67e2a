"""Fine-tune LoRA adapters on a 4-bit model cut into 2 pipeline stages (1F1B over 2 micro-batches).

Run: quantmesh run --nproc 2 examples/pipeline.py MODEL_DIR DATA.txt
(4 processes: add tp=2 below for 2 stages of 2 tensor-parallel ranks each.)
"""

import sys

import torch
from transformers import AutoTokenizer

import quantmesh as qm

model_dir, data = sys.argv[1], sys.argv[2]
mesh = qm.init_mesh(pp=2)  # each rank holds half of the decoder layers
model = qm.from_pretrained(model_dir, mesh, quant="nf4", lora=qm.LoraConfig(r=16))
tokenizer = AutoTokenizer.from_pretrained(model_dir)
dataset = qm.build_dataset([data], tokenizer, seq_len=64)  # chat or text; files or folders
opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=2e-3)

model.train()
batches = qm.iterate_batches(dataset.train, 2, dp_rank=mesh.dp_rank, dp_size=mesh.dp)
for step, batch in zip(range(10), batches):
    loss = qm.train_step(model, batch, microbatches=2, schedule="1f1b")  # global mean, every rank
    qm.clip_grad_norm_(model, 1.0)  # the norm over both stages
    opt.step()
    opt.zero_grad()
    if mesh.rank == 0:
        print(f"step {step}  loss {loss.item():.3f}", flush=True)

qm.save_adapter(model, "pipeline-adapter")  # one PEFT folder, written from both stages
