"""Expert adapters on the activations compiled by inductor, in bf16 (one CPU rank).

Grouped matmuls take a 3-D operand only row- or column-major in its last two dims. The first form
of `ShardedExperts._grouped_forward` permuted and copied each adapter's B with plain tensor ops,
and inductor handed grouped_mm the permuted view instead ("Invalid strides/sizes", first seen on
an H200, then here): `permuted_copy` is an op of its own so that its output stays contiguous.
aot_eager (what the distributed tests compile with) never lays tensors out, so this needs
inductor itself; bf16 because transformers runs torch's grouped_mm under compile in bf16 only.
One experts module is compiled (forward and backward), not whole blocks: the same graph of the
experts, a fraction of the compile time.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantmesh.testing import run_ranks

TOKENS, TOP_K = 12, 2


def _run(rank: int) -> dict:
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    warnings.simplefilter("ignore")
    mesh = qm.init_mesh()
    model = ZOO["qwen3_moe"].build(0).to(torch.bfloat16)
    model.config._experts_implementation = "grouped_mm"
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=8, alpha=16), dtype=torch.bfloat16)
    experts = next(m for m in model.modules() if isinstance(m, ShardedExperts))
    experts.adapters_on_activations = True
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=g)
    hidden = experts.local_shapes[next(iter(experts.tensors))][-1]  # the first tensor's input
    x = torch.randn(TOKENS, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts.num_experts, (TOKENS, TOP_K), generator=g)
    weights = torch.rand(TOKENS, TOP_K, generator=g).to(torch.bfloat16)
    out = {"route": experts.uses_activation_adapters()}
    params = [p for p in experts.parameters() if p.requires_grad]
    for compiled in (False, True):
        run = torch.compile(experts, backend="inductor", fullgraph=True) if compiled else experts
        xi = x.clone().requires_grad_()
        y = run(xi, ids, weights)
        y.float().pow(2).sum().backward()
        grads = [xi.grad.float()] + [p.grad.float().clone() for p in params]
        for p in params:
            p.grad = None
        out[compiled] = {"y": y.detach().float(), "grads": grads}
    return out


@pytest.mark.slow  # a CPU compile
def test_inductor_compiles_expert_adapters_on_the_activations_in_bf16() -> None:
    out = run_ranks(_run, 1, timeout=600)[0]
    assert out["route"]  # the path under test ran
    eager, compiled = out[False], out[True]
    rel = float((compiled["y"] - eager["y"]).abs().max() / eager["y"].abs().max())
    assert rel < 2e-2, rel  # bf16: inductor fuses and rounds otherwise than eager
    assert len(eager["grads"]) == len(compiled["grads"]) == 5  # x, A and B of both tensors
    for a, b in zip(compiled["grads"], eager["grads"], strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 5e-2
