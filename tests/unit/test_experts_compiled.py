"""Expert adapters on the activations in blocks compiled by inductor, in bf16 (one CPU rank).

Grouped matmuls take a 3-D operand only row- or column-major in its last two dims. The first form
of `ShardedExperts._grouped_forward` permuted and copied each adapter's B with plain tensor ops,
and inductor handed grouped_mm the permuted view instead ("Invalid strides/sizes", first seen on
an H200, then here): `permuted_copy` is an op of its own so that its output stays contiguous.
aot_eager (what the distributed tests compile with) never lays tensors out, so this needs
inductor itself; bf16 because transformers runs torch's grouped_mm under compile in bf16 only.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantmesh.testing import run_ranks


def _run(rank: int) -> dict:
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    warnings.simplefilter("ignore")
    mesh = qm.init_mesh()
    case = ZOO["qwen3_moe"]
    out = {}
    for compiled in (False, True):
        model = case.build(0).to(torch.bfloat16)
        model.config._experts_implementation = "grouped_mm"
        qm.parallelize(model, mesh, lora=qm.LoraConfig(r=8, alpha=16), dtype=torch.bfloat16)
        with torch.no_grad():
            for i, (n, p) in enumerate(model.named_parameters()):
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
        experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
        for m in experts:
            m.adapters_on_activations = True
        routes = [m._grouped_routing(*_probe_args()) is not None for m in experts]
        if compiled:
            assert qm.compile_blocks(model, fullgraph=True, backend="inductor") == 2
        y = model(**case.inputs()).logits
        y.float().pow(2).mean().backward()
        grads = [p.grad.float().clone() for p in qm.trainable_parameters(model)]
        out[compiled] = {"logits": y.detach().float(), "grads": grads, "routes": routes}
    return out


def _probe_args() -> tuple:
    ids = torch.zeros(2, 1, dtype=torch.long)
    return torch.zeros(2, 1), (ids, ids.float()), {}


@pytest.mark.slow  # CPU compiles
def test_inductor_compiles_expert_adapters_on_the_activations_in_bf16() -> None:
    out = run_ranks(_run, 1, timeout=600)[0]
    eager, compiled = out[False], out[True]
    assert eager["routes"] == compiled["routes"] == [True, True]  # the path under test ran
    rel = float((compiled["logits"] - eager["logits"]).abs().max() / eager["logits"].abs().max())
    assert rel < 2e-2, rel  # bf16: inductor fuses and rounds otherwise than eager
    assert len(eager["grads"]) == len(compiled["grads"]) > 0
    for a, b in zip(compiled["grads"], eager["grads"], strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 5e-2
