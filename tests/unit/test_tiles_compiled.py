"""MLP tiles in compiled blocks: the same gradients, and one tile's memory.

checkpoint_blocks(tile_tokens=...) with compile_blocks: the tiles run outside the block's compiled
graph, each tile's MLP compiled on its own. Traced into the block's graph they were scheduled
together: on CPU a compiled 2-layer block with 8 tiles peaked at 2.3x the eager tiled block (218.7
against 94.7 MiB), and on one H200 a compiled tiled block kept more than a tile. The peak is the
highest sum of live CPU allocations in the profiler's memory events over one forward + backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from quantmesh.testing import cpu_peak_bytes, run_ranks
from tests.models import nonzero_lora_b_

SEQ, TILE = 1024, 128


def _run(mesh, tile: int | None, compiled: bool) -> tuple[dict, int]:
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm

    cfg = LlamaConfig(hidden_size=64, intermediate_size=1024, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=2, vocab_size=128,
                      max_position_embeddings=SEQ, use_cache=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4))
    nonzero_lora_b_(model)  # so every adapter gradient is nonzero
    qm.checkpoint_blocks(model, tile_tokens=tile)
    if compiled:
        qm.compile_blocks(model, backend="inductor")  # inductor's schedule: its memory
    model.train()
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # compiles, proves the tiles
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, cpu_peak_bytes(prof)


def _cases(rank: int) -> dict:
    import quantmesh as qm

    warnings.simplefilter("ignore")
    mesh = qm.init_mesh()
    return {
        (tile, compiled): _run(mesh, tile, compiled)
        for tile, compiled in ((None, False), (TILE, False), (None, True), (TILE, True))
    }


@pytest.mark.slow  # CPU compiles
def test_compiled_tiles_match_and_keep_one_tile():
    out = run_ranks(_cases, 1, timeout=400)[0]
    ref, _ = out[(None, False)]
    for case, (grads, _) in out.items():
        assert grads.keys() == ref.keys() and len(ref) == 2 * 7 * 2, case
        err = max(float((grads[k] - ref[k]).norm() / ref[k].norm()) for k in ref)
        assert err < 1e-5, (case, err)
    eager_tiled, compiled_untiled, compiled_tiled = (
        out[k][1] for k in ((TILE, False), (None, True), (TILE, True))
    )
    assert compiled_tiled < 1.3 * eager_tiled, (compiled_tiled, eager_tiled)
    assert compiled_tiled < 0.6 * compiled_untiled, (compiled_tiled, compiled_untiled)
