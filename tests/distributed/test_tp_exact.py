"""Tensor parallelism of plain PyTorch models on gloo ranks, against the same model on one process.

Models (tests/models.py): a plain MLP (an nn.Sequential), an OpenNMT-style encoder-decoder (separate
key / value / query projections, `head_count` read in view(), cross-attention, a generator head,
untied and tied to the target embedding), a small CNN (conv -> relu -> conv pairs), and a
nanoGPT-like model whose fused q|k|v attention stores `n_head` / `n_kv_head` (grouped-query heads).
Every model is planned by `qm.auto_plan`; nothing is hand-tuned per model.

Spawning ranks dominates the cost, so each tp size is spawned once and its rank function runs every
model; the tests read the cached facts.

Tolerance. Two fp32 evaluations of one function that differ only in summation order (sharded
matmuls add per-rank partial sums, then all-reduce) each sit within fp32 rounding of the exact
result. That rounding is measured per model, as the distance of the fp32 reference from an fp64 copy
of itself (`floor_*`, up to a few 1e-6 for gradients). The sharded model must be within 4x that
floor (2x for two independent roundings, 2x margin), and never needs more than 2e-6 slack. A
sharding bug (a wrong slice, a bias added on every rank, a missing all-reduce) gives errors of
order 1.
"""

from __future__ import annotations

import pytest
import torch

from ._tp_cases import facts

CASES = ("mlp", "nmt", "nmt_tied", "cnn", "tiny_gpt")
EMPTY_CASES = ("nmt_tied", "tiny_gpt", "cnn")
# tp=4 (4 ranks on a 2-core machine) is left out by make test-fast; tp=2 covers the same checks
TPS = (2, pytest.param(4, marks=pytest.mark.slow))


# --------------------------------------------------------------------------- rank-side code


def _rank(rank: int, tp: int) -> dict:
    import quantmesh as qm
    from tests import models as M

    mesh = qm.init_mesh(tp=tp)
    out = {name: M.check_case(name, mesh, floors=rank == 0) for name in CASES}
    # The same MLP from an explicit plan (a dict of globs, not the auto planner).
    plan = qm.Plan({"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"})
    out["mlp_explicit"] = M.check_case("mlp", mesh, plan=plan, floors=rank == 0)
    out["empty"] = {name: M.check_empty(name, mesh) for name in EMPTY_CASES}
    out["dropout"] = M.check_dropout(mesh)
    out["dropout_lora"] = M.check_dropout(mesh, lora=True)
    return out


def _facts(tp: int) -> list[dict]:
    """This module's part of the spawn shared with test_tp_models.py (_tp_cases)."""
    return facts(tp, "exact")


def _tol(facts0: dict, key: str) -> float:
    """4x the reference's own fp32 error (see the module docstring), at least 2e-6."""
    return max(4 * facts0[key], 2e-6)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", CASES + ("mlp_explicit",))
def test_outputs_and_gradients_match_one_process(tp: int, name: str) -> None:
    facts = _facts(tp)
    tol_out, tol_grad = _tol(facts[0][name], "floor_out"), _tol(facts[0][name], "floor_grad")
    for rank, f in enumerate(facts):
        errs = f[name]["errs"]
        assert errs["out"] <= tol_out, f"rank {rank}: output off by {errs['out']:.2e} > {tol_out}"
        worst = {k: v for k, v in errs.items() if k != "out" and v > tol_grad}
        assert not worst, f"rank {rank}: gradients off by more than {tol_grad:.2e}: {worst}"
    if name in ("mlp", "mlp_explicit", "cnn"):  # the input itself was a leaf
        assert "input_grad.0" in facts[0][name]["errs"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", CASES)
def test_something_is_split(tp: int, name: str) -> None:
    """Guards the comparison above against a vacuous pass (a fully replicated model)."""
    f = _facts(tp)[0][name]
    assert f["split_bytes"] > 0 and len(f["shapes"]) >= 4, f["shapes"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", CASES)
def test_replicated_gradients_identical_on_every_rank(tp: int, name: str) -> None:
    """Norms, replicated layers and rowwise biases see the same (all-reduced) activations and
    gradients on every rank, so their gradients agree bit for bit: nothing can drift apart."""
    facts = _facts(tp)
    first = facts[0][name]["replicated_grads"]
    assert first, "no replicated parameter had a gradient"
    for rank, f in enumerate(facts[1:], 1):
        grads = f[name]["replicated_grads"]
        assert grads.keys() == first.keys()
        differ = [n for n in first if not torch.equal(first[n], grads[n])]
        assert not differ, f"rank {rank} differs from rank 0 on {differ}"


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", CASES)
def test_state_dict_keys_and_full_state_dict(tp: int, name: str) -> None:
    facts = _facts(tp)
    for rank, f in enumerate(facts):
        assert f[name]["keys_same"], f"rank {rank}: state_dict keys changed"
        assert f[name]["ties_broken"] == [], f"rank {rank}: {f[name]['ties_broken']}"
    assert bool(facts[0][name]["ties"]) == (name == "nmt_tied"), facts[0][name]["ties"]
    assert facts[0][name]["sd_mismatch"] == [], "full_state_dict differs from the original weights"
    assert all(f[name]["sd_mismatch"] is None for f in facts[1:])  # rank0_only


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", CASES)
def test_split_parameter_bytes(tp: int, name: str) -> None:
    """The split parameters of the sharded modules: the ranks' shares add up to the whole, and
    each is the whole / tp where the sizes divide. Rowwise and gathered-head biases stay whole on
    every rank, by design (they are added once to the complete output)."""
    facts = _facts(tp)
    whole = facts[0][name]["ref_split_bytes"]
    shares = [f[name]["split_bytes"] for f in facts]
    assert sum(shares) == whole, (shares, whole)
    if name in ("mlp", "cnn"):  # every split dimension divides by 2 and 4
        assert shares == [whole // tp] * tp, (shares, whole)
    else:  # vocabularies (99) and heads (6 over 4) split unevenly: at most one unit apart
        assert max(shares) - min(shares) < whole / tp / 2, shares
    assert len({f[name]["whole_bytes"] for f in facts}) == 1


@pytest.mark.parametrize("tp", TPS)
def test_uneven_heads_local_shapes(tp: int) -> None:
    """6 heads of 4 dims: tp=2 -> 3+3 heads; tp=4 -> 2+2+1+1 (whole heads, never half of one)."""
    heads = {2: [3, 3], 4: [2, 2, 1, 1]}[tp]
    facts = _facts(tp)
    for rank, f in enumerate(facts):
        shapes = f["nmt"]["shapes"]
        q = shapes["encoder.transformer.0.self_attn.linear_query"]["weight"]
        o = shapes["decoder.transformer_layers.1.context_attn.final_linear"]["weight"]
        assert q == (heads[rank] * 4, 24) and o == (24, heads[rank] * 4), (rank, q, o)


@pytest.mark.parametrize("tp", TPS)
def test_head_count_attributes_rewritten_per_rank(tp: int) -> None:
    """OpenNMT's head_count and a fused GQA attention's n_head / n_kv_head are read in view():
    the forward only works (and matches, see above) because each rank holds its own counts."""
    facts = _facts(tp)
    nmt_heads = {2: [3, 3], 4: [2, 2, 1, 1]}[tp]
    for rank, f in enumerate(facts):
        attrs = f["nmt"]["attrs"]
        owners = [o for o in attrs if o.endswith(("self_attn", "context_attn"))]
        assert len(owners) == 6, attrs  # 2 encoder self, 2 decoder self, 2 decoder context
        assert all(attrs[o] == {"head_count": nmt_heads[rank]} for o in owners), attrs
    gpt = [f["tiny_gpt"]["attrs"] for f in facts]
    if tp == 2:  # 6 heads in 3 KV groups of 2: 2+1 groups
        assert gpt[0]["blocks.0.attn"] == {"n_head": 4, "n_kv_head": 2}
        assert gpt[1]["blocks.1.attn"] == {"n_head": 2, "n_kv_head": 1}
    else:  # 3 KV heads cannot be split over 4 ranks: attention replicated, counts untouched
        assert all(g == {} for g in gpt), gpt
        assert "blocks.0.attn.qkv" not in facts[0]["tiny_gpt"]["shapes"]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", EMPTY_CASES)
def test_empty_model_allocates_only_shards(tp: int, name: str) -> None:
    """A skeleton built under qm.empty_model() (meta) gets only this rank's shard of every sharded
    module, on the mesh's device; nothing is left on meta; filled from the original state dict
    through param_slices() + load_param, it computes what the original computes."""
    facts = _facts(tp)
    for rank, f in enumerate(facts):
        e = f["empty"][name]
        assert e["n_sharded"] >= 4
        assert e["bad_shapes"] == [] and e["full_size"] == [] and e["meta_left"] == [], (rank, e)
        tol_out = _tol(facts[0][name], "floor_out")
        tol_grad = _tol(facts[0][name], "floor_grad")
        assert e["errs"]["out"] <= tol_out, (rank, e["errs"]["out"])
        assert max(v for k, v in e["errs"].items() if k != "out") <= tol_grad
    assert facts[0]["empty"][name]["sd_mismatch"] == []


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("case", ["dropout", "dropout_lora"])
def test_dropout_masks_keep_replicated_gradients_identical(tp: int, case: str) -> None:
    """Training with dropout: masks on whole activations (residual dropout, a colwise layer's LoRA
    dropout) must be the same on every rank even though split regions draw per-rank amounts
    (2+2+1+1 heads at tp=4); otherwise norms, biases and LoRA A would get different gradients on
    each rank and the replicas would drift apart."""
    facts = _facts(tp)
    assert all(f[case]["dropout_active"] for f in facts)
    first = facts[0][case]["replicated_grads"]
    assert any("lora_A" in n for n in first) == (case == "dropout_lora"), sorted(first)
    for rank, f in enumerate(facts[1:], 1):
        grads = f[case]["replicated_grads"]
        differ = [n for n in first if not torch.equal(first[n], grads[n])]
        assert not differ, f"rank {rank} differs from rank 0 on {differ}"
