"""A custom model parallelized without example inputs, as a new user does it: the plan is verified
with inputs made from the model itself (token ids for an embedding first; otherwise a tensor of the
first layer's input size for a forward of one argument), integer attributes that hold a global head
count or width are rewritten per rank (found by value, kept only when the probe proves the split
exact with them), and where no input can be made the first forward names the module, the split and
the fix instead of failing with a bare reshape error. Every result is compared with the unsharded
model in one process."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantmesh.testing import run_ranks

D, V, T = 64, 96, 16


class Attn(nn.Module):
    """The issue's attention: head count in `n_head`, head size in `hd` (no known name)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.hd = 4, 16
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_head, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_head, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_head * self.hd))


class GqaOddNames(nn.Module):
    """Grouped-query attention whose sizes have names no planner knows: 4 query heads (`h`), 2 KV
    heads (`g`), head size `s`, and the query width `w` used in the final reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.h, self.g, self.s, self.w = 4, 2, 16, 64
        self.q = nn.Linear(D, 64, bias=False)
        self.kv_k = nn.Linear(D, 32, bias=False)
        self.kv_v = nn.Linear(D, 32, bias=False)
        self.out = nn.Linear(64, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.s).transpose(1, 2)
        k = self.kv_k(x).view(b, t, self.g, self.s).transpose(1, 2)
        v = self.kv_v(x).view(b, t, self.g, self.s).transpose(1, 2)
        k = k.repeat_interleave(self.h // self.g, dim=1)
        v = v.repeat_interleave(self.h // self.g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.w))


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = attn
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.proj(F.gelu(self.fc(x)))


class ScaledEmbedding(nn.Embedding):
    """An embedding with a forward of its own and a non-persistent buffer (as Gemma's)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n, d)
        self.register_buffer("scale", torch.tensor(d**0.5), persistent=False)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class TokenModel(nn.Module):
    """Token ids in, logits out: an nn.Embedding first."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = ScaledEmbedding(V, D)
        self.blocks = nn.ModuleList([Block(Attn()) for _ in range(2)])
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


class FeatureModel(nn.Module):
    """Features in (B, T, 24): a linear first, one forward argument."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, D)
        self.blocks = nn.ModuleList([Block(GqaOddNames()) for _ in range(2)])
        self.out_head = nn.Linear(D, 8)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = self.inp(feats)
        for b in self.blocks:
            x = b(x)
        return self.out_head(x)


class MaskedModel(TokenModel):
    """Two required arguments: no probe input can be made from the model alone."""

    def forward(self, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx) * keep.unsqueeze(-1)


def _grad_err(model: nn.Module, ref: nn.Module) -> float:
    from quantmesh.tp.gather import gather_param, tp_sharded
    from quantmesh.tp.layers import sharded_modules

    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for fqn, m in sharded_modules(model).items():
        for pname, (dim, split) in tp_sharded(m).items():
            got[f"{fqn}.{pname}"] = gather_param(m.get_parameter(pname).grad, dim, split, m.group)
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[n] - g).abs().max().item() / g.abs().max().item() for n, g in want.items())


def _compare(model: nn.Module, ref: nn.Module, x: torch.Tensor, *extra) -> dict:
    y, y_ref = model(x, *extra), ref(x, *extra)
    y.square().mean().backward()
    y_ref.square().mean().backward()
    return {
        "out_err": ((y - y_ref).abs().max() / y_ref.abs().max()).item(),
        "grad_err": _grad_err(model, ref),
    }


def _parallelize(model: nn.Module, mesh) -> list[str]:
    import quantmesh as qm

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        qm.parallelize(model, mesh, plan=qm.auto_plan(model, mesh.tp))
    return [str(x.message) for x in w if "quantmesh" in str(x.message)]


def _rank(rank: int) -> dict:
    import quantmesh as qm
    from quantmesh.parallel.state import parallel_state
    from tests.distributed._zoo_cases import layout, layout_diff

    mesh = qm.init_mesh(tp=2)
    facts: dict = {}
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (2, T), generator=gen)
    feats = torch.randn(2, T, 24, generator=gen)
    for name, make, x in (("tokens", TokenModel, ids), ("features", FeatureModel, feats)):
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        warned = _parallelize(model, mesh)
        st = parallel_state(model)
        attn = model.blocks[1].attn
        facts[name] = {
            **_compare(model, ref, x),
            "warned": warned,
            "verified": st.verify is not None and st.verify.verified,
            "split": sorted(e.fqn for e in st.plan.sharded()),
            "attrs": {k: v for k, v in vars(attn).items() if type(v) is int},
            "report": str(st.verify),
            "keys": layout_diff(layout(model), layout(ref)),
        }
    torch.manual_seed(0)
    model = MaskedModel()
    warned = _parallelize(model, mesh)
    keep = torch.ones(2, T)
    try:
        model(ids, keep)
        err = ""
    except Exception as e:  # noqa: BLE001 - the message is the fact under test
        err = f"{type(e).__name__}: {e}"
    facts["masked"] = {"warned": warned, "error": err}
    return facts


@pytest.fixture(scope="module")
def facts() -> dict:
    return run_ranks(_rank, 2, timeout=300)[0]


@pytest.mark.parametrize("case", ["tokens", "features"])
def test_custom_model_is_verified_split_and_exact_without_inputs(facts: dict, case: str) -> None:
    f = facts[case]
    assert f["verified"] and not f["warned"], f
    assert f["out_err"] < 1e-5, f
    assert f["grad_err"] < 1e-4, f


@pytest.mark.parametrize("case", ["tokens", "features"])
def test_state_dict_keys_order_and_buffer_persistence_are_the_models(
    facts: dict, case: str
) -> None:
    assert facts[case]["keys"] == "", facts[case]["keys"]
    assert "tok" in facts["tokens"]["split"]  # the embedding was replaced (vocab split)


def test_issue_attention_is_split_with_its_head_count_per_rank(facts: dict) -> None:
    f = facts["tokens"]
    assert "blocks.0.attn.wq" in f["split"] and "blocks.1.attn.wo" in f["split"], f
    assert f["attrs"] == {"n_head": 2, "hd": 16}, f  # the count per rank, the head size whole
    assert "n_head" in f["report"], f["report"]


def test_attributes_of_any_name_are_found_by_value(facts: dict) -> None:
    f = facts["features"]
    assert "blocks.0.attn.q" in f["split"] and "blocks.0.attn.kv_k" in f["split"], f
    assert f["attrs"] == {"h": 2, "g": 1, "s": 16, "w": 32}, f


def test_no_input_can_be_made_first_forward_names_module_split_and_fix(facts: dict) -> None:
    f = facts["masked"]
    assert f["warned"] and "not verified" in f["warned"][0], f
    err = f["error"]
    assert err, "the unverified split ran without an error"
    assert "shape" not in err.split(":", 1)[0], err  # our error, not the bare RuntimeError
    for part in ("blocks.0.attn", "wq colwise", "example_inputs=", "n_head = 4", "blocks.*.attn"):
        assert part in err, (part, err)
