"""checkpoint_blocks and the KV cache: a training forward runs its checkpointed blocks without it.

A block that writes the cache would write it again when backward replays it. transformers' configs
mostly default to use_cache=True, so a plain `model(input_ids=ids, labels=ids)` in train mode hands
every block a cache: before, that crashed eager blocks with eager attention (the replay read its
own first keys back) and compiled blocks (recompiled for the filled cache, the replay saved other
tensors than the backward expected). Now the cache is left out (with a warning) and the gradients
are the plain step's, eager and compiled (compiled + checkpointed blocks are checked for gradients
here, on CPU); a cache that already holds tokens is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.models import nonzero_lora_b_


def _llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                      max_position_embeddings=64)  # fmt: skip
    cfg._attn_implementation = attn
    assert cfg.use_cache  # the default this test is about
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _grads(mesh, attn: str, ckpt: bool, compiled: bool) -> tuple[dict, list[str]]:
    import quantmesh as qm

    model = _llama(attn)
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4))
    nonzero_lora_b_(model)  # so every adapter gradient is nonzero
    if ckpt:
        qm.checkpoint_blocks(model)
    if compiled:
        qm.compile_blocks(model)
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()  # use_cache: the config's default
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, [str(w.message) for w in seen]


def _cases(rank: int) -> dict:
    from transformers import DynamicCache

    import quantmesh as qm

    mesh = qm.init_mesh()
    out = {}
    for attn, compiled in (("eager", False), ("sdpa", True)):
        ref, _ = _grads(mesh, attn, ckpt=False, compiled=False)
        got, said = _grads(mesh, attn, ckpt=True, compiled=compiled)
        out[(attn, compiled)] = {
            "err": max(float((got[k] - ref[k]).norm() / ref[k].norm()) for k in ref),
            "same_keys": got.keys() == ref.keys(),
            "warned": any("use_cache=False" in s for s in said),
        }
    model = _llama("eager")  # a cache that already holds tokens: refused
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4))
    qm.checkpoint_blocks(model)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        cache = model(
            input_ids=ids, past_key_values=DynamicCache(config=model.config)
        ).past_key_values
    model.train()
    try:
        model(input_ids=ids, past_key_values=cache).loss  # noqa: B018
        out["prefilled"] = None
    except ValueError as e:
        out["prefilled"] = str(e)
    return out


@pytest.mark.slow  # one CPU compile
def test_checkpointed_training_forwards_leave_the_cache_out():
    out = run_ranks(_cases, 1, timeout=300)[0]
    for case in (("eager", False), ("sdpa", True)):
        r = out[case]
        assert r["same_keys"] and r["err"] < 1e-5, (case, r)
        assert r["warned"], case
    assert out["prefilled"] and "already holds 8 tokens" in out["prefilled"], out["prefilled"]
    assert "use_cache=False" in out["prefilled"]
