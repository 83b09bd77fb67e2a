"""The pre-quantized paths on GPUs (NCCL, 2 GPUs), marked cuda: run on the GPU machine.

A folder saved quantized by transformers + bitsandbytes (nf4, double quant) loaded by
`qm.from_pretrained` at tp=2, and a transformers model loaded with `quantization_config` onto each
rank's GPU and handed to `qm.parallelize` at tp=2, against the same model on one GPU. fp32 compute
(TF32 off): only the summation order differs, and cuBLAS orders sums differently from one GPU to a
split, so the bound is 1e-4 of the largest logit (test_cuda.py's).
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

from ._io_cases import llama_dir, logits, token_ids
from .test_prequant import bnb_dir

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
TOL = 1e-4


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.cpu() - want.cpu()).abs().max() / want.abs().max())


def _on_gpus(rank: int, folder: str) -> dict:
    from transformers import AutoModelForCausalLM

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    ids = token_ids().to(mesh.device)
    quant = qm.QuantConfig(format="nf4", double_quant=True, compute_dtype=torch.float32)
    m = qm.from_pretrained(folder, mesh, quant=quant, progress=False)
    out = {"folder": logits(m, ids).cpu()}
    # a model quantized by transformers on this rank's GPU, handed over as it is
    user = AutoModelForCausalLM.from_pretrained(folder, device_map={"": str(mesh.device)}).eval()
    out["one_gpu"] = logits(user, ids).cpu()
    qm.parallelize(user, mesh)
    out["handed"] = logits(user, ids).cpu()
    return out


def test_prequantized_folder_and_model_on_two_gpus(tmp_path):
    from transformers import AutoModelForCausalLM

    src = llama_dir(tmp_path / "float", hidden=256, heads=8, kv=4, head_dim=32, inter=256,
                    bias=False)  # fmt: skip
    folder = str(bnb_dir(src, tmp_path / "nf4_dq", "nf4_dq"))  # quantized on CPU by bitsandbytes
    ref = AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cuda:0"}).eval()
    want = logits(ref, token_ids().to("cuda:0")).cpu()
    for r in run_ranks(_on_gpus, 2, folder, timeout=600):
        assert _err(r["folder"], want) <= TOL
        assert _err(r["one_gpu"], want) <= TOL
        assert _err(r["handed"], r["one_gpu"]) <= TOL
