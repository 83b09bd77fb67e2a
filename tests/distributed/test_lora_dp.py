"""The master invariance test: every (dp, tp) layout trains like dp=1, tp=1.

Same seed, same global batch, 5 SGD-momentum steps of LoRA training on a small Llama (GQA: 4 heads, 2 KV
heads). Exact formats must agree within 1e-5 relative (fp32; sharded matmuls and all-reduces only
reorder sums). Quantized runs are compared with the same quantization on one rank.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

from ._lora_cases import many


@pytest.fixture(scope="module")
def runs():
    """All layouts, grouped by world size so each size spawns once."""
    w1 = [(1, 1, None), (1, 1, "nf4"), (1, 1, "int8"), (1, 1, "nf4_no_double_quant")]
    w2 = [
        (1, 2, None),
        (2, 1, None),
        (1, 2, "nf4"),
        (1, 2, "int8"),
        (1, 2, "nf4_no_double_quant"),
        (2, 1, None, 5, 1, 2),
    ]
    w4 = [(2, 2, None), (1, 4, None), (2, 2, "nf4")]
    out = {}
    for world, cases in ((1, w1), (2, w2), (4, w4)):
        res = run_ranks(many, world, cases, timeout=300)
        for i, c in enumerate(cases):
            out[c] = [r[i] for r in res]
    return out, w1, w2, w4


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout", [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_fp32_layouts_match_single_rank(runs, layout):
    out, w1, *_ = runs
    ref = out[w1[0]][0]
    got = out[(*layout, None)][0]
    # fp32: only the order of summation differs (split matmuls, all-reduce), ~1e-7 relative here
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5, (layout, got["losses"], ref["losses"])
    for step, (ga, gb) in enumerate(zip(got["grads"], ref["grads"])):
        assert ga.keys() == gb.keys()
        for k in gb:
            # relative to the gradient's norm (a max-element ratio would amplify near-zero entries)
            err = (ga[k] - gb[k]).norm() / gb[k].norm().clamp_min(1e-12)
            assert err < 1e-5, (layout, step, k, float(err))
    for a, b in zip(got["norms"], ref["norms"]):
        assert _rel(a, b) < 1e-5  # clip_grad_norm_ sees the true global norm


def test_replicated_trainables_never_drift(runs):
    out, _, w2, w4 = runs
    for case in w2 + w4:
        for rank_result in out[case]:
            assert rank_result["replicas"], case


def test_grad_accumulation_with_no_sync_matches(runs):
    out, w1, *_ = runs
    ref = out[w1[0]][0]
    got = out[(2, 1, None, 5, 1, 2)][0]  # dp=2, two micro-steps each, the first under no_sync
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5


def test_nf4_block_aligned_shards_are_exact(runs):
    """Without double quantization, block-aligned shards quantize to the very same codes and
    absmax as the whole weight (every local row / column block is a multiple of 64), so tp=2
    trains exactly like tp=1 with the same format (fp32 tolerance)."""
    out, w1, w2, _ = runs
    ref, got = out[w1[3]][0], out[w2[4]][0]
    for a, b in zip(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("fmt,layout", [("nf4", (1, 2)), ("int8", (1, 2)), ("nf4", (2, 2))])
def test_quantized_layouts_within_format_error(runs, fmt, layout):
    """Double quantization (nf4) and per-row scales (int8) see different statistics per shard, so
    sharded runs differ from the one-rank quantized run by a fraction of the format's own error.
    Bound: the one-rank quantized model's distance from fp32, plus 1e-4 relative."""
    out, w1, *_ = runs
    fp32 = out[w1[0]][0]["losses"]
    ref = out[(1, 1, fmt)][0]["losses"]
    got = out[(*layout, fmt)][0]["losses"]
    own_error = max(_rel(a, b) for a, b in zip(ref, fp32))
    assert own_error > 0  # the format really quantized something
    for a, b in zip(got, ref):
        assert _rel(a, b) <= own_error + 1e-4, (fmt, layout, got, ref, own_error)
    assert all(torch.isfinite(torch.tensor(got)))
