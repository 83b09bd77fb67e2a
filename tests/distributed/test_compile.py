"""qm.compile_blocks: compiled sharded blocks train and decode like the eager ones (tp=2, gloo).

fullgraph=True: a graph break anywhere in a block (the sharded layers, their collectives, the
quantized matmul, the adapters) fails the test instead of silently running part of it eagerly.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _train(rank: int, quant: str | None, compiled: bool) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = _llama()
    qm.parallelize(model, mesh, quant=quant, lora=qm.LoraConfig(r=4, alpha=8))
    with torch.no_grad():  # nonzero B, so that every adapter's A gets a gradient too
        for i, p in enumerate(p for n, p in model.named_parameters() if "lora_B" in n):
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    if compiled:
        assert qm.compile_blocks(model, fullgraph=True) == 2
    opt = torch.optim.SGD(qm.trainable_parameters(model), lr=0.5, momentum=0.9)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    from torch._dynamo.utils import counters

    return {"losses": losses, "grads": grads, "breaks": dict(counters["graph_break"])}


def _both(rank: int, quant: str | None) -> tuple[dict, dict]:
    return _train(rank, quant, False), _train(rank, quant, True)


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_compiled_blocks_train_like_eager(quant):
    res = run_ranks(_both, 2, quant, timeout=400)
    for eager, comp in res:
        assert comp["breaks"] == {}
        for a, b in zip(comp["losses"], eager["losses"]):
            assert abs(a - b) / abs(b) < 1e-5, (comp["losses"], eager["losses"])
        for ge, gc in zip(eager["grads"], comp["grads"]):
            assert ge.keys() == gc.keys() and len(ge) == 2 * 7 * 2  # layers x adapters x (A, B)
            for k in ge:
                err = (gc[k] - ge[k]).norm() / ge[k].norm().clamp_min(1e-12)
                assert err < 1e-4, (quant, k, float(err))


def _decode(rank: int) -> dict:
    from transformers.generation.configuration_utils import CompileConfig

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = qm.parallelize(_llama(), mesh).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    eager = model.generate(ids, **kw)
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True  # transformers compiles on accelerators only by default
    static = model.generate(ids, cache_implementation="static", compile_config=cc, **kw)
    return {
        "same": bool((eager == static).all()),
        "compiled": getattr(model, "_compiled_call", None) is not None,
    }


def test_compiled_static_cache_decoding_matches_eager():
    for r in run_ranks(_decode, 2, timeout=300):
        assert r == {"same": True, "compiled": True}


def test_compile_blocks_needs_blocks():
    import quantmesh as qm

    with pytest.raises(ValueError, match="no repeated blocks"):
        qm.compile_blocks(torch.nn.Linear(2, 2))


def _greedy(rank: int, tp: int) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=tp)
    model = _llama()
    if tp > 1:
        qm.parallelize(model, mesh)
    model.eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[:, 8:]
    got = [qm.greedy_decode(model, ids, 20, compile=c, mode=None) for c in (False, True, True)]
    eos = int(ref[0, 5])  # a token that row 0 emits: it stops there, the rest become EOS
    with_eos = qm.greedy_decode(model, ids, 20, eos_token_id=eos, compile=False, check_every=4)
    from torch._dynamo.utils import counters

    return {
        "same": [bool((g == ref).all()) for g in got],
        "eos_rows": [(r == eos).nonzero()[0, 0].item() if (r == eos).any() else None for r in ref],
        "with_eos": with_eos,
        "ref": ref,
        "frames": dict(counters["stats"]),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_decode_matches_generate(tp):
    for r in run_ranks(_greedy, tp, tp, timeout=300):
        assert r["same"] == [True, True, True]  # eager loop, compiled, compiled again (reused)
        assert r["frames"]["unique_graphs"] == 1  # the second call reused the compiled step
        ref, got = r["ref"], r["with_eos"]
        for row in range(2):
            first = r["eos_rows"][row]
            if first is None:  # never emits EOS: runs to the end unchanged
                assert got.shape[1] == 20 and (got[row] == ref[row]).all()
            else:  # equal up to its first EOS, EOS after it
                assert (got[row, : first + 1] == ref[row, : first + 1]).all()
                assert (got[row, first:] == got[row, first]).all()
