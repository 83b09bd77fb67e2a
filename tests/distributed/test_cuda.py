"""The same training runs on GPUs (NCCL) as on CPU ranks (gloo): marked cuda, run on the GPU machine.

fp32 on the GPU (TF32 off, torch's default for matmuls) against the fp32 CPU reference: only the
summation order differs, but cuBLAS and CPU kernels order sums differently too, so the bound is 1e-4
relative rather than 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

from ._lora_cases import many

pytestmark = pytest.mark.cuda


def _cpu_reference():
    return run_ranks(many, 1, [(1, 1, None)], timeout=180, env={"CUDA_VISIBLE_DEVICES": ""})[0][0]


def _close(got, ref, tol):
    assert len(got["losses"]) == len(ref["losses"]) == 5, (got["losses"], ref["losses"])
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) < tol, (got["losses"], ref["losses"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_layouts_match_cpu_reference():
    ref = _cpu_reference()
    res = run_ranks(many, 2, [(1, 2, None), (2, 1, None)], timeout=300)
    for r in res:
        _close(r[0], ref, 1e-4)  # tp=2 over NCCL
        _close(r[1], ref, 1e-4)  # dp=2 over NCCL
        for case in r:  # tp=2: the adapters kept whole; dp=2: every adapter
            assert case["replicas"]["equal"] and case["replicas"]["compared"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layer_split_over_two_gpus_matches_cpu_reference():
    """The seed layout on real devices: one rank drives cuda:0 and cuda:1 (DDP-ready)."""
    ref = _cpu_reference()
    res = run_ranks(many, 1, [(1, 1, None, 5, 2)], timeout=300)
    _close(res[0][0], ref, 1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nf4_tp2_on_gpus_matches_one_gpu():
    one = run_ranks(many, 1, [(1, 1, "nf4")], timeout=300)[0][0]
    two = run_ranks(many, 2, [(1, 2, "nf4")], timeout=300)[0][0]
    # bf16 compute on CUDA: nf4 layers run in bf16, so ~1e-2 relative; shards see different
    # double-quant statistics too (see test_lora_dp.py)
    _close(two, one, 2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_compiled_blocks_on_nccl_train_like_eager():
    """qm.compile_blocks at tp=2 over NCCL, fp32: the compiled collectives (functional all-reduces)
    carry the same gradients as eager. torch 2.11 dropped them once, so this runs on the GPUs."""
    from .test_compile import _both

    for eager, comp in run_ranks(_both, 2, None, timeout=600):
        assert comp["breaks"] == {}
        assert comp["losses"] and eager["grads"], "no step recorded"
        for a, b in zip(comp["losses"], eager["losses"], strict=True):
            assert abs(a - b) / abs(b) < 1e-4, (comp["losses"], eager["losses"])
        for ge, gc in zip(eager["grads"], comp["grads"], strict=True):
            assert ge and ge.keys() == gc.keys(), (ge.keys(), gc.keys())
            for k in ge:
                err = (gc[k] - ge[k]).norm() / ge[k].norm().clamp_min(1e-12)
                assert err < 1e-3, (k, float(err))


def _graphs_run(rank: int, graphs: bool, out: str) -> dict:
    """The library's training loop (what `finetune` runs) on one GPU: a small nf4 + LoRA Llama,
    its layers compiled as `finetune` compiles them (`compile_for_training`), 4 steps of 2
    micro-batches (gradients accumulated) with an evaluation every 2 steps."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm
    from quantmesh.cli.worker import compile_for_training
    from quantmesh.quant import kernel4
    from quantmesh.train.loop import TrainConfig, train

    mesh = qm.init_mesh(tp=1)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
                      max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=8, alpha=16, seed=3))
    with torch.no_grad():  # nonzero B, so that every adapter's A trains from the first step
        for i, p in enumerate(p for n, p in model.named_parameters() if "lora_B" in n):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02
            p.copy_(noise)  # drawn on CPU: a CPU generator cannot fill a CUDA tensor
    n = compile_for_training(model, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 512, (64,), generator=g) for _ in range(20)]
    data = SimpleNamespace(
        train=[{"input_ids": r, "labels": r} for r in rows[:16]],
        eval=[{"input_ids": r, "labels": r} for r in rows[16:]],
    )
    tc = TrainConfig(steps=4, micro_batch=2, grad_accum=2, lr=2e-3, eval_every=2, progress=False)
    res = train(model, data, tc, output_dir=out)
    # then, with every graph recorded and replaying: one batch's gradient accumulated over its two
    # micro-batches against the two halves' own (each half's loss is over half the targets)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = {"input_ids": torch.stack(rows[:4]), "labels": torch.stack(rows[:4])}

    def grads(b: dict, m: int) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        qm.train_step(model, b, microbatches=m, chunk_tokens=tc.loss_chunk_tokens)
        return [p.grad.detach().float().clone() for p in params]

    whole = grads(batch, 2)
    halves = [grads({k: v[i * 2 : i * 2 + 2] for k, v in batch.items()}, 1) for i in range(2)]
    again = grads(batch, 2)
    accum_err = max(
        float((w - (a + b) / 2).norm() / w.norm()) for w, a, b in zip(whole, *halves, strict=True)
    )
    repeat_err = max(float((w - x).norm() / w.norm()) for w, x in zip(whole, again, strict=True))
    return {"blocks": n, "losses": res.losses, "eval": res.eval_losses, "accum_err": accum_err,
            "repeat_err": repeat_err, "triton_dequant": kernel4.DEQUANT_TRAINING}  # fmt: skip


def test_cuda_graphs_train_like_the_compiled_layers(tmp_path):
    """`finetune --cuda-graphs` on one GPU: the layers replayed from CUDA graphs (with Triton's
    dequantize, bitsandbytes' values) train as the compiled layers do, through accumulated
    micro-batches and evaluations between steps. The sharp check: a batch's gradient accumulated
    over two replayed micro-batches is the mean of the halves' own; a replay that overwrote the
    first micro-batch's gradient before it was added would give the second's alone (an error of
    order 1)."""
    plain = run_ranks(_graphs_run, 1, False, str(tmp_path / "plain"), timeout=600)[0]
    graphs = run_ranks(_graphs_run, 1, True, str(tmp_path / "graphs"), timeout=600)[0]
    assert plain["blocks"] == graphs["blocks"] == 2
    assert (plain["triton_dequant"], graphs["triton_dequant"]) == (False, True)
    for r in (plain, graphs):  # bf16 rounding of two loss scales: ~1e-3
        assert r["accum_err"] < 2e-2 and r["repeat_err"] < 1e-3, r
    assert len(graphs["losses"]) == 4 and sorted(graphs["eval"]) == [0, 2, 4]
    for a, b in zip(graphs["losses"], plain["losses"], strict=True):
        assert abs(a - b) / abs(b) < 1e-2, (graphs["losses"], plain["losses"])
    for k in (0, 2, 4):
        assert abs(graphs["eval"][k] - plain["eval"][k]) / plain["eval"][k] < 1e-2, (graphs, plain)
