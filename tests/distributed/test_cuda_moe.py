"""Expert adapters on the activations (the default on transformers' grouped experts path) against
the weight deltas, on one GPU: a small Qwen3-MoE, nf4 experts, LoRA on the attention and both
expert tensors (non-zero B), bf16, compiled blocks (inductor, what a GPU run compiles with).

Both paths compute the same function (tested on CPU ranks to fp32 precision, eager and compiled
with aot_eager); here the loss and every adapter gradient of the compiled activation path must
match the eager weight-delta path within bf16 rounding, and the path under test must have run.
"Within bf16 rounding" is measured, not assumed: the weight-delta path compiled, against itself
eager, gives what inductor's fusions alone change in bf16 over this model (a first run with a
fixed 5% bound failed on a layer-0 attention adapter at 6.1%, every other check passing, and
the floor itself reached 10% on layer 1's expert adapters); the activation path may differ from
the eager reference by at most twice that, plus 1%. The routers'
weights are scaled up so that rounding cannot send a token to another expert.
Marked cuda: runs on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

pytestmark = pytest.mark.cuda
ROUTER_SCALE = 30.0


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
        norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # wide router margins: bf16 rounding must not route a token elsewhere
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    return model.to(torch.bfloat16)


def _step(rank: int, on_activations: bool, compiled: bool) -> dict:
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts

    mesh = qm.init_mesh()
    model = _model()
    model.config._experts_implementation = "grouped_mm"
    lora = qm.LoraConfig(r=16, alpha=32)
    qm.parallelize(model, mesh, quant="nf4", lora=lora, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B, so that every A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    for m in experts:
        m.adapters_on_activations = on_activations
    if compiled:
        qm.compile_blocks(model, fullgraph=True)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2)).to(mesh.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "loss": float(loss),
        "grads": grads,
        "route": [m.uses_activation_adapters() for m in experts],
    }


def _three(rank: int) -> tuple[dict, dict, dict]:
    # the activation path compiled; the weight deltas compiled (the floor) and eager (the reference)
    return _step(rank, True, True), _step(rank, False, True), _step(rank, False, False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_compiled_activation_adapters_train_like_eager_weight_deltas_on_a_gpu():
    got, floor, ref = run_ranks(_three, 1, timeout=600)[0]
    assert got["route"] == [True, True] and floor["route"] == ref["route"] == [False, False]
    assert abs(got["loss"] - ref["loss"]) / abs(ref["loss"]) < 1e-2, (got["loss"], ref["loss"])
    assert got["grads"].keys() == floor["grads"].keys() == ref["grads"].keys()
    experts = [k for k in ref["grads"] if ".experts." in k]
    assert len(experts) == 2 * 2 * 2, experts  # layers x tensors x (A, B)
    errs = {k: _rel(got["grads"][k], want) for k, want in ref["grads"].items()}
    compile_errs = {k: _rel(floor["grads"][k], want) for k, want in ref["grads"].items()}
    # the floor is rounding (on one H200: up to 10% on layer 1's expert adapters, 4-5% on the
    # attention's), not a broken kernel, whose wrong layout or slot gives errors of order 1
    assert max(compile_errs.values()) < 0.25, compile_errs
    bound = 2 * max(compile_errs.values()) + 0.01
    worst = max(errs, key=lambda k: errs[k])
    print(f"worst {worst}: {errs[worst]:.4f}; compile's own worst {max(compile_errs.values()):.4f}")
    assert errs[worst] <= bound, (worst, errs[worst], bound, compile_errs[worst])
