"""mark_block_regions: a whole-model compile traces one block and reuses it for the others.

The decode steps (`fast_decode`, the server's slot steps) compile the whole model as one graph; with
the blocks marked, the graph calls one traced block once per block (torch's invoke_subgraph), so
inductor compiles one block instead of all (a 7B step: 1 instead of 32). The values are the
unmarked model's. tests/distributed/test_serve_slots.py checks the slot step at tp=2, where every
compiled graph of the warm-up keeps one block.
"""

from __future__ import annotations

import os

import pytest
import torch

from quantmesh.blocks.compile import REGIONS_ENV, mark_block_regions, unmark_block_regions
from tests.models import llama


def _graphs_of(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The compiled forward's logits and, per graph, (block calls, distinct blocks traced)."""
    from torch._dynamo.backends.registry import lookup_backend

    seen: list[tuple[int, int]] = []

    def backend(gm: torch.fx.GraphModule, example: list) -> object:
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        seen.append((len(calls), len({n.args[0].target for n in calls})))
        return lookup_backend("aot_eager")(gm, example)

    torch._dynamo.reset()
    step = torch.compile(lambda x: model(input_ids=x).logits, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = step(ids)
    return out, seen


def test_marked_blocks_compile_once_and_compute_the_same(monkeypatch) -> None:
    model = llama(layers=3, vocab=64, seed=1).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    plain, seen = _graphs_of(model, ids)
    assert seen == [(0, 0)]  # unmarked: every block inlined into the graph
    assert mark_block_regions(model) == 3
    assert mark_block_regions(model) == 0  # marked already: left as they are
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)  # eagerly the same forward
    marked, seen = _graphs_of(model, ids)
    assert seen == [(3, 1)]  # three calls of one traced block
    torch.testing.assert_close(marked, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-6)


def test_regions_switch_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv(REGIONS_ENV, "0")
    model = llama(layers=2, vocab=64, seed=1)
    assert mark_block_regions(model) == 0
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    monkeypatch.setenv(REGIONS_ENV, "yes")
    with pytest.raises(ValueError, match="QUANTMESH_COMPILE_REGIONS='yes'; expected 1"):
        mark_block_regions(model)


def test_unmarking_restores_the_class_forward_and_leaves_others_alone() -> None:
    model = llama(layers=3, vocab=64, seed=1)
    mine = model.model.layers[2].forward
    model.model.layers[2].forward = mine  # replaced by someone else: not ours to mark or undo
    assert mark_block_regions(model) == 2
    assert unmark_block_regions(model) == 2
    assert unmark_block_regions(model) == 0
    layers = model.model.layers
    assert ["forward" in b.__dict__ for b in layers] == [False, False, True]
    assert layers[2].__dict__["forward"] is mine


def _decode_refused(monkeypatch, refuses, why: str, calls: int = 1) -> tuple:
    """`fast_decode` of a small Llama (mode None) `calls` times under a compiler that raises
    RuntimeError(why) on the graphs `refuses(gm, example)` picks and compiles the others with
    aot_eager: (the eager loop's tokens, each compiled call's, the warnings said, the sizes of
    the graphs compiled)."""
    import warnings

    from torch._dynamo.backends.registry import lookup_backend

    import quantmesh as qm
    import quantmesh.config

    graphs: list[int] = []

    def refusing(gm: torch.fx.GraphModule, example: list) -> object:
        if refuses(gm, example):
            raise RuntimeError(why)
        graphs.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example)

    monkeypatch.setattr(quantmesh.config, "compile_options", lambda *a, **k: {"backend": refusing})
    model = llama(layers=2, vocab=64, seed=1).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    ref = qm.fast_decode(model, ids, 6, compile=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [qm.fast_decode(model, ids, 6, mode=None) for _ in range(calls)]
    return ref, got, [str(w.message) for w in seen], graphs, model


def test_fast_decode_compiles_every_block_where_the_compiler_refuses_regions(monkeypatch) -> None:
    """A compiler that refuses graphs calling a block region (torch 2.11's inductor did with
    symbolic float inputs): `fast_decode` warns, compiles every block, and decodes the same."""

    def regions(gm: torch.fx.GraphModule, example: list) -> bool:
        return any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)

    why = "this compiler takes no block regions"
    ref, got, said, _, model = _decode_refused(monkeypatch, regions, why)
    said = [m for m in said if "compiling one block for every block" in m]
    assert len(said) == 1 and why in said[0], said
    assert torch.equal(got[0], ref)
    assert not any("forward" in b.__dict__ for b in model.model.layers)  # unmarked


def qlora_llama(intermediate: int = 128, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A small sdpa Llama, nf4 + LoRA (its adapters' B nonzero) on one gloo rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import quantmesh as qm
    from tests.models import nonzero_lora_b_

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=intermediate,
                      num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    qm.parallelize(model, qm.init_mesh(backend="gloo"), quant="nf4", lora=qm.LoraConfig(r=4),
                   dtype=dtype)  # fmt: skip
    return nonzero_lora_b_(model, std=0.2).eval()


def test_the_compiled_prefill_takes_any_prompt_length_in_one_graph(monkeypatch) -> None:
    """With `PREFILL_COMPILED` the prefill is compiled once for prompts of several lengths (a
    slice's strides too), the tokens those of the eager loop; without it, only the step."""
    from torch._dynamo.backends.registry import lookup_backend

    import quantmesh as qm
    import quantmesh.config
    from quantmesh.infer import decode

    graphs: list[int] = []  # symbolic inputs of each graph compiled

    def counting(gm: torch.fx.GraphModule, example: list) -> object:
        graphs.append(sum(isinstance(e, torch.SymInt) for e in example))
        return lookup_backend("aot_eager")(gm, example)

    monkeypatch.setattr(quantmesh.config, "compile_options", lambda *a, **k: {"backend": counting})
    model = qlora_llama()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    prompts = [ids[:, :5], ids[:, 2:], ids]  # (a slice, strided; then whole)
    refs = [qm.fast_decode(model, p, 6, compile=False) for p in prompts]
    torch._dynamo.reset()
    assert all(
        torch.equal(qm.fast_decode(model, p, 6, mode=None), r)
        for p, r in zip(prompts, refs, strict=True)
    )
    assert graphs == [0]  # by default: the step alone
    monkeypatch.setattr(decode, "PREFILL_COMPILED", True)
    got = [qm.fast_decode(model, p, 6, mode=None) for p in prompts]
    assert all(torch.equal(g, r) for g, r in zip(got, refs, strict=True))
    assert len(graphs) == 2 and graphs[1] > 0  # one prefill graph, its length symbolic


def test_fast_decode_prefills_eagerly_where_the_compiler_refuses_the_prefill(monkeypatch) -> None:
    """A compiler that refuses the prefill's graph (its prompt length symbolic): `fast_decode`
    warns once, prefills eagerly from then on and decodes the same; later calls compile
    nothing more."""
    from quantmesh.infer import decode

    monkeypatch.setattr(decode, "PREFILL_COMPILED", True)

    def symbolic(gm: torch.fx.GraphModule, example: list) -> bool:
        return any(isinstance(e, torch.SymInt) for e in example)

    why = "this compiler takes no symbolic lengths"
    ref, got, said, graphs, _ = _decode_refused(monkeypatch, symbolic, why, calls=2)
    said = [m for m in said if "compiling the prefill failed" in m]
    assert len(said) == 1 and why in said[0], said
    assert all(torch.equal(g, ref) for g in got)
    assert len(graphs) == 1  # the step's graph alone, once


def test_decoding_sets_the_blocks_training_compile_aside_and_gives_it_back(monkeypatch) -> None:
    """A model whose blocks `compile_blocks` compiled for training decodes with `fast_decode`
    (the blocks' own compile of a marked region around the cache's writes failed: torch refuses
    the region's aliased writes), gives the uncompiled model's tokens, trains through its
    compiled blocks again afterwards (the regions unmarked), and decodes again without a new
    compile."""
    from torch._dynamo.backends.registry import lookup_backend

    import quantmesh as qm
    import quantmesh.config

    graphs: list[int] = []  # the blocks' own compiles
    steps: list[int] = []  # the decode step's

    def counting(gm: torch.fx.GraphModule, example: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example)

    def stepping(gm: torch.fx.GraphModule, example: list) -> object:
        steps.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example)

    monkeypatch.setattr(quantmesh.config, "compile_options", lambda *a, **k: {"backend": stepping})
    torch._dynamo.reset()
    model = llama(layers=2, vocab=64, seed=1).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    ref = qm.fast_decode(model, ids, 6, compile=False)
    assert qm.compile_blocks(model, backend=counting) == 2
    impls = [b._compiled_call_impl for b in model.model.layers]
    assert all(impls)
    got = qm.fast_decode(model, ids, 6, mode=None)
    again = qm.fast_decode(model, ids, 6, mode=None)
    assert torch.equal(got, ref) and torch.equal(again, ref)
    assert graphs == []  # no block graph compiled for the prefill or inside the step
    assert len(steps) == 1  # one step graph, for both calls
    assert [b._compiled_call_impl for b in model.model.layers] == impls  # given back
    assert not any("forward" in b.__dict__ for b in model.model.layers)  # unmarked after
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # use_cache: a cache in every block
    assert graphs  # the training forward ran the blocks' compiled call
    graphs.clear()
    model.eval()
    assert torch.equal(qm.fast_decode(model, ids, 6, mode=None), ref)
    assert graphs == [] and len(steps) == 1  # marked again alike: the step's guards held


def _join_on_cpu(monkeypatch) -> None:
    """The join where the switch says, on CPU too (by default only a GPU's codes join:
    `kernel4.joins_pay_on`)."""
    from quantmesh.quant import kernel4

    monkeypatch.setattr(kernel4, "joins_pay_on", lambda device: kernel4.JOIN_ENABLED)


def test_joined_sibling_codes_compile_as_block_regions(monkeypatch) -> None:
    """Sibling layers' codes joined (`kernel4.JOIN_ENABLED`: gate and up, each 256 x 64, one
    nested block of 256) are views of one tensor, and a compiled block region refuses inputs
    that alias. Compiling, each member reads the run's tensors alone: the step and the prefill
    compile as regions (no fallback to every block, no warning), with the tokens the unjoined
    model decodes eagerly."""
    import warnings

    import quantmesh as qm
    from quantmesh.infer import decode
    from quantmesh.quant import kernel4

    model = qlora_llama(intermediate=256)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    _join_on_cpu(monkeypatch)
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", False)
    ref = qm.fast_decode(model, ids, 6, compile=False)
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", True)
    monkeypatch.setattr(decode, "PREFILL_COMPILED", True)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [qm.fast_decode(model, p, 6, mode=None) for p in (ids, ids[:, 3:])]
    said = [str(w.message) for w in seen if "quantmesh:" in str(w.message)]
    assert not said, said
    members = [m.__dict__.get("local", m) for m in model.modules()]
    assert sum(getattr(m, "codes_run", None) is not None for m in members) == 4  # 2 blocks
    assert model.__dict__["_quantmesh_decoder"].regions  # never dropped
    assert torch.equal(got[0], ref), (got[0], ref)
    assert torch.equal(got[1], qm.fast_decode(model, ids[:, 3:], 6, compile=False))


def test_a_compilers_refusal_is_said_with_its_reason() -> None:
    """A compiler's error whose first line ends in a colon (torch's "Got graph break/error:")
    is said with the line after it, the reason."""
    from quantmesh.errors import said

    e = RuntimeError(
        "This higher order operator doesn't work unless it is captured completely. Got graph "
        "break/error:\n\nEncountered aliasing during higher order op tracing\n  Explanation: ..."
    )
    assert said(e) == (
        "RuntimeError: This higher order operator doesn't work unless it is captured completely. "
        "Got graph break/error: Encountered aliasing during higher order op tracing"
    )
    assert said(ValueError("one line")) == "ValueError: one line"


def test_compiled_training_after_a_join_reads_the_joined_codes(monkeypatch) -> None:
    """Training with compiled blocks after `fast_decode` joined sibling codes: the members read
    the joined tensors (`CodesRun.flat_product`, under autograd), and the loss and every LoRA
    gradient are the unjoined eager step's (fp32: rounding only)."""
    import quantmesh as qm
    from quantmesh.quant import bnb as qbnb
    from quantmesh.quant import kernel4

    model = qlora_llama(intermediate=256, dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[torch.Tensor, dict]:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach(), grads

    ref_loss, ref = step()
    _join_on_cpu(monkeypatch)
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", True)
    model.eval()
    qm.fast_decode(model, ids[:, :5], 3, compile=False)  # joins gate and up of both blocks
    flat = [0]
    real = qbnb.CodesRun.flat_product

    def counted(self, *args, **kw):
        flat[0] += 1
        return real(self, *args, **kw)

    monkeypatch.setattr(qbnb.CodesRun, "flat_product", counted)
    torch._dynamo.reset()
    qm.compile_blocks(model, backend="aot_eager")
    loss, got = step()
    assert flat[0] > 0  # traced through the joined tensors
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == ref.keys() and ref
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_the_join_is_on_by_default_where_the_kernels_read_it(monkeypatch) -> None:
    """`JOIN_ENABLED` is on by default, and joins a GPU's codes only (`kernel4.joins_pay_on`):
    on CPU nothing reads a joined weight in one launch, so fast_decode leaves every layer's codes
    its own (no `codes_run`) and runs no forward to find the runs (the prefill and one step: two
    forwards for two tokens), and the switch off keeps a GPU's codes too."""
    import quantmesh as qm
    from quantmesh.quant import kernel4

    if os.environ.get("QUANTMESH_JOIN_CODES") is None:
        assert kernel4.JOIN_ENABLED  # the default, as this process imported it
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", True)
    cuda = torch.device("cuda")
    assert kernel4.joins_pay_on(cuda) == kernel4._HAS_TRITON
    assert not kernel4.joins_pay_on(torch.device("cpu"))
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", False)
    assert not kernel4.joins_pay_on(cuda)
    monkeypatch.setattr(kernel4, "JOIN_ENABLED", True)
    model = qlora_llama(intermediate=256).eval()  # gate and up: joinable shapes
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    forwards = []
    model.register_forward_pre_hook(lambda m, args: forwards.append(1))
    qm.fast_decode(model, ids, 2, compile=False)
    layers = [m.__dict__.get("local", m) for m in model.modules()]  # (a shard's own layer)
    runs = [m for m in layers if getattr(m, "codes_run", None) is not None]
    assert not runs, [type(m).__name__ for m in runs]
    assert len(forwards) == 2, forwards


def test_the_adapters_deltas_go_in_the_launch_by_default_where_the_gemv_runs(monkeypatch) -> None:
    """`GEMV_LORA_ENABLED` is on by default and applies where the gemv runs only
    (`kernel4.gemv_lora_on`): on CPU no adapter makes its launch tensors (`low_rank` is None,
    the adapter stacks hold no B rows for a launch), so fast_decode adds every delta after its
    product, as before; with the CPU among the kernels' devices (what the interpreter's tests
    do) the same adapters make them."""
    import quantmesh as qm
    from quantmesh.infer.decode import AdapterStack
    from quantmesh.lora.adapter import LoraAdapter
    from quantmesh.quant import kernel4
    from quantmesh.tp.layers import sharded_modules

    if os.environ.get("QUANTMESH_GEMV_LORA") is None:
        assert kernel4.GEMV_LORA_ENABLED  # the default, as this process imported it
    monkeypatch.setattr(kernel4, "GEMV_LORA_ENABLED", True)
    assert kernel4.gemv_lora_on(torch.device("cuda")) == kernel4._HAS_TRITON
    assert not kernel4.gemv_lora_on(torch.device("cpu"))
    model = qlora_llama().eval()
    adapters = [m.lora for m in sharded_modules(model).values() if isinstance(m.lora, LoraAdapter)]
    assert adapters
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    stacks: list[AdapterStack] = []
    real_refresh = AdapterStack.refresh

    def refresh(self: AdapterStack) -> None:
        real_refresh(self)
        stacks.append(self)

    monkeypatch.setattr(AdapterStack, "refresh", refresh)
    qm.fast_decode(model, ids, 2, compile=False)
    assert stacks and all(s.e.numel() == 0 for s in stacks)
    with torch.no_grad():
        assert all(ad.low_rank() is None for ad in adapters)
        assert not any("_low_rank_vectors" in ad.__dict__ for ad in adapters)
        monkeypatch.setattr(kernel4, "KERNEL_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(kernel4, "_HAS_TRITON", True)  # (whether or not it is installed)
        assert all(ad.low_rank() is not None for ad in adapters)


def _stacks_hold_their_members(stacks) -> None:
    """Each stack's A rows, block-diagonal B and (where made) launch rows (B padded to the widest
    rank), columns and scales are those of its members now."""
    for st in stacks:
        ads = [m.lora for m in st.members]
        ranks = [ad.r for ad in ads]
        outs = torch.tensor([ad.lora_B.weight.shape[0] for ad in ads])
        assert torch.equal(st.a, torch.cat([ad.lora_A.weight for ad in ads]))
        assert torch.equal(st.b, torch.block_diag(*[ad.lora_B.weight for ad in ads]))
        if not st.e.numel():
            continue
        e = torch.cat([torch.nn.functional.pad(ad.lora_B.weight, (0, max(ranks) - r))
                       for ad, r in zip(ads, ranks, strict=True)])  # fmt: skip
        assert torch.equal(st.e, e)
        col = torch.tensor([sum(ranks[:i]) for i in range(len(ads))]).repeat_interleave(outs)
        assert torch.equal(st.col, col.to(torch.int32))
        assert torch.equal(st.scale, torch.tensor([ad.scale for ad in ads]).repeat_interleave(outs))


def _train_in_place(stacks, seed: int) -> None:
    """New adapter values in place, as an optimizer writes them (B through `.data`, which bumps
    no version counter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for st in stacks:
            for m in st.members:
                m.lora.lora_A.weight.add_(torch.randn(m.lora.lora_A.weight.shape, generator=g))
                m.lora.lora_B.weight.data.mul_(-3.0)


def test_refreshed_stacks_hold_the_adapters_current_weights(monkeypatch) -> None:
    """`refresh_stacks` (one foreach copy for every stack) leaves each stack holding its members'
    current weights, launch rows and scales included, after the adapters changed in place and a
    member's scale changed, at the same addresses (a captured CUDA graph reads them there); and
    each `fast_decode` call's prefill refreshes its decoder's stacks."""
    import quantmesh as qm
    from quantmesh.infer import decode
    from quantmesh.quant import kernel4

    model = qlora_llama()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    qm.fast_decode(model, ids, 2, compile=False)  # its first prefill finds the stacks
    stacks = model.__dict__["_quantmesh_decoder"].stacks
    assert len(stacks) == 4  # q/k/v, gate/up a block
    _train_in_place(stacks, 1)
    qm.fast_decode(model, ids, 2, compile=False)
    _stacks_hold_their_members(stacks)

    monkeypatch.setattr(kernel4, "gemv_lora_on", lambda device: True)  # the launch's rows too
    with torch.no_grad(), decode.stack_sibling_adapters(model) as stacks:
        model(input_ids=ids)
    assert len(stacks) == 4 and all(s.e.numel() for s in stacks)
    _stacks_hold_their_members(stacks)
    _train_in_place(stacks, 2)
    member = stacks[2].members[1]
    member.set_adapter(member.lora.retuned(scale=0.25, dropout=0.0))
    addresses = [(st.a.data_ptr(), st.b.data_ptr(), st.e.data_ptr()) for st in stacks]
    decode.refresh_stacks(stacks)
    _stacks_hold_their_members(stacks)
    assert member.lora.scale == 0.25 and stacks[2].scale[stacks[2].out_at[1]] == 0.25
    assert addresses == [(st.a.data_ptr(), st.b.data_ptr(), st.e.data_ptr()) for st in stacks]
