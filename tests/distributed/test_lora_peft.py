"""LoRA under tensor parallelism against peft's LoRA, per-rank bytes, and the layer-split path."""

from __future__ import annotations

import pytest

from quantmesh.testing import run_ranks

from ._lora_cases import many, param_bytes, peft_compare


def test_tp_lora_matches_peft():
    res = run_ranks(peft_compare, 2, None, timeout=180)
    for r in res:
        # fp32, same weights and adapters: only summation order differs
        assert r["logits"] < 1e-5, r["logits"]
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-5
        for k, e in r["grad_errs"].items():
            assert e < 1e-5, (k, e)


@pytest.mark.parametrize("quant", [None, "nf4", "int8"])
def test_per_rank_bytes_are_a_tp_share(quant):
    whole = run_ranks(param_bytes, 1, 1, quant, timeout=120)[0]
    parts = run_ranks(param_bytes, 2, 2, quant, timeout=120)
    # the sharded base splits evenly here (every split dim is a multiple of 2 x block size);
    # 4-bit statistics are one absmax per 64 weights, so they split evenly too
    for p in parts:
        assert p["base"] * 2 == pytest.approx(whole["base"], rel=0.02), (quant, parts, whole)
    assert sum(p["base"] for p in parts) == pytest.approx(whole["base"], rel=0.02)
    # LoRA: the split factor (B of colwise, A of rowwise) halves, the whole one is kept
    assert all(p["lora"] < whole["lora"] for p in parts)


def test_layer_split_ddp_matches_single_rank():
    """The seed layout: dp=2 replicas, each split over its own two devices (CPU 'devices' here),
    DDP with device_ids=None. Losses equal the plain one-rank run."""
    ref = run_ranks(many, 1, [(1, 1, None)], timeout=120)[0][0]
    got = run_ranks(many, 2, [(2, 1, None, 5, 2)], timeout=180)
    for r in got:
        for a, b in zip(r[0]["losses"], ref["losses"]):
            assert abs(a - b) / abs(b) < 1e-5
