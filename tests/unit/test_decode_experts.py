"""fast_decode of a mixture of experts: int8 experts compile like the eager loop, and experts on
transformers' eager implementation are refused for a compiled step with the fix named.

The int8 experts' dequantize reached bitsandbytes through a `functools.cache`d import, whose body
torch.compile traced again and refused (a logging call) inside the fullgraph decode step; nf4
experts went another way. One CPU process, aot_eager.
"""

from __future__ import annotations

import warnings

import pytest
import torch


def test_int8_experts_decode_compiled_like_eager(monkeypatch) -> None:
    import quantmesh as qm
    from tests.models import nonzero_lora_b_
    from tests.zoo import ZOO

    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "aot_eager")
    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    model = ZOO["qwen3_moe"].build(0)  # the zoo's experts run eagerly
    qm.parallelize(model, qm.init_mesh(), quant="int8", lora=qm.LoraConfig(r=4))
    nonzero_lora_b_(model)
    model.eval()
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    eager = qm.fast_decode(model, ids, 6, compile=False)
    with pytest.raises(ValueError, match=r"mlp\.experts runs transformers' eager experts .*"
                       r'experts_implementation="grouped_mm".* compile=False'):  # fmt: skip
        qm.fast_decode(model, ids, 6, mode=None)
    model.config._experts_implementation = "grouped_mm"  # the experts' own config too
    assert torch.equal(qm.fast_decode(model, ids, 6, compile=False), eager)
    compiled = qm.fast_decode(model, ids, 6, mode=None)
    assert torch.equal(compiled, eager), (compiled, eager)
