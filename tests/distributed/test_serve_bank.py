"""The serving batch at tp=2: rows with different adapters (and the base) decoded together give
the logits of a model that holds only that row's adapter (loaded by qm.load_adapter, the path of
`quantmesh generate --adapter`), run alone without a cache.

Covers the bank's slices on colwise and rowwise layers, an adapter of lower rank than the bank
(zero-padded), an adapter on a subset of the bank's modules, left-padded rows of different
lengths, two rows with different adapters prefilled together, rows joining a running batch and
rows leaving it (the span of slots in use then starts at 1). Both engines: `Batch` (a growing
cache) and `SlotBatch` (fixed KV slots, run eagerly here; rows padded to a ladder size, rows after
a leaving one shifted down), the latter also with prompts prefilled in chunks between decode
steps.

A mixture of experts (Qwen3-MoE, its folder as transformers saves it) serves adapters on its expert
tensors (PEFT's `target_parameters`) per row the same way, on the experts each batch routes to
(eager) and on every (slot, expert) pair (the path a compiled step takes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.e2e.test_cli_common import make_adapter, make_tiny_llama

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 9, 11, 30, 2], [7, 8], [12, 40, 41, 13, 14, 15, 16, 3], [6, 21, 22, 23, 24],
           [9, 33, 17]]  # fmt: skip


def _ranks(
    rank: int, model_dir: str, adapters: list[str], engine: str, targets: list[str] = EVERY,
    routed: bool = True,
) -> dict:  # fmt: skip
    import quantmesh as qm
    from quantmesh.io.adapter import adapter_lora_config
    from quantmesh.serve.bank import AdapterBank
    from quantmesh.serve.engine import Admit, Batch, Plan
    from quantmesh.serve.slots import SlotBatch

    mesh = qm.init_mesh(tp=2, dp=1)
    from quantmesh.tp.experts import ShardedExperts

    lora = qm.LoraConfig(r=8, targets=targets)
    served = qm.from_pretrained(model_dir, mesh, lora=lora, progress=False).eval()
    experts = [m for m in served.modules() if isinstance(m, ShardedExperts)]
    for m in experts:
        m.routed_only = routed  # off: every (slot, expert) pair, as a compiled step runs them
    bank = AdapterBank(served, slots=3)
    for slot, path in enumerate(adapters, 1):
        bank.load(slot, path)
    refs = [qm.from_pretrained(model_dir, mesh, progress=False).eval()]
    for path in adapters:
        m = qm.from_pretrained(model_dir, mesh, lora=adapter_lora_config(path), progress=False)
        qm.load_adapter(m, path)
        refs.append(m.eval())
    if engine != "dynamic":  # eager on CPU: the same code the GPU compiles, small ladder
        chunk = 3 if engine == "chunked" else None
        batch = SlotBatch(served, bank, max_batch=5, max_len=64, ladder=(1, 2), chunk=chunk)
    else:
        batch = Batch(served, bank)
    seqs = {rid: list(p) for rid, p in enumerate(PROMPTS)}
    slots = {0: 1, 1: 0, 2: 2, 3: 2, 4: 1}  # row -> adapter slot (0: the base)
    worst, agree = 0.0, True

    def check(rid: int, logits: torch.Tensor) -> int:
        nonlocal worst, agree
        with torch.no_grad():
            full = refs[slots[rid]](torch.tensor([seqs[rid]])).logits[0]  # (len, vocab)
        ref = full if logits.dim() == 2 else full[-1]  # an echo row: every prompt position
        worst = max(worst, float((logits - ref).abs().max()))
        agree &= bool((logits.argmax(-1) == ref.argmax(-1)).all())
        tok = int(full[-1].argmax())
        seqs[rid].append(tok)
        return tok

    # rows 0, 3 (prefilled together: one prompt length) and 1 start; row 2 and row 4 (echo: every
    # prompt position's logits) join after two steps; row 1 leaves after four. "chunked" prefills
    # rows 2 and 4 in pieces of at most 3 tokens over four steps, decoding the others meanwhile:
    # at step 3 the rows mid-prefill sit in the padding slots of a batch of 5 (3 rows decode), at
    # step 4 row 1 leaves from in front of a row mid-prefill (which shifts down a slot)
    first = [Admit(0, PROMPTS[0], 1), Admit(3, PROMPTS[3], 2), Admit(1, PROMPTS[1], 0)]
    _, pre, _ = batch.execute(Plan(admit=first))
    last = {a.rid: check(a.rid, row) for a, row in zip(first, pre, strict=True)}
    p2, p4 = PROMPTS[2], PROMPTS[4]
    if engine == "chunked":
        schedule = {
            2: [Admit(2, p2[:3], 2, last=False)],
            3: [Admit(2, p2[3:6], 2, start=3, last=False)],
            4: [Admit(2, p2[6:], 2, start=6), Admit(4, p4[:2], 1, echo=True, last=False)],
            5: [Admit(4, p4[2:], 1, echo=True, start=2)],
        }
    else:
        schedule = {2: [Admit(2, p2, 2), Admit(4, p4, 1, echo=True)]}
    order: list[int] = [0, 3, 1]
    filling: list[int] = []
    for step in range(7):
        admit = schedule.get(step, [])
        drop = [1] if step == 4 else []
        order = [r for r in order if r not in drop]
        out, pre, _ = batch.execute(
            Plan(
                drop=drop,
                order=order,
                feed=batch.feed_tokens([last[r] for r in order]),
                admit=admit,
                filling=list(filling),
            )  # fmt: skip
        )
        for r, row in zip(order, out if out is not None else [], strict=True):
            last[r] = check(r, row)
        ended = [a.rid for a in admit if a.last]
        for r, row in zip(ended, pre, strict=True):
            last[r] = check(r, row)
        order = order + ended
        filling = [r for r in filling if r not in ended]
        filling += [a.rid for a in admit if not a.start and not a.last]
    routed_to = max((m.last_routed for m in experts), default=0)
    return {"worst": worst, "agree": agree, "steps": {r: len(s) for r, s in seqs.items()},
            "routed_to": routed_to}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dynamic", "slots", "chunked"])
def test_mixed_adapter_batch_equals_each_adapter_alone(tmp_path: Path, engine: str) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    a = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj", "v_proj"], seed=1)
    b = make_adapter(model, tmp_path / "b", r=8, targets=EVERY, seed=2)
    results = run_ranks(_ranks, 2, str(model), [str(a), str(b)], engine, timeout=240)
    for res in results:
        assert res["agree"], res
        assert res["worst"] < 1e-4, res  # fp32: only the order of sums differs
        # every row was prefilled and decoded (the chunked ones too): prompt + its tokens checked
        assert all(res["steps"][r] > len(p) + 1 for r, p in enumerate(PROMPTS)), res
    assert results[0] == results[1]


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "engine", "routed"),
    [("qwen3_moe", "dynamic", True), ("qwen3_moe", "slots", False), ("gpt_oss", "dynamic", True)],
)  # gpt-oss: experts transposed, gate/up interleaved, a bias per expert
def test_expert_adapters_are_served_per_row(
    tmp_path: Path, arch: str, engine: str, routed: bool
) -> None:
    from tests.moe_folders import moe_dir

    # the server batches full-attention caches only: gpt-oss's sliding layers made full
    full = {"layer_types": ["full_attention"] * 2} if arch == "gpt_oss" else {}
    model = moe_dir(arch, tmp_path / "moe", **full)
    a = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj"], seed=1,
                     parameters=["mlp.experts.down_proj"])  # fmt: skip
    b = make_adapter(model, tmp_path / "b", r=8, targets=["q_proj", "v_proj"], seed=2,
                     parameters=EXPERTS)  # fmt: skip
    targets = ["q_proj", "v_proj"] + [f"*{t}" for t in EXPERTS]
    results = run_ranks(_ranks, 2, str(model), [str(a), str(b)], engine, targets, routed,
                        timeout=240)  # fmt: skip
    for res in results:
        assert res["agree"], res
        assert res["worst"] < 1e-4, res
        assert all(res["steps"][r] > len(p) + 1 for r, p in enumerate(PROMPTS)), res
        # routed: the last forward built only the (slot, expert) pairs it hit (fewer than the
        # 3 slots x 4 experts); whole: the routed path never ran
        assert (0 < res["routed_to"] < 12) if routed else res["routed_to"] == 0, res
    assert results[0] == results[1]


def _bank_dtypes(rank: int, model_dir: str, adapters: list[str], targets: list[str]) -> dict:
    import quantmesh as qm
    from quantmesh.serve.bank import AdapterBank

    mesh = qm.init_mesh(tp=1, dp=1)
    lora = qm.LoraConfig(r=8, targets=targets)
    ids = torch.tensor([PROMPTS[0], PROMPTS[3], PROMPTS[0]])
    out: dict = {}
    for dtype in (None, torch.bfloat16):
        model = qm.from_pretrained(model_dir, mesh, lora=lora, progress=False).eval()
        bank = AdapterBank(model, slots=3, dtype=dtype)
        for slot, path in enumerate(adapters, 1):
            bank.load(slot, path)
        bank.set_rows([1, 2, 0])
        with torch.no_grad():
            out[f"plain {dtype}"] = model(input_ids=ids).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as the engines run on GPUs
                out[f"autocast {dtype}"] = model(input_ids=ids).logits
    return {
        "same": torch.equal(out["autocast None"], out["autocast torch.bfloat16"]),
        "plain_differ": float((out["plain None"] - out["plain torch.bfloat16"]).abs().max()),
        "adapted": float((out["autocast None"][0] - out["autocast None"][2]).abs().max()),
    }


@pytest.mark.slow
def test_a_bank_in_the_autocast_dtype_gives_the_same_logits(tmp_path: Path) -> None:
    """The server holds its bank in bf16 on GPUs (`engine.autocast_dtype`): under bf16 autocast
    every matmul reading the bank (dense adapters' linears, experts' B @ A) casts it to bf16
    anyway, so the logits are bit-identical to an fp32 bank's (here on CPU autocast, a Qwen3-MoE
    with adapters on q/v and on both expert tensors). Without autocast they differ: the test
    sees the dtype."""
    from tests.moe_folders import moe_dir

    model = moe_dir("qwen3_moe", tmp_path / "moe")
    a = make_adapter(model, tmp_path / "a", r=4, targets=["q_proj"], seed=1,
                     parameters=["mlp.experts.down_proj"])  # fmt: skip
    b = make_adapter(model, tmp_path / "b", r=8, targets=["q_proj", "v_proj"], seed=2,
                     parameters=EXPERTS)  # fmt: skip
    targets = ["q_proj", "v_proj"] + [f"*{t}" for t in EXPERTS]
    (res,) = run_ranks(_bank_dtypes, 1, str(model), [str(a), str(b)], targets, timeout=180)
    assert res["same"], res
    assert res["plain_differ"] > 0 and res["adapted"] > 0, res
