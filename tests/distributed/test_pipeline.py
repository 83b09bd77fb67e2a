"""Pipeline parallelism (the mesh's pp axis) trains exactly like one rank.

Every layout runs a few SGD-momentum steps through `qm.train_step` on the same global batch; the
single-rank run of the same function is the reference. Losses and every trainable gradient
(gathered over tp, merged over the stages) are compared; each stage's ranks hold only their
stage's parameters, under their original names, and the stages together hold the whole model.

fp32: the pp axis itself adds no rounding (the same ops on the same micro-batches; the loss is
divided by the global label count on the last stage), so pp=2 and pp=4 agree with one rank to the
last bit; tp and dp reorder sums (~1e-7). A key projection's bias has an exactly zero gradient
(softmax ignores a per-query constant), so its rounding-level values get an absolute floor.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.distributed._pp_cases import build, failing_stage, jobs, many, misuse

FAST = [  # pp=2 under both schedules, one launch
    ((1, 2, 1), {}),
    ((1, 2, 1), {"schedule": "gpipe"}),
]
CASES2 = [  # world size 2 (slow)
    ((1, 2, 1), {"stages": [3, 1]}),
    ((1, 2, 1), {"model": "gpt", "lora": True}),
    ((1, 2, 1), {"model": "llama_tied", "lora": True}),
    ((1, 2, 1), {"lora": True, "quant": "nf4"}),
    ((1, 2, 1), {"virtual": 2, "schedule": "interleaved1f1b"}),  # 4 stages on 2 ranks
    ((1, 1, 2), {}),  # pp=1 layouts through train_step: the twins of the 4-rank pp layouts
    ((2, 1, 1), {"microbatches": 2}),
]
CASES4 = [  # world size 4 (slow)
    ((1, 2, 2), {}),
    ((2, 2, 1), {"microbatches": 2}),
    ((1, 4, 1), {}),
    ((2, 2, 1), {"virtual": 2, "schedule": "interleaved1f1b", "microbatches": 2}),
]
GROUPS = {"fast": FAST, "two": CASES2, "four": CASES4}

# Launches are the cost: every case runs in one spawn per world size, in the order their files
# need (the one-rank adapter and state first, the two-rank ones from them, then the one-rank
# resume of the two-rank state): 1 rank, 2 ranks, 1 rank, 4 ranks. The error tests below keep
# spawns of their own (test-fast runs them; one breaks its process group on purpose).


def _ref_key(kw: dict) -> tuple:
    """What a single-rank reference depends on: the model, adapters and format (not the split)."""
    return tuple(sorted((k, v) for k, v in kw.items() if k in ("model", "lora", "quant")))


REF_KEYS = sorted({_ref_key(kw) for cases in GROUPS.values() for _, kw in cases}, key=repr)


@functools.cache
def _root() -> Path:
    """A folder for the whole session holding a saved tied Llama (base/); the io, resume and
    eval jobs write their adapters and states beside it."""
    d = Path(tempfile.mkdtemp(prefix="quantmesh-pp-"))
    atexit.register(shutil.rmtree, d, True)
    build("llama_tied").save_pretrained(d / "base", safe_serialization=True)
    return d


@functools.cache
def _one_rank() -> dict:
    """One rank: every reference run, the adapter and state saved by one rank, evaluation."""
    root = str(_root())
    todo = [("pp_train", (1, 1, 1), dict(k)) for k in REF_KEYS]
    todo += [("pp_io", (root, 1), {}), ("pp_resume", (root, 1), {}), ("pp_eval", (1,), {})]
    out = run_ranks(jobs, 1, todo, timeout=900)[0]
    n = len(REF_KEYS)
    return {"refs": dict(zip(REF_KEYS, out[:n], strict=True)), "io": out[n],
            "resume": out[n + 1], "eval": out[n + 2]}  # fmt: skip


@functools.cache
def _two_ranks() -> dict:
    """Two ranks: the FAST and CASES2 layouts, the io and resume jobs loading what one rank
    saved, evaluation at one and two stages per rank."""
    _one_rank()  # writes adapter-pp1 and state-pp1 first
    root = str(_root())
    cases = FAST + CASES2
    todo = [("pp_train", layout, kw) for layout, kw in cases]
    todo += [
        ("pp_io", (root, 2), {"load_from": "adapter-pp1"}),
        ("pp_resume", (root, 2), {"load_from": "state-pp1"}),
        ("pp_eval", (2, 1), {}),
        ("pp_eval", (2, 2), {}),
    ]
    per_rank = run_ranks(jobs, 2, todo, timeout=1500)
    col = [[per_rank[r][i] for r in range(2)] for i in range(len(todo))]
    n = len(cases)
    return {"fast": col[: len(FAST)], "two": col[len(FAST) : n], "io": col[n],
            "resume": col[n + 1], "eval": col[n + 2 :]}  # fmt: skip


@functools.cache
def _resume_back() -> dict:
    """One rank again: the state two ranks saved, resumed."""
    _two_ranks()  # writes state-pp2 first
    todo = [("pp_resume", (str(_root()), 1), {"load_from": "state-pp2"})]
    return run_ranks(jobs, 1, todo, timeout=600)[0][0]


@functools.cache
def _spawn(group: str) -> list[list[dict]]:
    """[case][rank] results of every case of one group."""
    if group in ("fast", "two"):
        return _two_ranks()[group]
    cases = GROUPS[group]
    world = cases[0][0][0] * cases[0][0][1] * cases[0][0][2]
    per_rank = run_ranks(many, world, cases, timeout=900)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def _reference(kw: dict) -> dict:
    """The single-rank run of the same model, adapters and format."""
    return _one_rank()["refs"][_ref_key(kw)]


def _twin(layout: tuple[int, int, int], kw: dict) -> list[dict]:
    """The pp=1 run of the same dp and tp (world size 2)."""
    dp, _, tp = layout
    return _spawn("two")[CASES2.index(((dp, 1, tp), kw))]


def _merged(results: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Per step: every stage's gradients by name (each name from exactly one stage)."""
    out: list[dict[str, torch.Tensor]] = []
    for r in results:
        if r["grads"] is None:
            continue
        out = out or [{} for _ in r["grads"]]
        for merged, g in zip(out, r["grads"], strict=True):
            assert not merged.keys() & g.keys(), "two stages hold the same trainable parameter"
            merged.update(g)
    return out


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-3)


def _check(group: str, idx: int, rel: float, ref: dict | None = None, first: float = 0.0) -> None:
    """Case `idx` of `group` against `ref` (default: one rank): losses and gradients within `rel`
    (the first step's within `first` when given), names held per stage."""
    layout, kw = GROUPS[group][idx]
    got = _spawn(group)[idx]
    ref = ref or _reference(kw)
    for r in got:  # every rank returns the global loss
        for a, b in zip(r["losses"], ref["losses"], strict=True):
            assert abs(a - b) <= rel * abs(b), (layout, kw, r["losses"], ref["losses"])
    steps = _merged(got)
    assert len(steps) == len(ref["grads"])
    for step, (g, gref) in enumerate(zip(steps, ref["grads"], strict=True)):
        assert g.keys() == gref.keys(), (layout, kw, step, g.keys() ^ gref.keys())
        tol = first if first and step == 0 else rel
        for k in gref:
            assert _close(g[k], gref[k], tol), (layout, kw, step, k)
    # names: each stage holds a disjoint part of the model, under the original names
    by_stage: dict[int, set[str]] = {}
    for r in got:
        by_stage.setdefault(r["stage"], set()).update(r["params"])
        assert set(r["names"]) <= set(ref["names"]), set(r["names"]) - set(ref["names"])
    stages = list(by_stage.values())
    assert len(stages) == layout[1]
    for i, a in enumerate(stages):
        for b in stages[i + 1 :]:
            shared = a & b
            # only a tied embedding/head is held by two stages (frozen: checked by parallelize)
            assert all("embed" in n or "lm_head" in n for n in shared), shared
    assert set().union(*stages) == set(ref["params"])


@pytest.mark.slow  # ~18 s with the spawns; test-fast keeps the in-process stage tests (unit/)
@pytest.mark.parametrize("idx", range(len(FAST)), ids=[str(c) for c in FAST])
def test_pp2_matches_single_rank(idx):
    """pp alone reorders nothing: equal to the last bit."""
    _check("fast", idx, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("idx", range(len(CASES2)), ids=[str(c) for c in CASES2])
def test_two_ranks_match_single_rank(idx):
    """An uneven split, a custom model, a tied (frozen) embedding/head, nf4 + LoRA, Interleaved
    1F1B over 2 stages per rank: pp=2 equal to one rank to the last bit (nf4 too: each stage
    quantizes the same whole weights)."""
    (dp, _, tp), kw = CASES2[idx]
    if dp == tp == 1:
        _check("two", idx, 0.0)
    else:  # the pp=1 twins: plain accumulation through train_step, with tp or DDP
        _check("two", idx, 2e-4, first=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("idx", range(len(CASES4)), ids=[str(c) for c in CASES4])
def test_four_ranks_match_single_rank(idx):
    """tp and dp reorder sums: ~1e-7 on the first step, growing through three full-model
    SGD-momentum steps to ~5e-5 (the same at pp=1, see the next test)."""
    layout, _ = CASES4[idx]
    if layout == (1, 4, 1):
        _check("four", idx, 0.0)
    else:
        _check("four", idx, 2e-4, first=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("idx", [0, 1], ids=[str(CASES4[i]) for i in (0, 1)])
def test_pp_adds_nothing_to_tp_and_dp(idx):
    """pp=2 x tp=2 equals pp=1 x tp=2 and dp=2 x pp=2 equals dp=2 x pp=1, to the last bit."""
    layout, kw = CASES4[idx]
    twin = _twin(layout, kw)
    _check("four", idx, 0.0, ref={**twin[0], "grads": _merged(twin), "params": twin[0]["params"]})


def test_failing_stage_ends_every_rank():
    res = run_ranks(failing_stage, 2, timeout=120)
    assert "Boom: stage 1 failed on purpose" in res[1]["error"]
    assert res[0]["error"] is not None  # stage 0 ended too, with the broken link's error
    assert res[0]["seconds"] < 60, res[0]


def test_misuse_is_refused_with_the_fix():
    errors = run_ranks(misuse, 2, timeout=120)[0]
    assert "spans pipeline stages" in errors["tie"] and "tie_word_embeddings=False" in errors["tie"]
    assert "run the model through qm.train_step" in errors["direct"]
    assert "microbatches >= pp ranks" in errors["1f1b"]
    assert "equal parts" in errors["split"]
    assert "chunk_tokens=8 at pp=2" in errors["chunk"] and "pass 0" in errors["chunk"]
    assert "export at pp=2" in errors["export"] and "full_state_dict at pp=2" in errors["full"]


@pytest.mark.slow
def test_load_save_adapter_across_layouts():
    """A saved Llama loads at pp=2 (each stage reads its own layers; the tied head loads from the
    embedding's key); the adapter trained at pp=2 is written as one PEFT file equal to the
    one-rank adapter, and loads back at pp=2 from the one-rank file."""
    from safetensors.torch import load_file

    one, two, root = _one_rank()["io"], _two_ranks()["io"], _root()
    for r in two:
        assert r["losses"] == one["losses"] and r["final"] == one["final"]
        assert abs(r["norm"] - one["norm"]) <= 1e-6 * one["norm"]  # clip sums the stages
        assert r["loaded"] == one["final"]  # the one-rank adapter, loaded stage by stage
    a = load_file(root / "adapter-pp1" / "adapter_model.safetensors")
    b = load_file(root / "adapter-pp2" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 4 * 7 * 2
    for k in a:
        assert torch.equal(a[k], b[k]), k
    cfg1 = (root / "adapter-pp1" / "adapter_config.json").read_text()
    cfg2 = (root / "adapter-pp2" / "adapter_config.json").read_text()
    assert cfg1 == cfg2


@pytest.mark.slow
def test_resumable_state_across_layouts():
    """save_state at pp=2 writes one folder from both stages (parameters, momentum, RNG); it
    resumes at pp=1, and a one-rank state resumes at pp=2, each continuing exactly."""
    one, two, back = _one_rank()["resume"], _two_ranks()["resume"], _resume_back()
    assert all(r["cont"] == one["cont"] for r in two)  # pp=2 trains like one rank
    assert all(r["resumed"] == one["cont"] and r["step"] == 2 for r in two)
    assert back["resumed"] == one["cont"] and back["step"] == 2


@pytest.mark.slow
def test_forward_only_evaluation_through_the_stages():
    """eval_loss_sum (what the training loop's evaluation calls) at pp=2, one and two stages per
    rank, equals one rank's, for two batch shapes, and training continues after it."""
    ref = _one_rank()["eval"]
    for virtual, got in zip((1, 2), _two_ranks()["eval"], strict=True):
        assert got == [ref, ref], virtual
