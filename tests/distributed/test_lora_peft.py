"""LoRA under tensor parallelism against peft's LoRA, per-rank bytes, and the layer-split path.

Every case runs in the spawns shared with test_lora_dp.py (see _lora_cases.JOBS)."""

from __future__ import annotations

import pytest

from ._lora_cases import result


def test_tp_lora_matches_peft():
    res = result(("peft_compare", None))
    for r in res:
        # fp32, same weights and adapters: only summation order differs
        assert r["logits"] < 1e-5, r["logits"]
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-5
        assert len(r["grad_errs"]) == 2 * 4 * 2, sorted(r["grad_errs"])  # layers x targets x A, B
        for k, e in r["grad_errs"].items():
            assert e < 1e-5, (k, e)


@pytest.mark.parametrize("quant", [None, "nf4", "int8"])
def test_per_rank_bytes_are_a_tp_share(quant):
    whole = result(("param_bytes", 1, quant))[0]
    parts = result(("param_bytes", 2, quant))
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
    ref = result(("train", 1, 1, None))[0]
    got = result(("train", 2, 1, None, 5, 2))
    assert len(got) == 2 and len(ref["losses"]) == 5
    for r in got:
        for a, b in zip(r["losses"], ref["losses"], strict=True):
            assert abs(a - b) / abs(b) < 1e-5
