"""Fine-tune LoRA adapters on a 4-bit model split over 2 ranks, in ~25 lines of quantmesh.

Run: quantmesh run --nproc 2 examples/quickstart.py MODEL_DIR DATA.txt
"""

import sys

import torch
from transformers import AutoTokenizer

import quantmesh as qm

model_dir, data = sys.argv[1], sys.argv[2]
mesh = qm.init_mesh(tp=2)  # 2 ranks split every layer; more ranks add data-parallel replicas
model = qm.from_pretrained(model_dir, mesh, quant="nf4", lora=qm.LoraConfig(r=16))
tokenizer = AutoTokenizer.from_pretrained(model_dir)
dataset = qm.build_dataset([data], tokenizer, seq_len=64)  # chat or text; files or folders
opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=2e-3)

model.train()
batches = qm.iterate_batches(dataset.train, 2, dp_rank=mesh.dp_rank, dp_size=mesh.dp)
for step, batch in zip(range(10), batches):
    loss = model(**batch).loss  # every rank sees the same loss: logits are gathered over tp
    loss.backward()
    opt.step()
    opt.zero_grad()
    if mesh.rank == 0:
        print(f"step {step}  loss {loss.item():.3f}", flush=True)

qm.save_adapter(model, "quickstart-adapter")  # PEFT format, unsharded
