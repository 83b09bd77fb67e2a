"""The slot engine's decode step, compiled on CPU ranks: at tp=2 with an nf4 base and the adapter
bank, `SlotBatch._decode` traces as whole graphs (fullgraph=True, no graph break: the KV slot
writes, the per-row mask, the bank's fixed row ids, the tp collectives) and gives the eager step's
logits, while rows join (one of them with a 250-token prompt, so the keys cross the 256-column
ladder step), change the batch size and leave. The GPU's CUDA graphs (mode="reduce-overhead") are
tests/distributed/test_cuda_serve.py; this one runs in `make test` (backend aot_eager: the same
trace, no code generation). A mixture of experts with adapters on its experts in the bank traces
whole too and equals the eager step (whose values tests/distributed/test_serve_bank.py checks
against each adapter alone). A model whose sibling layers' codes the engine joins
(QUANTMESH_JOIN_CODES) serves compiled as it does eagerly.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks


def _random_adapters(bank, banked: list, g: torch.Generator) -> None:
    """Adapters that change the output in slots 1 and 2 (scales 1 and 2), the base in slot 0."""
    with torch.no_grad():
        for ad in banked:
            for w in (ad.a_bank, ad.b_bank):
                w.copy_(0.1 * torch.randn(w.shape, generator=g))
            ad.a_bank[0].zero_()
        bank.scales[1:] = [1.0, 2.0]
        bank.scale_t[1:] = torch.tensor([1.0, 2.0])


def _nf4_llama(tp: int, layers: int, g: torch.Generator | None = None, adapters: bool = True,
               attn: str = "sdpa"):  # fmt: skip
    """A tiny Llama (`attn`: its attention), nf4 + LoRA r=4 at `tp`, and a 3-slot bank (random
    adapters in slots 1 and 2, drawn from `g` (default seeded 11), unless `adapters` is False):
    (model, bank)."""
    import quantmesh as qm
    from quantmesh.serve.bank import AdapterBank
    from tests.models import llama

    mesh = qm.init_mesh(tp=tp)
    model = llama(heads=8, kv_heads=4, head_dim=8, vocab=128, layers=layers, tie=False, seed=3)
    model.config.max_position_embeddings = 1024
    model.config._attn_implementation = attn
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=4))
    model.eval()
    bank = AdapterBank(model, slots=3)
    if adapters:
        g = torch.Generator().manual_seed(11) if g is None else g
        _random_adapters(bank, list(bank.banked.values()), g)
    return model, bank


def _eager_and_compiled(eager, comp, steps: int, admit: dict, drop: dict) -> tuple[float, int]:
    """Run both batches through the same plans (rows admitted and dropped at the given steps,
    each fed its greedy token): (the largest |logit difference|, decode steps run)."""
    from quantmesh.serve.engine import Plan

    order: list[int] = []
    last: dict[int, int] = {}
    worst, decoded = 0.0, 0
    for step in range(steps):
        gone = drop.get(step, [])
        order = [r for r in order if r not in gone]
        for batch in (eager, comp):  # each its own copy of the tokens fed
            feed = batch.feed_tokens([last[r] for r in order])
        plan = Plan(drop=gone, order=list(order), feed=feed, admit=admit.get(step, []))
        rows = []
        for batch in (eager, comp):
            s, pre, _ = batch.execute(plan)
            rows.append((list(s) if s is not None else []) + pre)
            decoded += s is not None
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(*rows, strict=True)))
        order = order + [a.rid for a in plan.admit]
        last = dict(zip(order, [int(r.argmax()) for r in rows[0]], strict=True))
    return worst, decoded


def _compiled_vs_eager(rank: int) -> dict:
    from torch._dynamo.utils import counters

    from quantmesh.blocks.compile import mark_block_regions
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch

    g = torch.Generator().manual_seed(11)
    model, bank = _nf4_llama(tp=2, layers=2, g=g)  # the prompts below continue g
    eager = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False)
    comp = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False)
    marked = mark_block_regions(model)  # as compile=True does: eagerly the same step
    regions: list[tuple[int, int]] = []  # per compiled graph: (block calls, distinct blocks traced)

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        regions.append((len(calls), len({n.args[0].target for n in calls})))
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example)

    comp.run = torch.compile(comp._decode, backend=backend, fullgraph=True)
    long = torch.randint(0, 128, (250,), generator=g).tolist()
    admit = {0: [Admit(0, long, 1), Admit(1, [3, 4, 5], 0)], 3: [Admit(2, [7, 8], 2)]}
    worst, steps = _eager_and_compiled(eager, comp, 12, admit, {6: [1]})
    return {"worst": worst, "breaks": dict(counters["graph_break"]), "steps": steps,
            "graphs": counters["stats"]["unique_graphs"], "sizes": comp.sizes,
            "marked": marked, "regions": regions}  # fmt: skip


@pytest.mark.slow
def test_compiled_slot_step_traces_whole_and_equals_eager() -> None:
    for res in run_ranks(_compiled_vs_eager, 2, timeout=600):
        assert res["breaks"] == {}, res  # fullgraph would raise; and nothing ran eagerly
        assert res["steps"] == 2 * 11, res  # every step after the first admission decoded
        # (rows, key columns): (2, 256), then (4, 256) once row 2 joins, then (2, 512) after row
        # 1 left and the long row passed 256 tokens
        assert res["graphs"] == 3, res
        # each graph calls the block region twice and traced it once (mark_block_regions): the
        # second block reuses the first one's graph, writing its own KV slots
        assert res["marked"] == 2 and res["regions"] == [(2, 1)] * 3, res
        assert res["worst"] < 1e-4, res  # fp32: the same kernels, traced


def _warm_then_serve(rank: int) -> dict:
    from torch._dynamo.utils import counters

    from quantmesh.serve.engine import Admit, Plan
    from quantmesh.serve.slots import SlotBatch

    model, bank = _nf4_llama(tp=1, layers=1)
    batch = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=True,
                      backend="aot_eager", prefill=64)  # fmt: skip
    batch.warm_up()  # as `quantmesh serve` calls it: outside `execute`, grad mode on here
    warmed = counters["stats"]["unique_graphs"]
    eager = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False)
    # a 250-token row alone (an eager prefill: past the compiled prefill's 64 tokens), past 256
    # key columns at step 7; three rows join at step 9 (4 rows x 512 columns): rows 1 and 3
    # (adapter 2) in one pack of the compiled prefill, row 2 (70 tokens, the base) eagerly
    # apart from them; the long row leaves at step 12 (3 x 256)
    admit = {0: [Admit(0, [i % 128 for i in range(250)], 1)],
             9: [Admit(1, [3, 4, 5], 2), Admit(3, [9, 10], 2),
                 Admit(2, list(range(7, 77)), 0)]}  # fmt: skip
    seen, prefills = set(), [0]
    compiled, compiled_prefill = batch.run, batch.compiled_prefill

    def run() -> torch.Tensor:  # each decode step's (rows, key columns)
        seen.add((batch.b, batch.le))
        return compiled()

    def prefill() -> torch.Tensor:
        prefills[0] += 1
        return compiled_prefill()

    batch.run, batch.compiled_prefill = run, prefill
    order: list[int] = []
    last: dict[int, int] = {}
    worst = 0.0
    for step in range(15):
        gone = [0] if step == 12 else []
        order = [r for r in order if r not in gone]
        for b in (batch, eager):
            feed = b.feed_tokens([last[r] for r in order])
        plan = Plan(drop=gone, order=list(order), feed=feed, admit=admit.get(step, []))
        both = []
        for b in (batch, eager):
            s, pre, _ = b.execute(plan)
            both.append((list(s) if s is not None else []) + pre)
        worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(*both, strict=True)))
        order = order + [a.rid for a in plan.admit]
        last = dict(zip(order, [int(r.argmax()) for r in both[1]], strict=True))
    return {"warmed": warmed, "served": counters["stats"]["unique_graphs"], "sizes": batch.sizes,
            "seen": sorted(seen), "prefills": prefills[0], "worst": worst}  # fmt: skip


def test_warm_up_compiles_the_graphs_serving_runs() -> None:
    """`warm_up` compiles what serving runs, under the state `execute` runs in (no autograd,
    autocast on GPUs): serving then compiles nothing, whatever its batch sizes, key lengths and
    prompts. A warm-up under other guards made every graph compile again at the first requests,
    and one at the shortest key length only left the first row past 256 tokens to compile
    (minutes of a 7B server) while every row waited. Short prompts take the compiled prefill
    (packed by adapter, several rows in one call), long ones the eager prefill; every prefill and
    decode step equals the eager engine's."""
    (res,) = run_ranks(_warm_then_serve, 1, timeout=300)
    assert res["sizes"] == (1, 2, 4), res
    # the prefill (static); one row x 256 columns static; one row x a symbolic key length; a
    # symbolic batch and key length for the rest (one static graph per size took over six
    # minutes for a 7B step)
    assert res["warmed"] == 4, res
    assert res["seen"] == [(1, 256), (1, 512), (4, 256), (4, 512)], res  # both ladders crossed
    assert res["served"] == res["warmed"], res
    assert res["prefills"] == 1, res  # two short prompts in one pack; the 250 and 70 eager
    assert res["worst"] < 1e-4, res  # fp32: the same kernels, traced


def _packed_eager_attention(rank: int) -> dict:
    """The packed prefill under eager attention (an additive float mask, not sdpa's booleans):
    three prompts, two adapters, two packs, then decode steps, against the eager engine."""
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch

    model, bank = _nf4_llama(tp=1, layers=1, attn="eager")
    eager = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(4,), compile=False)
    comp = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(4,), compile=True,
                     backend="eager", prefill=16)  # fmt: skip
    calls = [0]
    compiled_prefill = comp.compiled_prefill

    def prefill() -> torch.Tensor:
        calls[0] += 1
        return compiled_prefill()

    comp.compiled_prefill = prefill
    admit = {0: [Admit(0, [5, 9, 11], 1), Admit(1, [3, 4], 2), Admit(2, [7, 8, 9, 10, 12], 1)]}
    worst, steps = _eager_and_compiled(eager, comp, 4, admit, {})
    return {"worst": worst, "steps": steps, "packs": calls[0], "additive": comp.additive}


def test_packed_prefill_under_eager_attention_equals_the_eager_engine() -> None:
    (res,) = run_ranks(_packed_eager_attention, 1, timeout=300)
    assert res["additive"] and res["packs"] == 2, res  # adapter 1's two prompts share a pack
    assert res["steps"] == 2 * 3 and res["worst"] < 1e-4, res


def _moe_compiled_vs_eager(rank: int) -> dict:
    """Qwen3-MoE, nf4, adapters on the expert tensors in the bank: the compiled step builds every
    (slot, expert) pair, the eager one the pairs its rows hit."""
    from torch._dynamo.utils import counters

    import quantmesh as qm
    from quantmesh.serve.bank import AdapterBank
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch
    from tests.zoo import ZOO

    mesh = qm.init_mesh(tp=1)
    model = ZOO["qwen3_moe"].build(0)
    model.config.max_position_embeddings = 1024
    model.config._attn_implementation = "sdpa"
    model.config._experts_implementation = "grouped_mm"  # the experts forward compiled blocks run
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=4))
    model.eval()
    bank = AdapterBank(model, slots=3)
    banked = [*bank.banked.values(), *(b for d in bank.banked_experts.values() for b in d.values())]
    _random_adapters(bank, banked, torch.Generator().manual_seed(11))
    eager = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(2,), compile=False)
    comp = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(2,), compile=False)
    comp.run = torch.compile(comp._decode, backend="aot_eager", fullgraph=True)
    admit = {0: [Admit(0, [5, 9, 11], 1), Admit(1, [3, 4, 5], 2)]}
    worst, steps = _eager_and_compiled(eager, comp, 4, admit, {})
    return {"worst": worst, "breaks": dict(counters["graph_break"]), "steps": steps,
            "graphs": counters["stats"]["unique_graphs"], "banked": len(bank.banked_experts),
            "pair_bytes": bank.pair_bytes(),
            "sizes": [getattr(model.config, k) for k in ("num_experts", "hidden_size",
                                                         "moe_intermediate_size")]}  # fmt: skip


@pytest.mark.slow
def test_compiled_slot_step_serves_expert_adapters_like_eager() -> None:
    (res,) = run_ranks(_moe_compiled_vs_eager, 1, timeout=300)
    assert res["banked"] == 2, res  # both layers' experts carry banked adapters
    e, h, i = res["sizes"]
    # 3 slots x (gate_up (E, 2I, H) + down (E, H, I)) fp32 weights, and as many delta elements
    assert res["pair_bytes"] == 2 * 3 * (e * 2 * i * h + e * h * i) * 4, res["pair_bytes"]
    assert res["breaks"] == {} and res["graphs"] == 1, res
    assert res["steps"] == 2 * 3, res
    assert res["worst"] < 1e-4, res


def _memory_check(rank: int) -> dict:
    import quantmesh as qm
    from quantmesh.serve.bank import AdapterBank
    from quantmesh.serve.engine import Admit, Plan, ServeError
    from quantmesh.serve.slots import SlotBatch
    from tests.models import llama

    mesh = qm.init_mesh(tp=1)
    model = llama(heads=8, kv_heads=4, head_dim=8, vocab=128, layers=2, tie=False, seed=3)
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4))
    model.eval()
    batch = SlotBatch(model, AdapterBank(model, slots=2), max_batch=4, max_len=300,
                      ladder=(1,), compile=False)  # fmt: skip
    out: dict = {"cpu": batch.memory_problem()}  # no check off GPUs
    batch._kv_shapes()  # the probe forward, on the CPU; then the check as on a GPU
    # 2 layers x 4 rows x (512 columns + scratch) x (4 kv heads x 8 dims, keys and values) x fp32
    need = 2 * 4 * 513 * 2 * 32 * 4
    free = [0]
    torch.cuda.mem_get_info = lambda device=None: (free[0], 1 << 40)  # type: ignore[assignment]
    batch.device = torch.device("cuda", 0)
    edge = need * 10 // 9  # 90% of it is need, to a byte; one column less is 2,048 bytes less
    for name, f in (("fits", edge + 2), ("short", edge - 2)):
        free[0] = f
        out[name] = batch.memory_problem()
    try:
        batch.execute(Plan(admit=[Admit(0, [1, 2], 0)]))
    except ServeError as e:  # refused before any slot is allocated
        out["refused"], out["layers"] = str(e), len(batch.layers)
    return out


def test_kv_slots_are_checked_against_free_gpu_memory_before_allocating() -> None:
    """`memory_problem` counts every layer's slots (rows x columns + scratch x kv heads x head
    dim, keys and values) against 90% of the free memory, names the flags that lower them, and
    `quantmesh serve --engine auto` falls back to the dynamic engine on it (said at start)."""
    (res,) = run_ranks(_memory_check, 1, timeout=120)
    assert res["cpu"] is None and res["fits"] is None, res
    need_gib = 2 * 4 * 513 * 2 * 32 * 4 / 2**30
    assert res["short"].startswith(f"the KV slots (4 rows x 512 tokens) need {need_gib:.1f} GiB")
    assert "lower --max-batch or --max-model-len" in res["short"], res
    assert res["refused"] == res["short"] and res["layers"] == 0, res


class _FakeGraph:
    """A CPU stand-in for `torch.cuda.CUDAGraph`: a capture records the step it ran, the batch's
    (rows, key columns) then and the tensor it returned; a replay runs the step again at those
    shapes (a graph's are baked in) and writes its result into that same tensor, as a graph's
    replay rewrites its static output."""

    recording: list = []

    def __init__(self) -> None:
        self.fn = self.out = self.batch = None
        self.shape = (0, 0)

    def replay(self) -> None:
        saved = (self.batch.b, self.batch.le)
        self.batch.b, self.batch.le = self.shape
        self.out.copy_(self.fn())
        self.batch.b, self.batch.le = saved


def _captured_vs_eager(rank: int) -> dict:
    import contextlib

    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch

    def no_stream(*args, **kw):  # the warm-up runs on the current stream (`cuda_graph`)
        raise AssertionError("the capture made or entered a side stream")

    @contextlib.contextmanager
    def graph(g, pool=None):
        _FakeGraph.recording.append(g)
        yield
        _FakeGraph.recording.pop()

    fake = {
        "Stream": no_stream,
        "stream": no_stream,
        "graph_pool_handle": lambda: None,
        "CUDAGraph": _FakeGraph,
        "graph": graph,
    }
    for name, value in fake.items():
        setattr(torch.cuda, name, value)
    # one layer: the replay mechanics are per step (two layers' caches: _compiled_vs_eager)
    model, bank = _nf4_llama(tp=1, layers=1)
    eager = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False)
    capt = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False,
                     graphs="captured")  # fmt: skip
    # as on a GPU: compiled, the step run through `_replay` (the device check aside)
    capt.compiled = True
    step = torch.compile(capt._decode, backend="aot_eager", fullgraph=True)

    def recorded() -> torch.Tensor:
        out = step()
        if _FakeGraph.recording:
            g = _FakeGraph.recording[-1]
            g.fn, g.out, g.batch, g.shape = step, out, capt, (capt.b, capt.le)
        return out

    capt.compiled_step, capt.run = recorded, capt._replay
    long = torch.randint(0, 128, (250,), generator=torch.Generator().manual_seed(4)).tolist()
    admit = {0: [Admit(0, long, 1), Admit(1, [3, 4, 5], 0)], 3: [Admit(2, [7, 8], 2)]}
    worst, steps = _eager_and_compiled(eager, capt, 12, admit, {6: [1]})
    return {"worst": worst, "steps": steps, "captured": sorted(capt.captured)}


def test_captured_graphs_replay_the_step_of_each_shape() -> None:
    """`graphs="captured"` keeps one graph per (rows, key columns) and replays it: its logits equal
    the eager step's while rows join, leave and cross 256 key columns. The CUDA graph is a CPU
    stand-in here (a replay runs the step into the captured output tensor, which `_step` clones
    before the next replay); tests/distributed/test_cuda_serve.py runs the real one on a GPU.
    The captures warm up on the current stream: a side stream's forward left later replays
    slower (`prefill_graph.cuda_graph`)."""
    (res,) = run_ranks(_captured_vs_eager, 1, timeout=300)
    assert res["steps"] == 2 * 11, res
    assert res["captured"] == [(2, 256), (2, 512), (4, 256)], res
    assert res["worst"] < 1e-4, res


def _with_and_without_dequantized(rank: int) -> dict:
    """The same plans on the slot engine (eager) at tp=2, the 4-bit weights held dequantized
    (`serve --keep-dequantized`) and not: each step's logits, and what was held."""
    from quantmesh.cli.serve import _keep_dequantized
    from quantmesh.parallel.held import keep_dequantized
    from quantmesh.quant.bnb import HeldRun
    from quantmesh.serve.engine import Admit, Plan
    from quantmesh.serve.slots import SlotBatch
    from quantmesh.tp.layers import sharded_modules

    model, bank = _nf4_llama(tp=2, layers=2)
    locals_ = [m.local for m in sharded_modules(model).values()]
    admit = {0: [Admit(0, [5, 9, 11, 2], 1), Admit(1, [3, 4], 0)], 2: [Admit(2, [7, 8, 1], 2)]}
    runs = []
    shared = [0]  # siblings after the first whose output came from their run's one matmul
    output = HeldRun.output

    def counted(run: HeldRun, i: int, x: torch.Tensor, *products) -> torch.Tensor:
        shared[0] += int(i > 0 and run.x is x)
        return output(run, i, x, *products)

    HeldRun.output = counted  # type: ignore[method-assign]  # this rank's process only
    for held in (False, True):
        if held:
            _keep_dequantized(model, torch.device("cpu"), torch.float32)
        batch = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(1, 2), compile=False)
        order: list[int] = []
        last: dict[int, int] = {}
        steps = []
        for step in range(6):
            feed = batch.feed_tokens([last[r] for r in order])
            plan = Plan(order=list(order), feed=feed, admit=admit.get(step, []))
            s, pre, _ = batch.execute(plan)
            rows = (list(s) if s is not None else []) + pre
            order = order + [a.rid for a in plan.admit]
            last = dict(zip(order, [int(r.argmax()) for r in rows], strict=True))
            steps.append(torch.stack(rows))
        runs.append(steps)
    held_layers = sum(getattr(m, "dense", None) is not None for m in locals_)
    joined = sum(getattr(m, "held_run", None) is not None for m in locals_)
    keep_dequantized(locals_, None)
    dropped = all(
        getattr(m, "dense", None) is getattr(m, "held_run", None) is None for m in locals_
    )
    return {"runs": runs, "held": held_layers, "joined": joined, "shared": shared[0],
            "dropped": dropped}  # fmt: skip


def test_weights_held_dequantized_give_the_same_steps() -> None:
    """`serve --keep-dequantized` at tp=2: every rank holds its shards' 4-bit weights (7 per block)
    dequantized, q/k/v and gate/up each joined into one (`HeldRun`: one matmul per run, each
    sibling its columns of it), and prefills and decode steps of several rows give the codes'
    logits."""
    for res in run_ranks(_with_and_without_dequantized, 2, timeout=300):
        assert res["held"] == 2 * 7 and res["joined"] == 2 * 5 and res["dropped"], res
        assert res["shared"] > 0, res  # the joined matmul's columns served the later siblings
        codes, held = res["runs"]
        assert len(codes) == len(held) == 6
        for a, b in zip(codes, held, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _held_compiled(rank: int) -> dict:
    """A compiled slot step (aot_eager) over 4-bit weights held dequantized and joined per run
    of siblings, its q/k/v with biases, against the eager slot engine: the worst difference of
    the logits, and the siblings served from their run's one matmul while tracing."""
    from quantmesh.parallel.held import keep_dequantized
    from quantmesh.quant.bnb import HeldRun
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch
    from quantmesh.tp.layers import sharded_modules

    model, bank = _nf4_llama(tp=1, layers=1)
    assert keep_dequantized([m.local for m in sharded_modules(model).values()], torch.float32)
    shared = [0]
    output = HeldRun.output

    def counted(run: HeldRun, i: int, x: torch.Tensor, *products) -> torch.Tensor:
        shared[0] += int(i > 0 and run.x is x)
        return output(run, i, x, *products)

    HeldRun.output = counted  # type: ignore[method-assign]  # this rank's process only
    comp = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(1, 2), compile=True,
                     backend="aot_eager", prefill=16)  # fmt: skip
    eager = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(1, 2), compile=False)
    admit = {0: [Admit(0, [5, 9, 11, 2], 1), Admit(1, [3, 4], 1)]}  # one pack, then 2-row steps
    worst, _ = _eager_and_compiled(eager, comp, 3, admit, {})
    biased = all(m.local.bias is not None for f, m in sharded_modules(model).items()
                 if f.endswith(("q_proj", "k_proj", "v_proj")))  # fmt: skip
    return {"worst": worst, "shared": shared[0], "biased": biased}


def test_held_weights_joined_per_run_compile_and_equal_eager() -> None:
    """The joined held weights (`HeldRun`) in a compiled step and prefill: the block region
    compiles (a member reads its run's tensor, never its own view of it: two inputs that alias
    were refused, with q/k/v biases), the later siblings take their columns of the run's one
    matmul, and the logits equal the eager engine's."""
    (res,) = run_ranks(_held_compiled, 1, timeout=300)
    assert res["biased"] and res["shared"] > 0, res
    assert res["worst"] < 1e-4, res


def _stacked_and_not(rank: int) -> dict:
    """The same plans on the slot engine (eager) at tp=2 with the bank's sibling adapters
    stacked (q, k, v; gate, up: `AdapterBank.stack_siblings`) and not, on two copies of one
    model and bank: each step's logits, the stacks made, and whether the stacks see a load."""
    from quantmesh.serve.engine import Admit, Plan
    from quantmesh.serve.slots import SlotBatch

    runs, made = [], []
    admit = {0: [Admit(0, [5, 9, 11, 2], 1)], 2: [Admit(1, [3, 4], 0), Admit(2, [7, 8, 1], 2)]}
    drop = {5: [0, 2]}  # one adapter, then mixed (base, 1 and 2), then the base alone
    for stack in (False, True):
        model, bank = _nf4_llama(tp=2, layers=2)
        batch = SlotBatch(model, bank, max_batch=4, max_len=64, ladder=(1, 2), compile=False,
                          stack_adapters=stack)  # fmt: skip
        order: list[int] = []
        last: dict[int, int] = {}
        steps = []
        for step in range(8):
            gone = drop.get(step, [])
            order = [r for r in order if r not in gone]
            feed = batch.feed_tokens([last[r] for r in order])
            plan = Plan(drop=gone, order=list(order), feed=feed, admit=admit.get(step, []))
            s, pre, _ = batch.execute(plan)
            rows = (list(s) if s is not None else []) + pre
            order = order + [a.rid for a in plan.admit]
            last = dict(zip(order, [int(r.argmax()) for r in rows], strict=True))
            steps.append(torch.stack(rows))
        runs.append(steps)
        made.append([len(st.members) for st in bank.stacks])
        if stack:  # a write to a member's slot reaches its stack (its A and B are views)
            first = bank.stacks[0].members[0]
            with torch.no_grad():
                first.a_bank[1].fill_(0.5)
            reached = bool((bank.stacks[0].a[1, : first.r] == 0.5).all())
    return {"runs": runs, "made": made, "reached": reached}


def test_stacked_sibling_adapters_give_the_same_steps() -> None:
    """The bank's adapters of q, k, v and of gate, up run as one A and one B matmul per group
    (the server's default) at tp=2: a row on one adapter, rows on three slots at once and the
    base alone give the unstacked logits at every prefill and decode step."""
    for res in run_ranks(_stacked_and_not, 2, timeout=300):
        assert res["made"] == [[], [3, 2, 3, 2]] and res["reached"], res
        plain, stacked = res["runs"]
        for a, b in zip(plain, stacked, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def _regions_refused(rank: int) -> dict:
    """A compiler that refuses any graph calling a block region (as torch 2.11's inductor did with
    symbolic float inputs): `warm_up` says so and compiles every block, and the step serves."""
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch

    def refusing(gm: torch.fx.GraphModule, example: list) -> object:
        if any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes):
            raise RuntimeError("this compiler takes no block regions")
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example)

    from quantmesh.parallel.state import parallel_state
    from quantmesh.serve.ranks import Lockstep

    model, bank = _nf4_llama(tp=2, layers=2)
    mesh = parallel_state(model).mesh
    agree = Lockstep(mesh.tp_group, mesh.device).agree  # as the server: the ranks agree
    eager = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(1,), compile=False)
    comp = SlotBatch(model, bank, max_batch=2, max_len=64, ladder=(1,), compile=True,
                     backend=refusing, agree=agree)  # type: ignore[arg-type]  # fmt: skip
    marked = comp.regions
    said: list[str] = []
    comp.warm_up(said.append)
    admit = {0: [Admit(0, [5, 9, 11], 1), Admit(1, [3, 4], 2)]}
    worst, steps = _eager_and_compiled(eager, comp, 5, admit, {})
    forwards = ["forward" in layer.__dict__ for layer in model.model.layers]
    return {"marked": marked, "left": comp.regions, "said": said, "worst": worst, "steps": steps,
            "forwards": forwards}  # fmt: skip


def test_a_compiler_refusing_block_regions_compiles_every_block() -> None:
    for res in run_ranks(_regions_refused, 2, timeout=300):
        assert res["marked"] == 2 and res["left"] == 0 and res["forwards"] == [False, False], res
        fell = [m for m in res["said"] if "compiling one block for every block failed" in m]
        assert len(fell) == 1 and "this compiler takes no block regions" in fell[0], res["said"]
        assert res["said"][-1].startswith("compiled the decode steps in"), res["said"]
        assert res["steps"] == 2 * 4 and res["worst"] < 1e-4, res


def _joined_codes_served(rank: int) -> dict:
    """A tiny Llama whose gate and up (256 x 64 each: one nested block of 256) the slot engine
    joins (`kernel4.JOIN_ENABLED`), served by the compiled engine against the eager one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm
    from quantmesh.quant import kernel4
    from quantmesh.serve.bank import AdapterBank
    from quantmesh.serve.engine import Admit
    from quantmesh.serve.slots import SlotBatch

    kernel4.JOIN_ENABLED = True
    kernel4.joins_pay_on = lambda device: True  # on this CPU rank as on a GPU
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                      max_position_embeddings=1024, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    qm.parallelize(model, qm.init_mesh(), quant="nf4", lora=qm.LoraConfig(r=4))
    model.eval()
    bank = AdapterBank(model, slots=3)
    _random_adapters(bank, list(bank.banked.values()), torch.Generator().manual_seed(11))
    batch = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=True,
                      backend="aot_eager", prefill=64)  # fmt: skip
    eager = SlotBatch(model, bank, max_batch=4, max_len=300, ladder=(1, 2), compile=False)
    # short prompts: the compiled, packed prefill; a 70-token one: the eager prefill
    admit = {0: [Admit(0, [3, 4, 5], 1), Admit(1, [9, 10], 1)],
             3: [Admit(2, list(range(7, 77)), 0)]}  # fmt: skip
    worst, steps = _eager_and_compiled(eager, batch, 8, admit, {6: [1]})
    members = [m.__dict__.get("local", m) for m in model.modules()]
    joined = sum(getattr(m, "codes_run", None) is not None for m in members)
    return {"worst": worst, "steps": steps, "joined": joined}


def test_the_compiled_slot_engine_serves_joined_codes() -> None:
    """The slot engine joins sibling layers' codes (QUANTMESH_JOIN_CODES=1) in place: the members'
    tensors become views of one, which a compiled block region refuses as separate inputs. The
    compiled engine (its decode steps and packed prefill) reads the joined tensors alone and
    equals the eager engine."""
    (res,) = run_ranks(_joined_codes_served, 1, timeout=300)
    assert res["joined"] == 4, res  # gate and up of 2 blocks
    assert res["steps"] == 2 * 7, res
    assert res["worst"] < 1e-4, res  # fp32
