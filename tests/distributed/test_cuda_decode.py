"""greedy_decode's compiled step (CUDA graphs, "reduce-overhead") is the eager step: on one GPU,
nf4 base + LoRA (non-zero adapters), bf16.

Teacher-forced: the eager and the compiled step are fed the same tokens (the eager loop's own), so
one near-tie cannot make the two runs drift apart and hide or fake a difference. They run with the
sibling adapters stacked, as the loop's steps do, so that the eager teacher-forced step is the
loop's step to the last bit (each adapter on its own sums in another order: with random weights'
near-ties, enough to pick another token). "Within bf16
rounding" is measured, not assumed: the same architecture unquantized, run eagerly in bf16 and in
fp32 on the same tokens, gives the size of bf16's own error over these layers (3-6% of the logits'
norm on CPU); the compiled step must stay within 1.5x of it. Then the whole compiled greedy_decode
must give the eager tokens up to the first near-tie: a step whose eager top-2 margin is within twice
the compiled-vs-eager difference (the only place that difference may pick another token). A stale
cache slot or a replayed graph reading the wrong buffer shows up as a divergence at a clear margin.

A second test decodes a *trained* model, whose margins are wide as a real model's are: random
weights give near-ties every few tokens, so on them "equal up to the first near-tie" can be a short
prefix. A small Llama learns a fixed next-token map (a random permutation of the vocabulary, in
sequences that follow it) on the GPU, is quantized to nf4 with non-zero adapters, and the compiled
greedy_decode (sibling adapters stacked, and each on its own) must give every token of the eager
loop with each adapter on its own; the test first checks that the model did learn (its eager tokens follow
the map), so that the margins are really wide. Then four and sixteen sequences at once, compiled,
through the gemv and the tensor-core kernel (turned on for it), must give the tokens of
bitsandbytes' path run eagerly; and so must one and sixteen with the sibling layers' codes joined
(`kernel4.JOIN_ENABLED`), and one with a repetition penalty its eager loop's. No pretrained checkpoint is used: the GPU machine has no network.
Marked cuda: runs on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

pytestmark = pytest.mark.cuda

NEW = 96


def _teacher_forced(model, ids, tokens, compile_mode):
    """(eager logits, compiled logits) of every step fed `tokens`, one static cache each. The
    steps run with the sibling adapters stacked, as the greedy loop's steps do (`fast_decode`):
    the stacked adapters sum in another order than each adapter on its own, so without them the
    teacher-forced steps would not be the loop's steps to the last bit. The stacks are the ones
    the last prefill built (each prefill's stacking replaces the model's earlier stacks), shared
    by both decoders' steps."""
    from quantmesh.infer.decode import _Decoder

    eager = _Decoder(model, 1, 256, compile=False, mode=None)
    comp = _Decoder(model, 1, 256, compile=False, mode=None)
    step = torch.compile(comp.logits, mode=compile_mode, fullgraph=True)
    le, lc = [], []
    with torch.no_grad():
        eager.prefill(ids)
        comp.prefill(ids)  # the model's stacks from here on: comp's
        comp.stacked(True)
        try:
            for i in range(tokens.shape[1] - 1):
                tok = tokens[:, i : i + 1]
                le.append(eager.logits(tok).float().cpu())
                lc.append(step(tok).float().clone().cpu())
        finally:
            comp.stacked(False)
    return torch.cat(le), torch.cat(lc)  # (steps, vocab) each


def _first_mismatch(logits: torch.Tensor, tokens: torch.Tensor) -> str:
    """Where the logits' argmax first differs from `tokens`, and that step's top-2 gap."""
    bad = (logits.argmax(1) != tokens).nonzero()
    if not len(bad):
        return "none"
    i = int(bad[0, 0])
    top2 = logits[i].topk(2).values
    return f"step {i} of {len(tokens)}, top-2 gap {float(top2[0] - top2[1]):.3g}"


def _decode(rank: int) -> dict:
    import quantmesh as qm
    from quantmesh.infer.decode import _Decoder
    from tests.models import llama

    mesh = qm.init_mesh()
    shape = dict(heads=8, kv_heads=4, head_dim=64, vocab=2048, layers=4, tie=False, seed=3)
    g = torch.Generator(device="cpu").manual_seed(5)
    ids = torch.randint(0, 2048, (1, 32), generator=g).to(mesh.device)
    out: dict = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = llama(**shape)
        model.config.max_position_embeddings = 512
        qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16), dtype=dt)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:  # adapters that change the output (B starts at zero)
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        model.eval()
        eager_tokens = qm.greedy_decode(model, ids, NEW, compile=False)  # (1, NEW)
        e, c = _teacher_forced(model, ids, eager_tokens, "reduce-overhead")
        compiled_tokens = qm.greedy_decode(model, ids, NEW, compile=True)
        out[name] = {
            "eager_logits": e,
            "compiled_logits": c,
            "eager_tokens": eager_tokens.cpu()[0],
            "compiled_tokens": compiled_tokens.cpu()[0],
        }
    # the yardstick: bf16 against fp32, eager, the same architecture unquantized, the same tokens
    pair = []
    for dt in (torch.bfloat16, torch.float32):
        m = llama(**shape).to(device=mesh.device, dtype=dt).eval()
        m.config.max_position_embeddings = 512
        pair.append(_Decoder(m, 1, 256, compile=False, mode=None))
    noise = []
    tokens = out["bf16"]["eager_tokens"][None].to(mesh.device)
    with torch.no_grad():
        for d in pair:
            d.prefill(ids)
        for i in range(NEW - 1):
            a, b = (d.logits(tokens[:, i : i + 1]).float() for d in pair)
            noise.append(float((a - b).norm() / b.norm()))
    out["bf16_noise"] = noise
    return out


def _until_first_tie(r: dict) -> tuple[int, float]:
    """(tokens that must be equal: up to the first near-tie, share of steps that are clear)."""
    e, c = r["eager_logits"], r["compiled_logits"]
    top2 = e.topk(2, dim=1).values
    wide = (top2[:, 0] - top2[:, 1]) > 2 * (c - e).abs().amax(dim=1)  # argmax not a near-tie
    ties = (~wide).nonzero()
    return (
        int(ties[0, 0]) + 1 if len(ties) else len(r["eager_tokens"])
    ), wide.float().mean().item()


def test_compiled_decode_step_is_the_eager_step_on_nf4_lora():
    if not torch.cuda.is_available():  # the marker deselects it in CI; run where a GPU is
        pytest.fail("marked cuda but no CUDA device")
    out = run_ranks(_decode, 1, timeout=600)[0]
    for name in ("bf16", "fp32"):
        r = out[name]
        # the teacher-forced eager logits' argmax are the eager loop's own tokens (positions 1..)
        assert (r["eager_logits"].argmax(1) == r["eager_tokens"][1:]).all(), (
            name,
            _first_mismatch(r["eager_logits"], r["eager_tokens"][1:]),
        )
        upto, _ = _until_first_tie(r)
        assert (r["compiled_tokens"][:upto] == r["eager_tokens"][:upto]).all(), (name, upto)
    # bf16: the compiled step within bf16's own error (measured on the same layers and tokens)
    e, c = out["bf16"]["eager_logits"], out["bf16"]["compiled_logits"]
    err = ((c - e).norm(dim=1) / e.norm(dim=1)).mean().item()
    noise = sum(out["bf16_noise"]) / len(out["bf16_noise"])
    assert err <= 1.5 * noise, (err, noise)
    # fp32 compute: far less rounding, so most steps are clear (85% on one H200: the eager and
    # the compiled 4-bit matmuls still accumulate differently) and the check above has teeth
    _, clear = _until_first_tie(out["fp32"])
    assert clear > 0.5, clear


def _trained(rank: int) -> dict:
    """Train a small Llama on a permutation map, then decode it (nf4 + LoRA) eager and compiled,
    one sequence, then four and sixteen at once."""
    import quantmesh as qm
    from quantmesh.quant import kernel4
    from tests.models import llama

    kernel4.JOIN_ENABLED = False  # every layer its own codes until the joined checks (last)
    mesh = qm.init_mesh()
    vocab, steps = 512, 400
    g = torch.Generator(device="cpu").manual_seed(11)
    perm = torch.randperm(vocab, generator=g)
    model = llama(heads=8, kv_heads=4, head_dim=32, vocab=vocab, layers=4, tie=False, seed=2)
    model.config.max_position_embeddings = 512
    # sdpa (transformers' default; the decode attention then runs in the compiled steps): the
    # prefill's recording needs it, transformers 5.17's eager masks copying a host scalar in
    model.config._attn_implementation = "sdpa"
    model = model.to(mesh.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(steps):  # sequences that follow the map from random starts: (32, 64)
        x = [torch.randint(0, vocab, (32,), generator=g)]
        for _ in range(63):
            x.append(perm[x[-1]])
        ids = torch.stack(x, 1).to(mesh.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=16), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # small non-zero adapters: the decode step runs them
                p.copy_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    # a prompt that follows the map (the model learned the map in such contexts), and new
    # tokens inside the trained length: 8 + 48 <= 64
    chain = [int(torch.randint(0, vocab, (1,), generator=g))]
    for _ in range(8 + 48 - 1):
        chain.append(int(perm[chain[-1]]))
    ids = torch.tensor([chain[:8]], device=mesh.device)
    # the reference: the eager loop with each adapter on its own; then the compiled step with
    # the sibling adapters stacked (the default) and without
    eager = qm.greedy_decode(model, ids, 48, compile=False, fuse_adapters=False)[0].cpu()
    from quantmesh.infer import prefill_graph

    # (whatever the environment says) the compiled calls' prefills recorded and replayed
    prefill_graph.ENABLED = True
    compiled = qm.greedy_decode(model, ids, 48, compile=True)[0].cpu()
    # (its steps recorded by hand as one CUDA graph, the default: step_graph; recorded once,
    # not refused)
    sg = model.__dict__["_quantmesh_decoder"].step_graph
    recorded = sg is not None and sg.records == 1 and sg.refused is None
    # the prefill recorded as a CUDA graph (bucket 16: 8 pads) in that call, replayed in this one
    graphs = model.__dict__["_quantmesh_decoder"].graphs
    replayed = qm.greedy_decode(model, ids, 48, compile=True)[0].cpu()
    prefill_graphs = (len(graphs.entries), graphs.replays, graphs.refused)
    # the cache a replayed prefill leaves against the eager prefill's (the map's tokens depend on
    # the last token alone, so the tokens above cannot see the cache's other slots): the
    # decoder's own prefill, switch off then on (outside fast_decode the model runs sdpa, another
    # state: recorded again, then replayed)
    dec, n = model.__dict__["_quantmesh_decoder"], ids.shape[1]

    def held() -> torch.Tensor:
        return torch.cat([torch.cat([lay.keys[:, :, :n], lay.values[:, :, :n]]).float().flatten()
                          for lay in dec.cache.layers])  # fmt: skip

    with torch.no_grad():
        prefill_graph.ENABLED = False
        dec.prefill(ids)
        eager_kv = held()
        prefill_graph.ENABLED = True
        dec.prefill(ids)
        replayed_kv = held()
    cache_rel = float((replayed_kv - eager_kv).norm() / eager_kv.norm())
    cache_graphs = (len(dec.graphs.entries), dec.graphs.refused)
    unstacked = qm.greedy_decode(model, ids, 48, compile=True, fuse_adapters=False)[0].cpu()
    # the steps as inductor's CUDA graph trees replay them (QUANTMESH_STEP_GRAPH=0)
    from quantmesh.infer import step_graph

    step_graph.ENABLED = False
    try:
        trees = qm.greedy_decode(model, ids, 48, compile=True)[0].cpu()
        trees_dec = model.__dict__["_quantmesh_decoder"].step_graph
    finally:
        step_graph.ENABLED = True
    expect = chain[8:]
    # a repetition penalty inside the compiled, CUDA-graphed step (the demo's setting): the
    # eager loop's tokens with the same penalty
    rep_eager = qm.fast_decode(model, ids, 48, repetition_penalty=1.3, compile=False)[0].cpu()
    rep_compiled = qm.fast_decode(model, ids, 48, repetition_penalty=1.3)[0].cpu()
    # four sequences at once: each step's matmuls take the gemv at 4 rows (kernel4's
    # GEMV_MAX_ROWS, on by default), compiled; sixteen: the tensor-core kernel (opt-in, turned
    # on here); the reference of each, bitsandbytes' path, eager
    from quantmesh.quant import kernel4 as k4

    out = {"loss": float(loss), "eager": eager, "compiled": compiled, "unstacked": unstacked,
           "recorded": recorded, "trees": trees, "trees_recorded": trees_dec is not None,
           "replayed": replayed, "prefill_graphs": prefill_graphs, "cache_rel": cache_rel,
           "cache_graphs": cache_graphs,
           "map": torch.tensor(expect), "rep_eager": rep_eager, "rep_compiled": rep_compiled,
           "gemv_rows": k4.GEMV_MAX_ROWS,
           "mma_rows": (k4.MMA_MIN_ROWS, k4.MMA_MAX_ROWS)}  # fmt: skip
    for n, flags in ((4, {}), (16, {"MMA_ENABLED": True})):
        chains = [[int(s)] for s in torch.randint(0, vocab, (n,), generator=g)]
        for c in chains:
            for _ in range(8 + 48 - 1):
                c.append(int(perm[c[-1]]))
        ids_n = torch.tensor([c[:8] for c in chains], device=mesh.device)
        saved = {k: getattr(k4, k) for k in ("GEMV_ENABLED", "MMA_ENABLED")}
        try:
            for k, v in flags.items():
                setattr(k4, k, v)
            out[f"batch{n}"] = qm.greedy_decode(model, ids_n, 48, compile=True).cpu()
            k4.GEMV_ENABLED = k4.MMA_ENABLED = False
            out[f"batch{n}_bnb"] = qm.greedy_decode(model, ids_n, 48, compile=False,
                                                    fuse_adapters=False).cpu()  # fmt: skip
        finally:
            for k, v in saved.items():
                setattr(k4, k, v)
        out[f"batch{n}_map"] = torch.tensor([c[8:] for c in chains])
        out[f"ids{n}"] = ids_n
    # the siblings' codes joined (q/k/v, gate/up read as one weight: kernel4.JOIN_ENABLED), last
    # (the join is in place): one sequence through the gemv, sixteen through the tensor-core
    # kernel, compiled; the same tokens as above
    saved = (k4.JOIN_ENABLED, k4.GEMV_LORA_ENABLED, k4._gemv_lora_op)
    # counted in a tensor: a Python counter read inside the compiled step becomes a guard on its
    # value, and every step would compile again (until the recompile limit stops the decode)
    calls = torch.zeros((), dtype=torch.int64, device=mesh.device)

    def counted(*args):
        calls.add_(1)
        return saved[2](*args)

    try:
        k4.JOIN_ENABLED = True
        out["joined"] = qm.greedy_decode(model, ids, 48, compile=True)[0].cpu()
        out["batch16_joined"] = qm.greedy_decode(model, out.pop("ids16"), 48, compile=True).cpu()
        # the adapters' B products inside the gemv's launch (kernel4.GEMV_LORA_ENABLED, the
        # default): compiled and eager, one sequence and four, the same tokens
        k4.GEMV_LORA_ENABLED, k4._gemv_lora_op = True, counted
        out["lora"] = qm.greedy_decode(model, ids, 48, compile=True)[0].cpu()
        out["lora_eager"] = qm.greedy_decode(model, ids, 48, compile=False)[0].cpu()
        out["batch4_lora"] = qm.greedy_decode(model, out["ids4"], 48, compile=True).cpu()
        out["lora_calls"] = int(calls)
    finally:
        k4.JOIN_ENABLED, k4.GEMV_LORA_ENABLED, k4._gemv_lora_op = saved
    out.pop("ids4")
    out["runs"] = sum(  # (a sharded layer holds its own linear in `local`)
        getattr(m.__dict__.get("local", m), "codes_run", None) is not None for m in model.modules()
    )
    return out


def test_compiled_decode_gives_a_trained_models_tokens():
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    out = run_ranks(_trained, 1, timeout=600)[0]
    follows = (out["eager"] == out["map"]).float().mean().item()
    assert follows > 0.9, (out["loss"], follows)  # it learned: wide margins, not near-ties
    assert (out["compiled"] == out["eager"]).all(), (out["compiled"], out["eager"])
    assert (out["unstacked"] == out["eager"]).all(), (out["unstacked"], out["eager"])
    # the steps recorded by hand (the default) and as CUDA graph trees give the eager tokens
    assert out["recorded"] and not out["trees_recorded"], out
    assert (out["trees"] == out["eager"]).all(), (out["trees"], out["eager"])
    # the prefill replayed from its CUDA graph (recorded in the first compiled call, checked
    # against its eager prefill there, replayed again in the second) gives the eager tokens
    assert out["prefill_graphs"] == (1, 2, None), out["prefill_graphs"]
    assert (out["replayed"] == out["eager"]).all(), (out["replayed"], out["eager"])
    # and its cache holds the eager prefill's keys and values (within the recording's rounding:
    # 0.6-1% on 4 random-weight layers of the 7B shape, an H100); a lost cache would be ~100%
    from quantmesh.infer import prefill_graph

    assert out["cache_graphs"] == (1, None), out["cache_graphs"]
    assert out["cache_rel"] < prefill_graph.TOLERANCE, out["cache_rel"]
    # the penalty in the compiled, CUDA-graphed step gives the eager loop's tokens (its
    # arithmetic against transformers' is checked on CPU: test_compile.py)
    assert (out["rep_compiled"] == out["rep_eager"]).all(), (out["rep_compiled"], out["rep_eager"])
    # four rows at once, the gemv's, and sixteen, the tensor-core kernel's (compiled), give
    # bitsandbytes' path's tokens (eager)
    assert out["gemv_rows"] >= 4 and out["mma_rows"][0] <= 16 <= out["mma_rows"][1], out
    for n in (4, 16):
        follows = (out[f"batch{n}_bnb"] == out[f"batch{n}_map"]).float().mean().item()
        assert follows > 0.9, (n, follows)
        assert (out[f"batch{n}"] == out[f"batch{n}_bnb"]).all(), (n, out[f"batch{n}"],
                                                                   out[f"batch{n}_bnb"])  # fmt: skip
    # the joined codes: 4 blocks x q, k, v in runs (gate and up, 88 x 256, hold 352 blocks of
    # 64: not whole nested blocks of 256, so they stay apart), the same tokens
    assert out["runs"] == 4 * 3, out["runs"]
    assert (out["joined"] == out["eager"]).all(), (out["joined"], out["eager"])
    assert (out["batch16_joined"] == out["batch16_bnb"]).all(), out["batch16_joined"]
    # the adapters' B products inside the gemv's launch: taken, and the same tokens
    assert out["lora_calls"] > 0, out["lora_calls"]
    assert (out["lora"] == out["eager"]).all(), (out["lora"], out["eager"])
    assert (out["lora_eager"] == out["eager"]).all(), (out["lora_eager"], out["eager"])
    assert (out["batch4_lora"] == out["batch4_bnb"]).all(), out["batch4_lora"]


def _read_back(module, args, out):
    """A hook that reads a value back to the host on a prompt's forward (one-token steps, which
    the compiled step traces, skip it: the shape is known while tracing)."""
    if out.shape[1] > 1:
        float(out.float().abs().max())


def _reads_back(rank: int) -> dict:
    """A model whose forward reads a value back to the host (a hook on its last norm): the CUDA
    runtime refuses to record it; decoding goes on eagerly with the eager loop's tokens."""
    import warnings

    import quantmesh as qm
    from quantmesh.infer import prefill_graph
    from tests.models import llama

    prefill_graph.ENABLED = True  # (whatever the environment says)
    mesh = qm.init_mesh()
    model = llama(heads=4, kv_heads=2, head_dim=16, vocab=256, layers=2, seed=4)
    model.config.max_position_embeddings = 512
    model = model.to(device=mesh.device, dtype=torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    model.model.norm.register_forward_hook(_read_back)  # (the prefill's: the step compiles)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    ids = ids.to(mesh.device)
    eager = qm.greedy_decode(model, ids, 16, compile=False)[0].cpu()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first = qm.greedy_decode(model, ids, 16, compile=True)[0].cpu()
        again = qm.greedy_decode(model, ids, 16, compile=True)[0].cpu()
    graphs = model.__dict__["_quantmesh_decoder"].graphs
    return {"eager": eager, "first": first, "again": again, "refused": graphs.refused,
            "said": [str(w.message) for w in said if "CUDA graph" in str(w.message)]}  # fmt: skip


def test_a_prefill_the_runtime_will_not_record_decodes_eagerly():
    if not torch.cuda.is_available():
        pytest.fail("marked cuda but no CUDA device")
    out = run_ranks(_reads_back, 1, timeout=300)[0]
    assert out["refused"] is not None and "recording it failed" in out["refused"], out
    assert len(out["said"]) == 1, out["said"]
    assert (out["first"] == out["eager"]).all() and (out["again"] == out["eager"]).all(), out
