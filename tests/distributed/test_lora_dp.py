"""The master invariance test: every (dp, tp) layout trains like dp=1, tp=1.

Same seed, same global batch, 5 SGD-momentum steps of LoRA training on a small Llama (GQA: 4 heads, 2 KV
heads). Exact formats must agree within 1e-5 relative (fp32; sharded matmuls and all-reduces only
reorder sums). Quantized runs are compared with the same quantization on one rank.

The layouts run in the spawns shared with test_lora_peft.py and test_lora_errors.py (_lora_cases).
"""

from __future__ import annotations

import pytest
import torch

from ._lora_cases import LAYOUTS, TARGETS, result


def _run(*case) -> list[dict]:
    """One training layout's per-rank results (from the shared spawn of its world size)."""
    return result(("train", *case))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _steps(got: list, ref: list, n: int = 5) -> list[tuple]:
    """Pairs of per-step values, after checking both runs recorded all `n` steps."""
    assert len(got) == len(ref) == n, (len(got), len(ref))
    return list(zip(got, ref, strict=True))


@pytest.mark.parametrize("layout", [(1, 2), (2, 1), (2, 2), (1, 4)])
def test_fp32_layouts_match_single_rank(layout):
    ref = _run(1, 1, None)[0]
    got = _run(*layout, None)[0]
    # fp32: only the order of summation differs (split matmuls, all-reduce), ~1e-7 relative here
    for a, b in _steps(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5, (layout, got["losses"], ref["losses"])
    for step, (ga, gb) in enumerate(_steps(got["grads"], ref["grads"])):
        assert ga.keys() == gb.keys() and len(gb) == 2 * len(TARGETS) * 2  # layers x targets x A, B
        for k in gb:
            # relative to the gradient's norm (a max-element ratio would amplify near-zero entries)
            err = (ga[k] - gb[k]).norm() / gb[k].norm().clamp_min(1e-12)
            assert err < 1e-5, (layout, step, k, float(err))
    for a, b in _steps(got["norms"], ref["norms"]):
        assert _rel(a, b) < 1e-5  # clip_grad_norm_ sees the true global norm


def test_replicated_trainables_never_drift():
    """Every replica of every adapter (over dp, and over tp where it is kept whole) is bitwise
    equal after 5 steps, in every layout of more than one rank; each layout compared something."""
    for case in LAYOUTS[2] + LAYOUTS[4]:
        for rank_result in _run(*case):
            assert rank_result["replicas"]["equal"], case
            assert rank_result["replicas"]["compared"] > 0, case


def test_grad_accumulation_with_no_sync_matches():
    ref = _run(1, 1, None)[0]
    got = _run(2, 1, None, 5, 1, 2)[0]  # dp=2, two micro-steps each, the first under no_sync
    for a, b in _steps(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5


def test_nf4_block_aligned_shards_are_exact():
    """Without double quantization, block-aligned shards quantize to the very same codes and
    absmax as the whole weight (every local row / column block is a multiple of 64), so tp=2
    trains exactly like tp=1 with the same format (fp32 tolerance)."""
    ref, got = _run(1, 1, "nf4_no_double_quant")[0], _run(1, 2, "nf4_no_double_quant")[0]
    for a, b in _steps(got["losses"], ref["losses"]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("fmt,layout", [("nf4", (1, 2)), ("int8", (1, 2)), ("nf4", (2, 2))])
def test_quantized_layouts_within_format_error(fmt, layout):
    """Double quantization (nf4) and per-row scales (int8) see different statistics per shard, so
    sharded runs differ from the one-rank quantized run by a fraction of the format's own error.
    Bound: the one-rank quantized model's distance from fp32, plus 1e-4 relative."""
    fp32 = _run(1, 1, None)[0]["losses"]
    ref = _run(1, 1, fmt)[0]["losses"]
    got = _run(*layout, fmt)[0]["losses"]
    own_error = max(_rel(a, b) for a, b in _steps(ref, fp32))
    assert own_error > 0  # the format really quantized something
    for a, b in _steps(got, ref):
        assert _rel(a, b) <= own_error + 1e-4, (fmt, layout, got, ref, own_error)
    assert all(torch.isfinite(torch.tensor(got)))
