"""The decode step recorded by hand (infer/step_graph.py) on CPU: a recorder stands in for CUDA
graphs. Its "replay" runs the compiled function once more on the very inputs the recording noted
(the tensors a real graph would read at their recorded addresses) and writes the result into the
recording's output, as a graph's replay does; a recording runs the step once, as a capture
followed by its first replay does. So a recording that should have been made again (a parameter
replaced, a recompile) reads the stale tensors here as a real graph would, and gives other values.
The replay of a real graph is checked on a GPU (tests/distributed/test_cuda_decode.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import quantmesh as qm
from quantmesh.infer import step_graph as SG


class _Rerun:
    """A recording of `graph`'s step that reruns its noted compiled function on its noted
    inputs."""

    def __init__(self, graph: SG.StepGraph) -> None:
        self.graph = graph
        self.fresh = False
        self.replays = 0
        self.addresses: list = []  # the inputs' addresses at the recording's first replay

    def record(self, fn):
        out = fn()  # (a capture does not run; its first replay does: `fresh`)
        self.fresh = True
        return out

    def replay(self) -> None:
        self.replays += 1
        g = self.graph
        if self.fresh:  # the addresses a graph would read from now on: those of its recording
            self.fresh = False
            self.addresses = SG.tensor_addresses(g.inputs)
            return
        # a real graph reads its inputs where they were when it was recorded: a tensor whose
        # storage moved since (`.data` assigned, as `Module.to` does) would be read stale
        now = SG.tensor_addresses(g.inputs)
        moved = [i for i, (a, b) in enumerate(zip(now, self.addresses, strict=True)) if a != b]
        assert not moved, f"replayed with inputs {moved} away from their recorded addresses"
        new = [t for t in pytree.tree_leaves(g.fn(*g.inputs)) if isinstance(t, torch.Tensor)]
        outs = pytree.tree_leaves(g.out)
        assert len(outs) == 1, outs
        like = [t for t in new if t.shape == outs[0].shape and t.dtype == outs[0].dtype]
        assert len(like) == 1, [(t.shape, t.dtype) for t in new]
        outs[0].copy_(like[0])


@pytest.fixture
def rerun(monkeypatch):
    """CPU among the devices that record, `_Rerun` as the recorder, AOT autograd's eager backend
    (its runtime wrappers, which apply the cache's writes, as inductor's do)."""
    made: list[_Rerun] = []

    def recorder(graph):
        made.append(_Rerun(graph))
        return made[-1]

    monkeypatch.setattr(SG, "ENABLED", True)
    monkeypatch.setattr(SG, "CHECK_REPLAYS", True)  # (the default, whatever the environment says)
    monkeypatch.setattr(SG, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(SG, "RECORDER", recorder)
    monkeypatch.setenv("QUANTMESH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()  # (each decoder compiles its step anew: dynamo's limit is per process)
    return made


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _ids(batch: int = 1, n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, n), generator=torch.Generator().manual_seed(seed))


KINDS = {  # fast_decode's keywords: every kind of step input (tokens, noise, padding, penalty)
    "greedy": {},
    "sampled": {"temperature": 0.9, "top_p": 0.9, "seed": 3},
    "penalized": {"repetition_penalty": 1.3},
    "padded": {"attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])},
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_recorded_steps_give_the_eager_loops_tokens(rerun, kind):
    """Two calls of 12 tokens: the eager loop's tokens; one recording, made at the first call's
    second step, replayed by every later step, the second call's first too: its check runs the
    compiled frame, whose call of the recorded function launches nothing (had it run, the cache
    would have advanced twice that step, and the tokens would differ)."""
    kw = KINDS[kind]
    ids = _ids(2 if kind == "padded" else 1)
    model, ref = _llama(), _llama()
    want = qm.fast_decode(ref, ids, 12, compile=False, **kw)
    for _ in range(2):
        got = qm.fast_decode(model, ids, 12, **kw)
        assert torch.equal(got, want), (kind, got, want)
    graph = model.__dict__["_quantmesh_decoder"].step_graph
    assert graph is not None and graph.records == 1
    assert len(rerun) == 1 and rerun[0].replays == 10 + 11  # 11 steps a call; the first call's
    # first runs before any recording, the second's checks it and replays it


def _changed(model) -> None:
    with torch.no_grad():
        w = model.model.layers[0].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * 3 * w.std())


def _new_parameter(lin: nn.Linear) -> None:
    lin.weight = nn.Parameter(lin.weight.detach().clone())


def _new_storage(lin: nn.Linear) -> None:
    lin.weight.data = lin.weight.data.clone()


@pytest.mark.parametrize("move", [_new_parameter, _new_storage], ids=["parameter", "storage"])
def test_a_weight_at_a_new_address_is_recorded_again(rerun, move):
    """A parameter replaced by another tensor, or the same Parameter given new storage (`.data`
    assigned, as `Module.to` and `.cpu()` / `.cuda()` round trips do; dynamo's guards see the
    same tensor), with new values, between calls: the check at the call's first step compares
    the addresses the recording read, not the tensor's present one, so the step is recorded again;
    the tokens are the eager loop's on the changed model (a stale recording reads the old weight)."""
    ids = _ids()
    model, ref = _llama(), _llama()
    before = qm.fast_decode(model, ids, 12)
    for m in (model, ref):
        move(m.model.layers[0].mlp.down_proj)
        _changed(m)
    want = qm.fast_decode(ref, ids, 12, compile=False)
    assert not torch.equal(want, before)  # (the change changes the tokens)
    got = qm.fast_decode(model, ids, 12)
    assert torch.equal(got, want), (got, want)
    graph = model.__dict__["_quantmesh_decoder"].step_graph
    assert graph.records == 2
    assert (
        graph.changed is not None and "(64, 128) torch.float32) at another address" in graph.changed
    )


def test_a_parameter_changed_in_place_keeps_the_recording(rerun):
    """Values changed in place (an optimizer's step): the recording reads them; not recorded
    again, the eager loop's tokens."""
    ids = _ids()
    model, ref = _llama(), _llama()
    before = qm.fast_decode(model, ids, 12)
    _changed(model)
    _changed(ref)
    want = qm.fast_decode(ref, ids, 12, compile=False)
    assert not torch.equal(want, before)
    got = qm.fast_decode(model, ids, 12)
    assert torch.equal(got, want), (got, want)
    graph = model.__dict__["_quantmesh_decoder"].step_graph
    assert graph.records == 1 and graph.changed is None


def test_a_recompiled_step_is_recorded_again(rerun):
    """Another compiled function at a call's first step (dynamo compiled the step again: here a
    branch it took flipped, its inputs the same tensors) drops the recording; the next step
    records the new function."""
    graph = SG.StepGraph(_Rerun)
    lin = nn.Linear(4, 4)
    flag = {"on": False}  # (a branch: dynamo guards on it, and compiles again when it flips)

    def f(x):
        return lin(x) * (3.0 if flag["on"] else 2.0)

    step = torch.compile(f, backend=SG.backend("eager"), fullgraph=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for k in (2.0, 3.0):
            flag["on"] = k == 3.0
            graph.begin()
            for i in range(3):
                y = x + i
                assert torch.allclose(graph(step, y), lin(y) * k), (k, i)
    assert graph.records == 2
    assert graph.changed == "another compiled function (the step was compiled again)"


class _Refusing(_Rerun):
    def record(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_refused_recording_is_said_and_steps_run_compiled(rerun, monkeypatch):
    """A recording the runtime refuses: a warning that names the error, and every step of this
    decoder runs the compiled function itself (the eager loop's tokens), never recording again."""
    monkeypatch.setattr(SG, "RECORDER", _Refusing)
    ids = _ids()
    model, ref = _llama(), _llama()
    want = qm.fast_decode(ref, ids, 12, compile=False)
    with pytest.warns(UserWarning, match="recording the decode step as a CUDA graph failed "
                      r"\(RuntimeError: operation not permitted"):  # fmt: skip
        got = qm.fast_decode(model, ids, 12)
    assert torch.equal(got, want)
    assert torch.equal(qm.fast_decode(model, ids, 12), want)
    graph = model.__dict__["_quantmesh_decoder"].step_graph
    assert graph.records == 0 and graph.refused is not None


def test_a_step_input_that_is_no_tensor_is_refused(rerun):
    graph = SG.StepGraph(_Rerun)
    step = torch.compile(lambda x, k: x * k, backend=SG.backend("eager"), fullgraph=True)
    graph.begin()
    graph(step, torch.ones(2), 3)  # (the check runs the function itself)
    with pytest.raises(TypeError, match="tensors"):
        graph(step, torch.ones(2), 3)


def _tp_recorded(rank: int) -> dict:
    """At tp=2 (gloo): the eager loop's tokens, then two compiled calls with the step recorded
    (`_Rerun`: its replays run the graph's collectives, so both ranks must record and replay in
    lock step), a parameter of each rank's shard replaced between them."""
    import quantmesh as qm

    SG.DEVICES, SG.RECORDER = ("cuda", "cpu"), _Rerun
    mesh = qm.init_mesh(tp=2)
    model, ref = (qm.parallelize(_llama(), mesh).eval() for _ in range(2))  # (a twin: eager)
    ids = _ids()
    first = qm.fast_decode(model, ids, 12)
    want = qm.fast_decode(ref, ids, 12, compile=False)
    for m in (model, ref):
        lin = m.model.layers[1].mlp.down_proj
        local = lin.__dict__.get("local", lin)  # (a sharded layer holds its linear in `local`)
        local.weight = nn.Parameter(local.weight.detach() * 1.5)
    changed = qm.fast_decode(ref, ids, 12, compile=False)
    again = qm.fast_decode(model, ids, 12)
    graph = model.__dict__["_quantmesh_decoder"].step_graph
    return {"first": torch.equal(first, want), "again": torch.equal(again, changed),
            "differs": not torch.equal(changed, want), "records": graph.records}  # fmt: skip


def test_recorded_steps_at_tp2_give_the_eager_loops_tokens():
    from quantmesh.testing import run_ranks

    out = run_ranks(_tp_recorded, 2, timeout=300, env={"QUANTMESH_COMPILE_BACKEND": "eager"})
    for r in out:
        assert r == {"first": True, "again": True, "differs": True, "records": 2}, out


def test_a_decoder_replaced_drops_its_recording(rerun):
    """A call of other shapes makes another decoder: the one it replaces drops its recording
    (the compiler's cache outlives the decoder and would keep the graph and its cache alive)."""
    model, ids = _llama(), _ids()
    qm.fast_decode(model, ids, 4)
    first = model.__dict__["_quantmesh_decoder"].step_graph
    assert first.recording is not None and first.inputs
    qm.fast_decode(model, _ids(2), 4)
    assert first.recording is None and not first.inputs and not first.static


def test_decoders_of_other_batch_sizes_share_the_compiled_step(rerun):
    """Batch sizes 1, 2, 3 and 1 again, each a decoder of its own with a recording of its own:
    dynamo compiles the step twice (the second with the batch made dynamic), as without the
    recordings, since every decoder compiles with the one noting backend; the eager tokens."""
    from torch._dynamo.utils import counters

    model, ref = _llama(), _llama()
    counters.clear()
    for b in (1, 2, 3, 1):
        ids = _ids(b, seed=b)
        got = qm.fast_decode(model, ids, 6)
        assert torch.equal(got, qm.fast_decode(ref, ids, 6, compile=False)), b
        assert model.__dict__["_quantmesh_decoder"].step_graph.records == 1
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_where_the_step_is_not_recorded(rerun, monkeypatch):
    """Off ($QUANTMESH_STEP_GRAPH=0: inductor's CUDA graph trees), another mode than
    "reduce-overhead", an uncompiled loop, a device not in DEVICES: no recording."""
    ids = _ids()
    model = _llama()
    qm.fast_decode(model, ids, 3, mode=None)
    assert model.__dict__["_quantmesh_decoder"].step_graph is None
    qm.fast_decode(model, ids, 3, compile=False)
    assert model.__dict__["_quantmesh_decoder"].step_graph is None
    monkeypatch.setattr(SG, "DEVICES", ("cuda",))
    qm.fast_decode(model, ids, 3)
    assert model.__dict__["_quantmesh_decoder"].step_graph is None
    monkeypatch.setattr(SG, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(SG, "ENABLED", False)
    model.__dict__.pop("_quantmesh_decoder")
    qm.fast_decode(model, ids, 3)
    assert model.__dict__["_quantmesh_decoder"].step_graph is None


def test_a_check_without_replays_runs_the_step(rerun, monkeypatch):
    """With CHECK_REPLAYS off each call's first step runs the compiled step for real (its check
    replays nothing): the eager loop's tokens, one recording, one replay fewer a later call."""
    monkeypatch.setattr(SG, "CHECK_REPLAYS", False)
    ids = _ids()
    model, ref = _llama(), _llama()
    want = qm.fast_decode(ref, ids, 12, compile=False)
    for _ in range(2):
        assert torch.equal(qm.fast_decode(model, ids, 12), want)
    assert model.__dict__["_quantmesh_decoder"].step_graph.records == 1
    assert len(rerun) == 1 and rerun[0].replays == 10 + 10


def test_on_by_default(monkeypatch):
    import importlib

    monkeypatch.delenv("QUANTMESH_STEP_GRAPH", raising=False)
    monkeypatch.delenv("QUANTMESH_STEP_CHECK_REPLAYS", raising=False)
    assert importlib.reload(SG).ENABLED is True
    assert SG.CHECK_REPLAYS is True
    assert SG.DEVICES == ("cuda",) and SG.RECORDER is None
