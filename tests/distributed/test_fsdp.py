"""FSDP2 over dp (parallelize(fsdp=True)): training equal to one rank, sharded bytes, exact nf4
storage, offload policy, save -> load -> resume.

Tolerances are those of test_lora_dp.py: fp32 layouts within 1e-5 relative (only the order of
sums differs); quantized runs against the same format on one rank, within the format's own error.
The rank functions run in one spawn per world size (_fsdp_cases).
"""

from __future__ import annotations

import pytest

from ._fsdp_cases import INT8_AO, NF4_AO, TARGETS, result

pytestmark = pytest.mark.slow


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _close(got: dict, ref: dict, tol: float = 1e-5) -> None:
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert _rel(a, b) < tol, (got["losses"], ref["losses"])
    for a, b in zip(got["norms"], ref["norms"], strict=True):
        assert _rel(a, b) < tol
    for ga, gb in zip(got["grads"], ref["grads"], strict=True):
        assert ga.keys() == gb.keys()
        for k in gb:
            err = (ga[k] - gb[k]).norm() / gb[k].norm().clamp_min(1e-12)
            assert err < tol, (k, float(err))
    for k, v in ref["adapters"].items():  # the adapters after the last step
        err = (got["adapters"][k] - v).norm() / v.norm().clamp_min(1e-12)
        assert err < tol, (k, float(err))


@pytest.mark.parametrize(
    "case",
    [
        (1, 1, None, True),
        (2, 1, None, True),
        (2, 1, None, True, True),
        (2, 1, None, True, False, 4, True),
        (2, 2, None, True),
    ],
    ids=["dp1", "dp2", "dp2-offload", "dp2-checkpointed", "dp2xtp2"],
)
def test_fp32_fsdp_trains_like_one_rank(case):
    ref = result(("train", 1, 1, None, False))[0]
    got = result(("train", *case))
    assert all(r["sharded"] for r in got)  # FSDP really ran on every rank
    assert not ref["sharded"]
    _close(got[0], ref)


@pytest.mark.parametrize("layout", [(2, 1), (2, 2)], ids=["dp2", "dp2xtp2"])
def test_nf4_fsdp_within_format_error(layout):
    """torchao nf4 under FSDP vs torchao nf4 on one rank. FSDP keeps each block-scale group inside
    one dp shard, so this tiny model's scale groups are smaller than on one rank (its layers hold
    too few blocks; 7B-size layers are grouped alike): the bound is the format's own error."""
    fp32 = result(("train", 1, 1, None, False))[0]["losses"]
    ref = result(("train", 1, 1, NF4_AO, False))[0]["losses"]
    got = result(("train", *layout, NF4_AO, True))[0]["losses"]
    own = max(_rel(a, b) for a, b in zip(ref, fp32, strict=True))
    assert own > 0
    for a, b in zip(got, ref, strict=True):
        assert _rel(a, b) <= own + 1e-4, (got, ref, own)


def test_nf4_storage_survives_sharding_bit_for_bit():
    for r in result(("nf4_survives", 2)):
        assert r == {"checked": 14, "equal": True}  # 7 linears x 2 blocks, gathered == fresh


@pytest.mark.parametrize("quant", [None, NF4_AO])
def test_base_bytes_per_rank_are_half_at_dp2(quant):
    replica = result(("base_bytes", 1, 1, quant, False))[0]
    ranks = result(("base_bytes", 2, 1, quant, True))
    total = sum(r["base"] for r in ranks)
    if quant is None:  # the shards partition the replica
        assert total == replica["base"]
    else:  # nf4: smaller scale groups under FSDP (one fp32 factor more each) and the code table
        assert replica["base"] <= total <= replica["base"] * 1.01  # and scalar mean per rank
    for r in ranks:
        assert r["base"] <= replica["base"] / 2 * 1.01, (r, replica)
        assert r["adapters"] <= replica["adapters"] / 2 * 1.01


def test_offload_base_policy_on_blocks_only():
    for r in result(("offload_policies",)):
        assert r["block"] == [(True, [False])] * 2  # each block's frozen base: CPUOffloadPolicy
        assert r["adapters"] and all(a == (False, [True]) for a in r["adapters"])
        assert r["head"] == [(False, [False])]  # the head (its own group) and the root
        assert r["root"] == [(False, [False])]  # (embeddings, norm): on the device


@pytest.mark.parametrize("quant", [None, NF4_AO])
def test_save_load_resume_exact(quant):
    for r in result(("resume", 2, 1, quant)):
        assert r["fsdp_step"] == r["plain_step"] == 2
        assert r["fsdp_cont"] == r["cont"]  # the same layout: bit-exact continuation
        assert r["fsdp_end"] == 0.0
        assert r["adapter_equal"]
        if quant is not None:  # plain dp quantizes this tiny model's scales in larger groups
            continue
        # the files do not depend on fsdp: plain dp (DDP) resumes them (sums reordered only)
        for a, b in zip(r["plain_cont"], r["cont"], strict=True):
            assert _rel(a, b) < 1e-5
        assert r["plain_end"] < 1e-5


def test_refusals_name_the_fix():
    r = result(("refusals",))[0]
    assert "backend='torchao'" in r["nf4"] and "bitsandbytes nf4" in r["nf4"]
    assert "format='int8', backend='torchao'" in r["int8"]
    assert "fsdp=True" in r["offload_alone"]


def test_load_checkpoint_fills_then_shards():
    ref = result(("train", 1, 1, None, False))[0]
    for r in result(("loaded", 2, 1)):
        assert (r["before"], r["after"]) == (False, True)  # sharded once every tensor was filled
        for a, b in zip(r["losses"], ref["losses"], strict=True):
            assert _rel(a, b) < 1e-5
        ev, ev_plain = r["eval"]  # 3 examples on 2 dp ranks: FSDP's rank 1 runs an extra forward
        assert _rel(ev, ev_plain) < 1e-6
        assert "already sharded" in r["refused"] and "qm.empty_model()" in r["refused"]
        # streamed: layer 0 was sharded before layer 1 was read
        (w0, _), (w1, _) = r["streamed"]
        assert w0 < w1 <= r["puts"]


def test_load_streams_an_nf4_base_block_by_block():
    """nf4 shards hold nothing until loaded (built on meta), so a rank never holds its whole
    replica while loading: the tensors outside the layers first, then one whole layer at a time."""
    ref = result(("train", 1, 1, NF4_AO, False))[0]["losses"]
    fp32 = result(("train", 1, 1, None, False))[0]["losses"]
    own = max(_rel(a, b) for a, b in zip(ref, fp32, strict=True))
    for r in result(("loaded", 2, 1, NF4_AO)):
        assert r["after"]
        (w0, held0), (w1, held1) = r["streamed"]
        assert w0 < w1 <= r["puts"]
        assert max(held0, held1) < r["replica"], (held0, held1, r["replica"])
        for a, b in zip(r["losses"], ref, strict=True):
            assert _rel(a, b) <= own + 1e-4


@pytest.mark.parametrize("quant", [None, NF4_AO])
def test_estimate_matches_the_shards_a_rank_holds(quant):
    """estimate_memory(fsdp=True)'s weights + adapters against the bytes a dp=2 rank holds."""
    import quantmesh as qm

    from ._fsdp_cases import _quant, tiny_llama

    with qm.empty_model():
        model = tiny_llama()
    lora = qm.LoraConfig(r=4, alpha=8, targets=TARGETS)
    est = qm.estimate_memory(model, dp=2, quant=_quant(quant), lora=lora, fsdp=True, seq_len=16)
    held = result(("base_bytes", 2, 1, quant, True))[0]
    assert abs(est.weights - held["base"]) <= 0.01 * held["base"], (est.weights, held)
    assert est.lora == held["adapters"]
    assert est.ddp == 0 and est.gathered > 0


def test_nf4_fsdp_on_one_rank_is_the_plain_run():
    """dp=1: the NF4 weights stay out of FSDP (torch 2.13 gathers only one inner tensor on a
    one-rank group); everything else is FSDP's, and the run is the plain one."""
    ref = result(("train", 1, 1, NF4_AO, False))[0]
    got = result(("train", 1, 1, NF4_AO, True))[0]
    assert got["sharded"]
    _close(got, ref, tol=1e-6)


def test_int8_fsdp_is_the_one_rank_int8_run():
    """torchao int8 (int8 rows + fp32 row scales, quantized before sharding) splits by rows:
    FSDP at dp=2 trains like the same format on one rank, to fp32 tolerance."""
    ref = result(("train", 1, 1, INT8_AO, False))[0]
    fp32 = result(("train", 1, 1, None, False))[0]
    assert ref["losses"] != fp32["losses"]  # the format really quantized something
    _close(result(("train", 2, 1, INT8_AO, True))[0], ref)
