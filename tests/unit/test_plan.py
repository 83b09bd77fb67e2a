"""Plans without processes: the auto planner's decisions, the printed table, overrides, and every
PlanError, on the models of tests/models.py. Resolution is pure (no tensors move), so each check
is a plan built and read; the multi-rank numerics live in tests/distributed/test_tp_*.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import quantmesh as qm
from quantmesh.plan.heads import HeadInfo, split_features
from quantmesh.plan.styles import segmented_split, unit_split
from tests import models as M


def rows(table: str) -> dict[str, tuple[str, str, str, str]]:
    """{module column: (type, style, local weight per rank, why)}; columns are 2+ spaces apart."""
    out = {}
    for line in table.splitlines()[3:]:
        if line.startswith("per-rank attribute:"):
            continue
        module, typ, style, *rest = re.split(r"\s{2,}", line.strip())
        shapes, why = rest if len(rest) == 2 else ("", rest[0])  # no weight: empty shapes column
        out[module] = (typ, style, shapes, why)
    return out


def attr_lines(table: str) -> list[str]:
    return [ln for ln in table.splitlines() if ln.startswith("per-rank attribute:")]


@pytest.fixture(scope="module")
def llama_8_4():
    return M.llama(heads=8, kv_heads=4)  # hidden 64, head_dim 8, 2 query heads per KV head


@pytest.fixture(scope="module")
def llama_9_3():
    return M.llama(heads=9, kv_heads=3)  # hidden 72: 3 KV groups of 3 heads


# --------------------------------------------------------------------------- the table


def test_table_columns_and_collapsed_blocks() -> None:
    table = str(qm.auto_plan(M.nmt(), tp=4))
    lines = table.splitlines()
    assert lines[0] == "Plan for tp=4:"
    assert re.split(r"\s{2,}", lines[1].strip()) == [
        "module",
        "type",
        "style",
        "local weight per rank",
        "why",
    ]
    r = rows(table)
    # two encoder layers print as one row; 6 heads of 4 over 4 ranks: 2+2+1+1 heads
    assert r["encoder.transformer.*.self_attn.linear_query (x2)"] == (
        "Linear",
        "colwise",
        "8x24/8x24/4x24/4x24",
        "structure: reads the block input, head-aligned (uneven: 2+2+1+1 groups)",
    )
    assert r["decoder.transformer_layers.*.context_attn.final_linear (x2)"][1:3] == (
        "rowwise",
        "24x8/24x8/24x4/24x4",
    )
    assert r["decoder.transformer_layers.*.feed_forward.w_1 (x2)"][2] == "12x24/12x24/12x24/12x24"
    assert r["encoder.embeddings.word_lut"][1:3] == ("vocab", "9x24/9x24/9x24/9x24")
    assert r["generator"][1:] == (
        "colwise_gather",
        "10x24/10x24/10x24/10x24",
        "output head, logits gathered, even",
    )
    assert r["decoder.transformer_layers.*.layer_norm_1 (x2)"] == (
        "LayerNorm",
        "replicate",
        "24",
        "replicated: LayerNorm",
    )
    assert len(r) == 26  # 26 rows stand for 47 planned modules
    assert len(qm.auto_plan(M.nmt(), tp=4).resolve(M.nmt(), 4).entries) == 47


def test_table_head_count_attributes_once_per_block_type() -> None:
    assert attr_lines(str(qm.auto_plan(M.nmt(), tp=4))) == [
        "per-rank attribute: encoder.transformer.*.self_attn.head_count = 2/2/1/1",
        "per-rank attribute: decoder.transformer_layers.*.self_attn.head_count = 2/2/1/1",
        "per-rank attribute: decoder.transformer_layers.*.context_attn.head_count = 2/2/1/1",
    ]


def test_custom_attention_n_head_rewritten_per_rank() -> None:
    """A fused q|k|v attention that stores n_head / n_kv_head and uses them in view(): 6 heads in
    3 KV groups over 2 ranks -> 2+1 groups; each segment of qkv is split on group boundaries."""
    model = M.tiny_gpt()
    res = qm.auto_plan(model, tp=2).resolve(model, 2)
    assert res.attr_updates["blocks.0.attn"] == {"n_head": [4, 2], "n_kv_head": [2, 1]}
    qkv = res.entries["blocks.1.attn.qkv"].split
    # q (24) | k (12) | v (12); head_dim 4: q 16+8, k 8+4, v 8+4
    assert qkv.per_rank == (((0, 16), (24, 32), (36, 44)), ((16, 24), (32, 36), (44, 48)))
    table = str(qm.auto_plan(model, tp=2))
    assert attr_lines(table) == [
        "per-rank attribute: blocks.*.attn.n_head = 4/2",
        "per-rank attribute: blocks.*.attn.n_kv_head = 2/1",
    ]
    assert rows(table)["blocks.*.attn.qkv (x2)"][2:] == (
        "32x24/16x24",
        "structure: reads the block input, 3 packed segments, each KV-group-aligned "
        "(uneven: 2+1 groups)",
    )


def test_llama_uses_its_own_plan_and_splits_kv_groups(llama_8_4, llama_9_3) -> None:
    r = rows(str(qm.auto_plan(llama_8_4, tp=2)))
    assert r["model.layers.*.self_attn.q_proj (x2)"] == (
        "Linear",
        "colwise",
        "32x64/32x64",
        "model's own tp plan, KV-group-aligned",
    )
    assert r["model.layers.*.self_attn.k_proj (x2)"][2] == "16x64/16x64"
    assert r["model.layers.*.input_layernorm (x2)"][1:] == (
        "replicate",
        "64",
        "replicated: LlamaRMSNorm",
    )
    assert r["lm_head"][1] == "colwise_gather" and r["model.embed_tokens"][1] == "vocab"
    r = rows(str(qm.auto_plan(llama_9_3, tp=2)))
    assert r["model.layers.*.self_attn.q_proj (x2)"][2:] == (
        "48x72/24x72",
        "model's own tp plan, KV-group-aligned (uneven: 2+1 groups)",
    )


def test_a_style_of_the_models_plan_we_do_not_know_is_replicated_and_said() -> None:
    """DeepSeek-V2's plan asks for 'mla_kv_a_proj' (a newer transformers' style): every plan of
    DeepSeek-V2, GLM-4.7-Flash and LongCat failed with "unknown style"."""
    model = M.llama(heads=8, kv_heads=4)
    model._tp_plan = {**model._tp_plan, "model.layers.*.self_attn.k_proj": "mla_kv_a_proj"}
    r = rows(str(qm.auto_plan(model, tp=2)))
    assert r["model.layers.*.self_attn.k_proj (x2)"][1:4:2] == (
        "replicate",
        "replicated: the model's plan asks for 'mla_kv_a_proj', not implemented here",
    )


def test_unsplittable_kv_heads_say_why(llama_9_3) -> None:
    r = rows(str(qm.auto_plan(llama_9_3, tp=4)))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert r[f"model.layers.*.self_attn.{proj} (x2)"][1:4:2] == (
            "replicate",
            "replicated: 3 KV heads cannot be split over 4 ranks",
        )
    assert r["model.layers.*.mlp.down_proj (x2)"][1] == "rowwise"  # the MLP still splits


def test_packed_qkv_follows_its_replicated_reader() -> None:
    """3 KV heads over 4 ranks: proj cannot be split, so the packed qkv that feeds it must not be
    either (its output would reach proj as a quarter of what proj reads)."""
    r = rows(str(qm.auto_plan(M.tiny_gpt(), tp=4)))
    assert r["blocks.*.attn.proj (x2)"][3] == "replicated: 3 KV heads cannot be split over 4 ranks"
    assert r["blocks.*.attn.qkv (x2)"][1:] == (
        "replicate",
        "48x24",
        "replicated: its reader proj is not split rowwise",
    )
    assert r["blocks.*.mlp.0 (x2)"][1] == "colwise"


def test_plain_mlp_and_cnn_pairs() -> None:
    r = rows(str(qm.auto_plan(M.mlp(), tp=2)))
    assert {k: v[1:3] for k, v in r.items()} == {
        "0": ("colwise", "24x16/24x16"),
        "2": ("rowwise", "16x24/16x24"),
        "4": ("colwise", "28x16/28x16"),
        "6": ("rowwise", "16x28/16x28"),
    }
    r = rows(str(qm.auto_plan(M.cnn(), tp=4)))
    assert r["0.0"][:3] == ("Conv2d", "colwise", "4x3x3x3/4x3x3x3/4x3x3x3/4x3x3x3")
    assert r["0.2"][1:3] == ("rowwise", "8x4x3x3/8x4x3x3/8x4x3x3/8x4x3x3")
    assert r["0.4"][1] == "colwise" and r["0.6"][1] == "rowwise"
    assert r["3"][1:] == ("replicate", "10x8", "replicated: not part of a column/row pair")


def test_tp1_splits_nothing() -> None:
    model = M.nmt()
    res = qm.auto_plan(model, tp=1).resolve(model, 1)
    assert res.sharded() == [] and res.attr_updates == {}
    assert {e.reason for e in res.entries.values() if e.style != "replicate"} == {"tp=1"}


def test_plan_without_model_prints_its_rules() -> None:
    assert str(qm.Plan({"blocks.*.fc": "colwise_rep"})) == "blocks.*.fc: colwise_gather"


# --------------------------------------------------------------------------- overrides


def test_glob_override_changes_the_style() -> None:
    model = M.nmt()
    plan = qm.auto_plan(model, tp=2).override({"*.feed_forward.w_1": "replicate"})
    res = plan.resolve(model, 2)
    w1 = [e for f, e in res.entries.items() if f.endswith("feed_forward.w_1")]
    w2 = [e for f, e in res.entries.items() if f.endswith("feed_forward.w_2")]
    assert len(w1) == 4 and all(e.style == "replicate" and e.reason == "override" for e in w1)
    # w_2 still splits its input: it takes its slice of the whole input it now receives
    assert len(w2) == 4 and all(e.style == "rowwise" and e.split is not None for e in w2)
    assert res.entries["generator"].style == "colwise_gather"  # the rest is untouched


def test_override_of_a_reader_replicates_its_writer() -> None:
    model = M.nmt()
    plan = qm.auto_plan(model, tp=2).override({"decoder.*.feed_forward.w_2": "replicate"})
    r = rows(plan.table())
    assert r["decoder.transformer_layers.*.feed_forward.w_1 (x2)"][1:4:2] == (
        "replicate",
        "replicated: its reader w_2 is not split rowwise",
    )
    assert r["encoder.transformer.*.feed_forward.w_1 (x2)"][1] == "colwise"


def test_exact_override_and_later_rules_win() -> None:
    model = M.nmt()
    plan = qm.auto_plan(model, tp=2)
    plan = plan.override({"*.w_1": "replicate"}).override(
        {"encoder.transformer.0.feed_forward.w_1": "colwise"}
    )
    res = plan.resolve(model, 2)
    assert res.entries["encoder.transformer.0.feed_forward.w_1"].style == "colwise"
    assert res.entries["encoder.transformer.1.feed_forward.w_1"].style == "replicate"


def test_override_matching_no_module_errors() -> None:
    model = M.nmt()
    plan = qm.auto_plan(model, tp=2).override({"decoder.transformer_layers.*.w_3": "colwise"})
    with pytest.raises(
        qm.PlanError,
        match=r"plan rule 'decoder.transformer_layers.\*.w_3' "
        r"matches no module of NMTModel",
    ):
        plan.resolve(model, 2)
    with pytest.raises(qm.PlanError) as info:
        qm.auto_plan(model, 2).override({"generator.final_linear": "rowwise"}).resolve(model, 2)
    assert "modules with that last name: encoder.transformer.0.self_attn.final_linear" in str(
        info.value
    )


# --------------------------------------------------------------------------- PlanErrors


def test_unknown_style() -> None:
    with pytest.raises(qm.PlanError) as info:
        qm.Plan({"generator": "diagonal"})
    assert str(info.value) == (
        "unknown style 'diagonal' for generator; use one of colwise, colwise_gather, rowwise, "
        "vocab, replicate"
    )


def test_style_that_does_not_fit_the_module() -> None:
    model = M.nmt()
    with pytest.raises(qm.PlanError) as info:
        qm.Plan({"encoder.layer_norm": "colwise"}).resolve(model, 2)
    assert str(info.value).startswith(
        "style 'colwise' does not fit encoder.layer_norm (LayerNorm): quantmesh splits Linear"
    )
    assert str(info.value).endswith("use 'replicate' for it")
    with pytest.raises(
        qm.PlanError,
        match="style 'vocab' needs an Embedding, but generator is a "
        "Linear; use 'colwise' or 'rowwise'",
    ):
        qm.Plan({"generator": "vocab"}).resolve(model, 2)
    with pytest.raises(
        qm.PlanError,
        match=r"decoder.embeddings.word_lut is an Embedding; use "
        r"'vocab' \(split its rows\) or 'replicate'",
    ):
        qm.Plan({"decoder.embeddings.word_lut": "colwise"}).resolve(model, 2)


def test_tied_weights_split_differently() -> None:
    model = M.nmt(share_decoder_embeddings=True)
    plan = qm.auto_plan(model, tp=2)
    plan.resolve(model, 2)  # the auto plan splits the tied pair alike
    with pytest.raises(qm.PlanError) as info:
        plan.override({"generator": "replicate"}).resolve(model, 2)
    assert str(info.value) == (
        "tied weights are split differently: decoder.embeddings.word_lut.weight (vocab), "
        "generator.weight (replicate); give both the same split (an embedding 'vocab' with its "
        "head 'colwise_gather'), or replicate both"
    )


class _TiedBiasHead(nn.Module):
    """BERT's pattern: the decoder's bias is a parameter of its parent."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 20)
        self.bias = nn.Parameter(torch.zeros(20))
        self.decoder.bias = self.bias


def test_tied_bias_cannot_be_split() -> None:
    """A colwise decoder would split the bias that its parent holds whole; colwise_gather keeps
    its bias whole (added after the gather), so it is allowed."""
    model = nn.Sequential(_TiedBiasHead())
    qm.Plan({"0.decoder": "colwise_gather"}).resolve(model, 2)
    with pytest.raises(
        qm.PlanError,
        match=r"tied weights are split differently: 0.bias \(replicate\), "
        r"0.decoder.bias \(colwise\)",
    ):
        qm.Plan({"0.decoder": "colwise"}).resolve(model, 2)


def test_weight_read_directly_is_replicated_with_reason() -> None:
    """DirectProj.forward calls F.linear(x, self.proj.weight): splitting proj would hand that call
    a slice; proj stays whole, and so does fc, whose output proj reads."""
    model = M.Stack(M.DirectProj)
    for plan in (
        qm.auto_plan(model, tp=2),
        qm.Plan({"layers.*.fc": "colwise", "layers.*.proj": "rowwise"}),
    ):
        res = plan.resolve(model, 2)
        assert res.sharded() == []
        assert res.entries["layers.1.proj"].reason == (
            "replicated: DirectProj.forward reads proj.weight directly"
        )
        assert res.entries["layers.1.fc"].reason == (
            "replicated: its reader proj is not split rowwise"
        )


def test_multihead_attention_is_replicated_with_reason() -> None:
    model = M.Stack(M.MHABlock)
    r = rows(str(qm.auto_plan(model, tp=2)))
    assert r["layers.*.attn (x2)"] == (
        "MultiheadAttention",
        "replicate",
        "",
        "replicated: MultiheadAttention has no parallel form",
    )
    assert r["layers.*.attn.out_proj (x2)"][1:] == (
        "replicate",
        "16x16",
        "replicated: MultiheadAttention.forward reads out_proj.weight directly",
    )
    assert r["layers.*.fc1 (x2)"][1] == "colwise" and r["layers.*.fc2 (x2)"][1] == "rowwise"
    res = qm.Plan({"layers.*.attn.out_proj": "rowwise"}).resolve(model, 2)  # asking does not help
    assert res.sharded() == []


def test_errors_come_before_any_allocation() -> None:
    """parallelize validates the whole plan first: a bad rule fails with the model untouched."""
    model = M.nmt()
    before = {n: type(m) for n, m in model.named_modules()}
    mesh = SimpleNamespace(tp=2, tp_rank=0, dp=1, pp=1, devices=[torch.device("cpu")])
    with pytest.raises(qm.PlanError, match="is an Embedding"):
        qm.parallelize(
            model, mesh, plan={"generator": "colwise", "encoder.embeddings.word_lut": "rowwise"}
        )
    assert {n: type(m) for n, m in model.named_modules()} == before


# --------------------------------------------------------------------------- head-aware splits


def test_split_features_on_kv_groups() -> None:
    gqa = HeadInfo(heads=9, kv_heads=3, head_dim=64, owner="", from_config=True)
    assert split_features(576, 2, gqa)[0].sizes() == [384, 192]  # q: 2 + 1 groups of 3 heads
    assert split_features(192, 2, gqa)[0].sizes() == [128, 64]  # k, v: 2 + 1 KV heads
    split, why = split_features(576, 4, gqa)
    assert split is None and why == "3 KV heads cannot be split over 4 ranks"
    mha = HeadInfo(heads=6, kv_heads=6, head_dim=8, owner="attn", from_config=False)
    split, why = split_features(48, 4, mha)
    assert split.sizes() == [16, 16, 8, 8] and why == "head-aligned (uneven: 2+2+1+1 groups)"


def test_split_features_without_heads() -> None:
    assert split_features(88, 4, None) == (unit_split(88, 2, [11, 11, 11, 11]), "even")
    split, why = split_features(99, 4, None)
    assert split.sizes() == [25, 25, 25, 24] and why == "uneven"
    assert split_features(3, 4, None) == (None, "3 features cannot be split over 4 ranks")


def test_segmented_split_keeps_segments_together() -> None:
    q = unit_split(8, 2, [3, 1])
    kv = unit_split(4, 2, [1, 1])
    assert segmented_split([q, kv, kv]).per_rank == (
        ((0, 6), (8, 10), (12, 14)),
        ((6, 8), (10, 12), (14, 16)),
    )


def test_per_head_parameters_are_read_through_each_ranks_heads() -> None:
    """gpt-oss's attention sinks (one per head) stay whole and are read at the heads a rank holds:
    6 heads in 3 KV groups of 2 over 2 ranks give heads 0:4 and 4:6 (2 + 1 groups)."""
    from quantmesh.tp.apply import view_heads
    from tests.zoo import ZOO

    model = ZOO["gpt_oss"].build(0)
    res = qm.auto_plan(model, 2).resolve(model, 2)
    attns = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert res.head_views == {a: {"sinks": [(0, 4), (4, 6)]} for a in attns}
    table = qm.auto_plan(model, 2).table(model, 2)
    assert "per-head parameter: model.layers.*.self_attn.sinks read at heads 0:4/4:6" in table
    attn = model.get_submodule(attns[0])
    full = attn.sinks.detach().clone()
    view_heads(attn, {"sinks": (4, 6)})
    assert torch.equal(attn.sinks, full[4:6])  # the forward reads this rank's rows
    assert [n for n, _ in attn.named_parameters()].count("sinks") == 1  # the state stays whole
    assert attn.state_dict()["sinks"].shape == (6,)
    attn.sinks.sum().backward()  # the gradient reaches this rank's rows of the one parameter
    assert attn._parameters["sinks"].grad.tolist() == [0, 0, 0, 0, 1, 1]
    view_heads(attn, {"sinks": (0, 4)})  # viewed again: the original class is subclassed once
    assert type(attn).__mro__[1] is type(ZOO["gpt_oss"].build(0).get_submodule(attns[0]))
    # an attention without per-head parameters gets no view
    llama = M.llama(heads=8, kv_heads=4)
    assert qm.auto_plan(llama, 2).resolve(llama, 2).head_views == {}


def test_norms_over_a_split_width_take_their_statistic_over_tp() -> None:
    """OLMoE's q_norm / k_norm normalize q and k over all heads at once: the plan lists them as
    split norms at the features each rank holds (the forward's exactness: the zoo, at tp 2 and 3)."""
    from tests.zoo import ZOO

    model = ZOO["olmoe"].build(0)  # 6 heads of 8: 48 features, 3 heads a rank
    res = qm.auto_plan(model, 2).resolve(model, 2)
    norms = {f"model.layers.{i}.self_attn.{n}": [(0, 24), (24, 48)] for i in range(2)
             for n in ("q_norm", "k_norm")}  # fmt: skip
    assert res.split_norms == norms
    table = qm.auto_plan(model, 2).table(model, 2)
    assert "split norm: model.layers.*.self_attn.q_norm over features 0:24/24:48" in table
    # a per-head norm (Qwen3: the width of one head) is not one: replicated, gradient reduced
    qwen3 = ZOO["qwen3_moe"].build(0)
    assert qm.auto_plan(qwen3, 2).resolve(qwen3, 2).split_norms == {}
