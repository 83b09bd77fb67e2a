"""Sliding-window attention served (gpt-oss, Gemma 2 and 3, Mistral's first models): both engines
give every row, at every step, the logits of the model's own forward over that row's tokens
alone, with prompts and replies past the window (4 tokens in the test zoo's models), rows of
different lengths decoding together, and a row leaving. Before, both engines refused these models
("serve batches full-attention caches only").

The reference is the model's forward without a cache, which builds transformers' own sliding-window
masks; the dynamic engine lets the model build them from its padding mask, the slot engine builds
them itself (one per layer type, or one for every layer where all slide)."""

from __future__ import annotations

import pytest
import torch

ARCHS = ["gpt_oss", "gemma2", "gemma3_text", "mistral"]


def _served(name: str):
    import quantmesh as qm
    from quantmesh.serve.bank import AdapterBank
    from tests.zoo import ZOO

    model, ref = ZOO[name].build(0), ZOO[name].build(0)  # ref: the same weights, no adapters
    for m in (model, ref):
        m.config.max_position_embeddings = max(64, m.config.max_position_embeddings)
    qm.parallelize(model, qm.init_mesh(tp=1), lora=qm.LoraConfig(r=4))
    model.eval()
    return model, AdapterBank(model, slots=2), ref


def _alone(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def _run(batch, ref, steps: int) -> tuple[float, int]:
    """Rows admitted at steps 0 (a 9-token prompt) and 2 (6 tokens), row 0 leaving at step 8,
    each fed its greedy token: (the largest relative logit error against the row alone through
    `ref`, the longest row)."""
    from quantmesh.serve.engine import Admit, Plan

    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 60, (9,), generator=g).tolist(),
               1: torch.randint(0, 60, (6,), generator=g).tolist()}  # fmt: skip
    admit_at = {0: [0], 2: [1]}
    seqs: dict[int, list[int]] = {}
    order: list[int] = []
    worst = 0.0
    lens = []
    for step in range(steps):
        gone = [0] if step == 8 else []
        order = [r for r in order if r not in gone]
        for r in gone:
            seqs.pop(r)
        feed = batch.feed_tokens([seqs[r][-1] for r in order])
        plan = Plan(drop=gone, order=list(order), feed=feed,
                    admit=[Admit(r, prompts[r], 0) for r in admit_at.get(step, [])])  # fmt: skip
        out, pre, _ = batch.execute(plan)
        for r in admit_at.get(step, []):
            seqs[r] = list(prompts[r])
        rows = (list(out) if out is not None else []) + pre
        order = order + [r for r in admit_at.get(step, [])]
        for r, logits in zip(order, rows, strict=True):
            want = _alone(ref, seqs[r])
            worst = max(worst, float((logits - want).abs().max() / want.abs().max()))
            seqs[r].append(int(logits.argmax()))
            lens.append(len(seqs[r]))
    return worst, max(lens)


@pytest.mark.parametrize("engine", ["dynamic", "slots"])
@pytest.mark.parametrize("name", ARCHS)
def test_sliding_window_models_serve_each_row_as_alone(name: str, engine: str) -> None:
    from quantmesh.serve.engine import Batch, attention_windows
    from quantmesh.serve.slots import SlotBatch

    model, bank, ref = _served(name)
    windows = attention_windows(model, model.config)
    assert 4 in windows, windows  # the zoo's window: the rows below run past it
    batch = (Batch(model, bank) if engine == "dynamic"
             else SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(1,), compile=False))  # fmt: skip
    worst, longest = _run(batch, ref, steps=12)
    assert longest > 3 * 4, longest
    assert worst < 1e-5, (name, engine, worst)


@pytest.mark.parametrize("name", ["gpt_oss", "mistral"])
def test_the_compiled_slot_step_traces_the_window_masks_whole(name: str) -> None:
    """The slot step compiled (fullgraph: the masks by layer type, or the one sliding mask, are
    traced with the rest) gives the rows' own logits too."""
    from torch._dynamo.utils import counters

    from quantmesh.serve.slots import SlotBatch

    model, bank, ref = _served(name)
    model.config._experts_implementation = "grouped_mm"  # the experts forward a compile traces
    batch = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(1,), compile=False)
    counters.clear()
    batch.run = torch.compile(batch._decode, backend="aot_eager", fullgraph=True)
    worst, _ = _run(batch, ref, steps=12)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert worst < 1e-5, (name, worst)


def test_a_full_attention_mask_would_differ() -> None:
    """The check above can fail: the same rows with the windows ignored (every layer full) give
    other logits once a row is longer than the window."""
    from quantmesh.serve.slots import SlotBatch

    model, bank, ref = _served("gpt_oss")
    batch = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(1,), compile=False)
    batch.window = None  # every layer's mask full
    worst, _ = _run(batch, ref, steps=12)
    assert worst > 1e-2, worst
