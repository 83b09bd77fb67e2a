"""verify_plan and parallelize's safety net: a split the planner cannot prove exact is replicated
(with the reason in the plan) or its replicated weights get their partial gradients reduced; the
model that comes back always computes what the unsharded model computes. Custom blocks below each
break one assumption of the structural planner."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from quantmesh.testing import run_ranks

D, H, HD, V = 32, 4, 8, 64


class Attn(nn.Module):
    """Multi-head self-attention with knobs for the cases the planner cannot see from structure."""

    def __init__(
        self, heads: int = H, shared_norm: bool = False, head_scale: bool = False,
        slopes: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.num_heads, self.head_dim = heads, HD
        self.q_proj = nn.Linear(D, heads * HD)
        self.k_proj = nn.Linear(D, heads * HD)
        self.v_proj = nn.Linear(D, heads * HD)
        self.o_proj = nn.Linear(heads * HD, D)
        # one norm shared by every head, applied to this rank's heads: partial gradients per rank
        self.q_norm = nn.LayerNorm(HD) if shared_norm else None
        # one scale per head: read at the heads a rank holds (plan.head_views), its gradient summed
        self.head_scale = nn.Parameter(torch.ones(heads)) if head_scale else None
        # one slope per head built in the forward (as ALiBi's): with the head count set per rank,
        # every rank computes the first heads' slopes, so the split is not exact and is replicated
        self.slopes = slopes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, HD)  # (B, T, h_local, hd)
        k = self.k_proj(x).view(b, t, self.num_heads, HD)
        v = self.v_proj(x).view(b, t, self.num_heads, HD)
        if self.q_norm is not None:
            q = self.q_norm(q)
        att = torch.einsum("bthd,bshd->bhts", q, k) / HD**0.5  # (B, h, T, T)
        if self.head_scale is not None:
            att = att * self.head_scale.view(1, -1, 1, 1)
        if self.slopes:
            att = att * 2.0 ** -torch.arange(1, self.num_heads + 1).view(1, -1, 1, 1)
        y = torch.einsum("bhts,bshd->bthd", att.softmax(-1), v).reshape(b, t, -1)
        return self.o_proj(y)


class OddNames(nn.Module):
    """Head count in `n_head`, head size in an attribute of an unknown name: split evenly by the
    planner, so the sharded reshape fails until the probe finds `n_head` by its value."""

    def __init__(self):
        super().__init__()
        self.n_head, self.hsz = 2, 16
        self.c_q = nn.Linear(D, 32)
        self.c_o = nn.Linear(32, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.c_q(x).view(b, t, self.n_head, self.hsz).relu()
        return self.c_o(q.reshape(b, t, self.n_head * self.hsz))


class Block(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = attn
        self.up = nn.Linear(D, 64)
        self.down = nn.Linear(64, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.down(torch.relu(self.up(x)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 64)
        self.down = nn.Linear(64, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wg = nn.Linear(D, 4)


class RoutedBlock(nn.Module):
    """An MLP scaled per token by a router's top weight (as a mixture of experts' gate): the
    router's linear comes before the MLP's, so structure puts it in the MLP's column group,
    though a softmax reads its output, not the row layer. Each group is exact alone (without
    the MLP split, the router has no row partner and stays whole), not together."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = attn
        self.gate = Router()
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        w = self.gate.wg(x).softmax(-1).max(-1, keepdim=True).values
        return x + self.mlp(x) * w


class TwoArgs(nn.Module):
    """A forward of two required arguments: no probe input can be made from the model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net(Attn)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.net(ids) * scale


class Net(nn.Module):
    def __init__(self, make_attn, block: type[nn.Module] = Block):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList([block(make_attn()) for _ in range(2)])
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def _dense_then_routed() -> Net:
    """A dense first block, then a routed one (DeepSeek's first_k_dense_replace, AFMoE): a probe
    of the first block alone never met the router, which the plan then split wrongly."""
    net = Net(Attn)
    net.layers[1] = RoutedBlock(Attn())
    return net


CASES = {
    "plain": lambda: Net(Attn),
    "shared_norm": lambda: Net(lambda: Attn(shared_norm=True)),
    "head_scale": lambda: Net(lambda: Attn(head_scale=True)),
    "slopes": lambda: Net(lambda: Attn(slopes=True)),
    "odd_names": lambda: Net(OddNames),
    "uneven_heads": lambda: Net(lambda: Attn(heads=3)),
    "router": lambda: Net(Attn, RoutedBlock),
    "dense_then_routed": _dense_then_routed,
}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from quantmesh.tp.gather import gather_param, tp_sharded
    from quantmesh.tp.layers import sharded_modules

    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for fqn, m in sharded_modules(model).items():
        for pname, (dim, split) in tp_sharded(m).items():
            out[f"{fqn}.{pname}"] = gather_param(m.get_parameter(pname).grad, dim, split, m.group)
    return out


def _rank(rank: int) -> dict:
    import torch.distributed as dist

    import quantmesh as qm
    from quantmesh.parallel.state import parallel_state

    mesh = qm.init_mesh(tp=2)
    facts: dict = {"groups_made": {}}
    made_groups = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        made_groups.append(1)
        return new_group(*args, **kwargs)

    dist.new_group = counting  # the rank process ends after the test
    for name, make in CASES.items():
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        rng_before = torch.get_rng_state()
        made_groups.clear()
        qm.parallelize(model, mesh, example_inputs=(_ids(0),))
        facts["groups_made"][name] = len(made_groups)
        rng_same = torch.equal(rng_before, torch.get_rng_state())
        ids = _ids(1)
        y, y_ref = model(ids), ref(ids)
        y.square().mean().backward()
        y_ref.square().mean().backward()
        got, want = _grads(model), {n: p.grad for n, p in ref.named_parameters()}
        # relative to each tensor's scale, floored at 1e-3 of the largest gradient: an attention
        # key bias's gradient is zero in exact arithmetic (rounding noise on both sides)
        floor = 1e-3 * max(g.abs().max().item() for g in want.values())
        grad_err = max(
            (got[n] - g).abs().max().item() / max(g.abs().max().item(), floor)
            for n, g in want.items()
        )
        st = parallel_state(model)
        facts[name] = {
            "out_err": ((y - y_ref).abs().max() / y_ref.abs().max()).item(),
            "grad_err": grad_err,
            "rng_same": rng_same,
            "split": sorted(e.fqn for e in st.plan.sharded()),
            "reasons": {e.fqn: e.reason for e in st.plan.entries.values()},
            "reduce_grads": st.verify.reduce_grads,
            "exact_as_planned": st.verify.exact,
            "attrs": st.verify.attrs,
            "n_head": getattr(model.layers[0].attn, "n_head", None),
            "views": st.plan.head_views,
        }
    # a custom model no probe input can be made for: it says so
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        qm.parallelize(TwoArgs(), mesh)
    facts["warned"] = [str(x.message) for x in w if "not verified" in str(x.message)]
    # one whose inputs can be made (token ids for its embedding) is verified without them
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        made = qm.parallelize(Net(Attn), mesh)
    facts["made_warned"] = [str(x.message) for x in w if "not verified" in str(x.message)]
    facts["made_verified"] = parallel_state(made).verify.verified
    # the report on its own
    report = qm.verify_plan(Net(lambda: Attn(slopes=True)), mesh, inputs=(_ids(0),))
    facts["report"] = str(report)
    facts["side_groups"] = sorted(mesh.side_groups)
    # the kept groups' waits, set by the last probe (gloo: from that probe's own compute)
    facts["waits"] = {
        k: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for k, g in mesh.side_groups.items()
    }
    return facts


@pytest.fixture(scope="module")
def facts() -> dict:
    return run_ranks(_rank, 2, timeout=240)[0]


def test_the_probe_keeps_its_groups_on_the_mesh_until_a_probe_raises(facts: dict) -> None:
    """The probe's two process groups are made by the first parallelize on a mesh and reused by
    the next ones; a probe that raised (OddNames' reshape, split before its head count is found)
    leaves its group behind for a fresh one."""
    made = facts["groups_made"]
    assert made["plain"] == 2, made  # the agreement's group and the probe's
    assert made["shared_norm"] == made["head_scale"] == made["slopes"] == 0, made
    assert made["odd_names"] > 0, made
    assert facts["side_groups"] == ["verify.agree", "verify.probe"], facts["side_groups"]


def test_a_gloo_probe_waits_for_a_multiple_of_its_own_compute(facts: dict) -> None:
    """A probe of a few milliseconds that hangs (ranks that disagree on their collectives)
    costs seconds, not the 15 s ceiling: the kept groups' waits follow the last probe's compute
    (`probe_wait`), the agreement's three times the probe's."""
    from quantmesh.parallel import verify

    waits = facts["waits"]
    probe = waits["verify.probe"]
    assert verify.GLOO_PROBE_FLOOR_S <= probe < verify.GLOO_PROBE_TIMEOUT_S, waits
    assert waits["verify.agree"] == pytest.approx(3 * probe), waits
    assert verify.probe_wait(0.001) == verify.GLOO_PROBE_FLOOR_S
    assert verify.probe_wait(0.5) == pytest.approx(verify.GLOO_PROBE_COMPUTE_MARGIN * 0.5)
    assert verify.probe_wait(100.0) == verify.GLOO_PROBE_TIMEOUT_S


@pytest.mark.parametrize("case", list(CASES))
def test_exact_whatever_the_planner_assumed(facts: dict, case: str) -> None:
    f = facts[case]
    assert f["out_err"] < 1e-5, f
    assert f["grad_err"] < 1e-4, f
    assert f["rng_same"], "parallelize moved the global RNG"


def test_plain_attention_is_split_and_exact_as_planned(facts: dict) -> None:
    f = facts["plain"]
    assert f["exact_as_planned"]
    assert "layers.0.attn.q_proj" in f["split"] and "layers.1.down" in f["split"]


def test_shared_norm_keeps_the_split_and_reduces_its_gradient(facts: dict) -> None:
    f = facts["shared_norm"]
    assert "layers.0.attn.q_proj" in f["split"]
    assert f["reduce_grads"] == ["layers.*.attn.q_norm.weight", "layers.*.attn.q_norm.bias"] or (
        sorted(f["reduce_grads"]) == ["layers.*.attn.q_norm.bias", "layers.*.attn.q_norm.weight"]
    )


def test_a_per_head_parameter_is_read_at_each_ranks_heads(facts: dict) -> None:
    f = facts["head_scale"]
    assert f["exact_as_planned"], f
    assert "layers.0.attn.q_proj" in f["split"] and "layers.0.attn.o_proj" in f["split"], f
    assert f["views"]["layers.0.attn"] == {"head_scale": [(0, 2), (2, 4)]}, f


@pytest.mark.parametrize("case", ["slopes"])
def test_a_split_that_fails_is_replicated_with_the_reason(facts: dict, case: str) -> None:
    f = facts[case]
    assert not f["exact_as_planned"]
    attn = [n for n in f["reasons"] if n.startswith("layers.0.attn.") and n.count(".") == 3]
    assert attn and all(n not in f["split"] for n in attn), f
    assert all(f["reasons"][n].startswith("replicated: verify: not exact") for n in attn), f
    assert "layers.0.up" in f["split"]  # the MLP still splits


def test_groups_exact_alone_but_not_together_keep_the_largest_that_are(facts: dict) -> None:
    """Every group was replicated when the groups were exact alone but not together (HunYuan-MoE's
    router beside its shared MLP left 0.62 of its weights split); now they are added one at a
    time, the largest first, and only the router, which breaks the rest, stays whole."""
    f = facts["router"]
    assert not f["exact_as_planned"]
    assert "layers.0.gate.wg" not in f["split"], f
    why = f["reasons"]["layers.0.gate.wg"]
    assert why.startswith("replicated: verify: exact alone, not beside the larger groups kept"), why
    for kept in ("layers.0.mlp.up", "layers.0.mlp.down", "layers.0.attn.q_proj", "embed", "head"):
        assert kept in f["split"], (kept, f["split"])


def test_the_probe_keeps_a_block_of_each_structure(facts: dict) -> None:
    f = facts["dense_then_routed"]
    assert "layers.1.gate.wg" not in f["split"] and "layers.1.mlp.up" in f["split"], f
    assert f["reasons"]["layers.1.gate.wg"].startswith("replicated: verify: exact alone"), f


def test_a_head_count_of_an_unknown_layout_is_found_by_value(facts: dict) -> None:
    f = facts["odd_names"]
    assert not f["exact_as_planned"]  # the even split needs n_head per rank
    assert f["attrs"] == {"layers.*.attn": {"n_head": 2}}, f
    assert f["n_head"] == 1 and "layers.0.attn.c_q" in f["split"], f


def test_uneven_heads_leave_every_rank_on_the_same_random_stream(facts: dict) -> None:
    assert facts["uneven_heads"]["rng_same"]
    assert "layers.0.attn.q_proj" in facts["uneven_heads"]["split"]


def test_unverifiable_model_warns(facts: dict) -> None:
    assert facts["warned"] and "example_inputs" in facts["warned"][0]


def test_inputs_made_from_the_model_verify_it(facts: dict) -> None:
    assert facts["made_verified"] and not facts["made_warned"], facts["made_warned"]


def test_report_names_the_failing_group(facts: dict) -> None:
    assert "FAIL  layers.*.attn" in facts["report"], facts["report"]
    assert "-> replicate layers.*.attn.q_proj" in facts["report"]
