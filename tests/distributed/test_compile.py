"""qm.compile_blocks: compiled sharded blocks train and decode like the eager ones (tp=2, gloo).

fullgraph=True: a graph break anywhere in a block (the sharded layers, their collectives, the
quantized matmul, the adapters) fails the test instead of silently running part of it eagerly.
The backend is `make test`'s $QUANTMESH_COMPILE_BACKEND (aot_eager: dynamo and AOT autograd, what
our code meets); inductor's generated code runs in tests/unit/test_tiles_compiled.py (gradients)
and tests/unit/test_memory.py (what the compiled nf4 blocks save).

Compiling dominates the cost, then spawning: every case runs in one spawn of 2 ranks (`_spawn`,
cached for the module), each case after `_fresh()` (no compiled graph, counter or patched
all-reduce of an earlier case is left).
"""

from __future__ import annotations

import functools

import pytest
import torch

from quantmesh.testing import run_ranks

pytestmark = pytest.mark.slow  # make test-fast leaves this module out


def _llama(layers: int = 2, dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=128,
        attention_dropout=dropout,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _train(
    rank: int,
    quant: str | None,
    compiled: bool,
    ckpt: bool = False,
    dropout: float = 0.0,
    lora_dropout: float | None = None,
    tile: int | None = None,
) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = _llama(dropout=dropout)
    lora_dropout = dropout if lora_dropout is None else lora_dropout
    qm.parallelize(model, mesh, quant=quant, lora=qm.LoraConfig(r=4, alpha=8, dropout=lora_dropout))
    with torch.no_grad():  # nonzero B, so that every adapter's A gets a gradient too
        for i, p in enumerate(p for n, p in model.named_parameters() if "lora_B" in n):
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    if ckpt:
        assert qm.checkpoint_blocks(model, tile_tokens=tile) == 2
    if compiled:  # with dropout the tp RNG regions break the graph (compile_blocks warns)
        assert qm.compile_blocks(model, fullgraph=not dropout) == 2
    opt = torch.optim.SGD(qm.trainable_parameters(model), lr=0.5, momentum=0.9)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ids = ids.to(mesh.device)  # NCCL ranks (test_cuda.py) run this too
    losses, grads = [], []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    from torch._dynamo.utils import counters

    tiled = model.model.layers[0].__dict__.get("_quantmesh_tiled")
    return {"losses": losses, "grads": grads, "breaks": dict(counters["graph_break"]),
            "tiled": tiled}  # fmt: skip


def _both(rank: int, quant: str | None) -> tuple[dict, dict]:
    return _train(rank, quant, False), _train(rank, quant, True)


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_compiled_blocks_train_like_eager(quant):
    for eager, comp in _results("train", quant):
        assert comp["breaks"] == {}
        assert len(eager["losses"]) == len(eager["grads"]) > 0, "no step recorded"
        for a, b in zip(comp["losses"], eager["losses"], strict=True):
            assert abs(a - b) / abs(b) < 1e-5, (comp["losses"], eager["losses"])
        for ge, gc in zip(eager["grads"], comp["grads"], strict=True):
            assert ge.keys() == gc.keys() and len(ge) == 2 * 7 * 2  # layers x adapters x (A, B)
            for k in ge:
                err = (gc[k] - ge[k]).norm() / ge[k].norm().clamp_min(1e-12)
                assert err < 1e-4, (quant, k, float(err))


def _ckpt_both(rank: int) -> tuple[dict, dict, dict, dict]:
    """nf4 blocks with LoRA and attention dropout at tp=2: eager and plain, then checkpointed and
    compile_blocks'd (which then runs them eagerly: warned)."""
    import warnings

    import torch._dynamo

    plain = _train(rank, "nf4", False, dropout=0.1)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt = _train(rank, "nf4", True, ckpt=True, dropout=0.1)
    ckpt["warned"] = any("runs eagerly, not compiled" in str(w.message) for w in seen)
    # attention dropout only: the MLP draws nothing and is tiled (2 tiles of 16), its tp RNG
    # regions still enter and leave: the tiles must run eagerly too
    torch._dynamo.reset()
    plain_t = _train(rank, "nf4", False, dropout=0.1, lora_dropout=0.0)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiled = _train(rank, "nf4", True, ckpt=True, dropout=0.1, lora_dropout=0.0, tile=16)
    return plain, ckpt, plain_t, tiled


def test_checkpointed_blocks_with_tp_dropout_run_eagerly_and_train_like_plain_ones():
    """compile_blocks + checkpoint_blocks with dropout at tp=2: the RNG regions break the compiled
    graph, and the recompute could run another piece of it than the forward (torch raised
    CheckpointError), so such blocks run eagerly, warned, and train exactly like plain ones."""
    for plain, ckpt, plain_t, tiled in _results("ckpt"):
        assert ckpt["warned"] and tiled["tiled"] == ["mlp"]
        for ref, got in ((plain, ckpt), (plain_t, tiled)):
            assert len(ref["losses"]) == len(ref["grads"]) > 0, "no step recorded"
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
            for gp, gc in zip(ref["grads"], got["grads"], strict=True):
                assert gp.keys() == gc.keys() and len(gp) == 2 * 7 * 2
                for k in gp:
                    err = (gc[k] - gp[k]).norm() / gp[k].norm().clamp_min(1e-12)
                    assert err < 1e-5, (k, float(err))


def _all_reduce_counter(rank: int) -> tuple[object, dict, list]:
    """A backend that lists the all-reduces of every compiled forward / backward graph (as the
    reduced shapes), and a list that records the eager dist.all_reduce calls outside them."""
    import torch.distributed as dist
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list[list[tuple]]] = {"fw": [], "bw": []}

    def counter(kind):
        def compiler(gm, example_inputs):
            ar = torch.ops._c10d_functional.all_reduce.default
            nodes = [n for n in gm.graph.nodes if n.target is ar]
            graphs[kind].append(sorted(tuple(n.meta["val"].shape) for n in nodes))
            return gm

        return compiler

    eager: list[tuple] = []
    orig = dist.all_reduce

    def counting(t, *args, **kwargs):
        eager.append(tuple(t.shape))
        return orig(t, *args, **kwargs)

    dist.all_reduce = counting  # the rank process ends after the test
    backend = aot_autograd(fw_compiler=counter("fw"), bw_compiler=counter("bw"))
    return backend, graphs, eager


def _collectives(rank: int, compiled: bool) -> dict:
    """One training step of the tiny Llama: its all-reduces forward and backward, as shapes."""
    from torch._dynamo.utils import counters

    import quantmesh as qm
    from quantmesh.tp.layers import sharded_modules

    backend, graphs, eager = _all_reduce_counter(rank)
    mesh = qm.init_mesh(tp=2)
    model = _llama()
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4, alpha=8))
    if compiled:
        qm.compile_blocks(model, fullgraph=True, backend=backend)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    steps = []
    for _ in range(2):  # the second step runs the compiled graphs again: no new ones
        eager.clear()
        loss = model(input_ids=ids, labels=ids).loss
        fw = list(eager)
        eager.clear()
        loss.backward()
        steps.append({"fw": fw, "bw": list(eager)})
    shares = {
        n: id(m.copy_share) if m.copy_share is not None else None
        for n, m in sharded_modules(model).items()
    }
    return {
        "steps": steps,
        "graphs": graphs,
        "shares": shares,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
    }


def _collectives_both(rank: int) -> tuple[dict, dict]:
    return _collectives(rank, False), _collectives(rank, True)


def test_compiled_backward_all_reduces_like_eager():
    """q, k, v (gate, up) share one copy of their input under compile too: one backward all-reduce
    per block input, as eagerly, not one per colwise layer."""
    big, small, fw = (2, 32, 128), (2, 32, 4), (2, 32, 128 + 4)  # block input, LoRA A out, o/down
    for eager, comp in _results("collectives"):
        assert comp["breaks"] == {} and comp["unique_graphs"] == 2
        # the same step, eager or compiled: every all-reduce inside a block is in its graphs
        g = comp["graphs"]
        assert len(g["fw"]) == 2 and len(g["bw"]) == 2  # layer 0's input needs no grad: 2 graphs
        assert eager["steps"], "no step recorded"
        for e_step, c_step in zip(eager["steps"], comp["steps"], strict=True):
            assert sorted(e_step["fw"]) == sorted(c_step["fw"] + g["fw"][0] + g["fw"][1])
            assert sorted(e_step["bw"]) == sorted(c_step["bw"] + g["bw"][0] + g["bw"][1])
        assert g["fw"] == [[fw, fw]] * 2  # o_proj and down_proj, each with its adapter's A sums
        # backward (layer 1's graph first): the attention and MLP inputs, then layer 0's MLP input
        # only; plus the A outputs of the colwise adapters (q, k, v, gate, up), r wide
        assert g["bw"] == [[small] * 5 + [big] * 2, [small] * 5 + [big]]
        assert comp["steps"][0]["bw"] == [big]  # outside the blocks: lm_head's input
        # one share for q, k, v and one for gate, up, per layer; none elsewhere
        s = comp["shares"]
        for i in range(2):
            p = f"model.layers.{i}."
            attn = {s[p + f"self_attn.{x}_proj"] for x in "qkv"}
            mlp = {s[p + f"mlp.{x}_proj"] for x in ("gate", "up")}
            assert len(attn) == len(mlp) == 1 and None not in attn | mlp and attn != mlp
        sharing = {n for n, v in s.items() if v is not None}
        assert len(sharing) == 2 * 5 and not any(
            n.endswith(("o_proj", "down_proj")) for n in sharing
        )


class _Block(torch.nn.Module):
    """q and k read x, v reads another tensor of the same width, r (replicated) reads x too."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(h, 2 * h) for _ in range(3))
        self.r, self.o = torch.nn.Linear(h, h), torch.nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.q(x) * self.k(x) + self.v(x * 2)  # this rank's features of each
        return x + self.o(a) + self.r(x)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _mixed_readers(rank: int, compiled: bool) -> dict:
    import quantmesh as qm

    backend, graphs, _ = _all_reduce_counter(rank)
    mesh = qm.init_mesh(tp=2)
    model = _Net()
    plan = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise"}
    plan["blocks.*.o"] = "rowwise"
    lora = qm.LoraConfig(r=2, alpha=4, targets=["q", "k", "v", "o", "r"])
    qm.parallelize(model, mesh, plan=plan, lora=lora)
    with torch.no_grad():
        for i, p in enumerate(p for n, p in model.named_parameters() if "lora_B" in n):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    if compiled:
        qm.compile_blocks(model, fullgraph=True, backend=backend)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["x"] = x.grad
    return {"grads": grads, "graphs": graphs, "r": model.blocks[0].r.copy_share}


def _mixed_both(rank: int) -> tuple[dict, dict]:
    return _mixed_readers(rank, False), _mixed_readers(rank, True)


def test_compiled_share_only_merges_colwise_readers_of_one_tensor():
    """Only colwise layers given the very same tensor share its copy: v (another tensor) keeps its
    own all-reduce, and r (replicated, whole gradient on every rank) none."""
    for eager, comp in _results("mixed"):
        assert comp["r"] is None
        ge, gc = eager["grads"], comp["grads"]
        assert ge.keys() == gc.keys() and len(ge) == 2 * 5 * 2 + 1  # blocks x adapters x (A, B), x
        for k in ge:
            err = (gc[k] - ge[k]).norm() / ge[k].norm().clamp_min(1e-12)
            assert err < 1e-5, (k, float(err))
        # per block: x (q and k) and 2x (v), and the A outputs of the colwise adapters q, k, v
        assert comp["graphs"]["bw"] == [[(3, 2)] * 3 + [(3, 16)] * 2]


def _decode(rank: int) -> dict:
    from transformers.generation.configuration_utils import CompileConfig

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = qm.parallelize(_llama(), mesh).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    eager = model.generate(ids, **kw)
    from quantmesh.config import compile_options

    cc = CompileConfig(fullgraph=True, mode="default", backend=compile_options()["backend"])
    cc._compile_all_devices = True  # transformers compiles on accelerators only by default
    static = model.generate(ids, cache_implementation="static", compile_config=cc, **kw)
    return {
        "same": bool((eager == static).all()),
        "compiled": getattr(model, "_compiled_call", None) is not None,
    }


def test_compiled_static_cache_decoding_matches_eager():
    for r in _results("decode"):
        assert r == {"same": True, "compiled": True}


def test_compile_blocks_needs_blocks():
    import quantmesh as qm

    with pytest.raises(ValueError, match="no repeated blocks"):
        qm.compile_blocks(torch.nn.Linear(2, 2))


def _decoding_model(tp: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The small Llama in eval mode, sharded at tp > 1, and a (2, 8) prompt. tp=1 runs on the
    same 2 ranks as dp=2: an unsharded model, as on one process."""
    import quantmesh as qm

    mesh = qm.init_mesh(tp=tp)
    model = _llama()
    if tp > 1:
        qm.parallelize(model, mesh)
    model.eval()
    return model, torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))


def _greedy(rank: int, tp: int) -> dict:
    import quantmesh as qm

    model, ids = _decoding_model(tp)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[:, 8:]
    got = [qm.greedy_decode(model, ids, 20, compile=c, mode=None) for c in (False, True, True)]
    # another prompt length, the same cache length: the compiled step is reused
    shorter = qm.greedy_decode(model, ids[:, 2:], 20, mode=None)
    ref_shorter = model.generate(
        ids[:, 2:], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, 6:]
    got.append(shorter if bool((shorter == ref_shorter).all()) else None)
    eos = int(ref[0, 5])  # a token that row 0 emits: it stops there, the rest become EOS
    with_eos = qm.greedy_decode(model, ids, 20, eos_token_id=eos, compile=False, check_every=4)
    two = [eos, int(ref[1, 3])]  # several EOS ids: any of them ends a row
    with_two = qm.greedy_decode(model, ids, 20, eos_token_id=two, compile=False, check_every=4)
    from torch._dynamo.utils import counters

    return {
        "same": [bool((g == ref).all()) for g in got[:3]] + [got[3] is not None],
        "eos_rows": [(r == eos).nonzero()[0, 0].item() if (r == eos).any() else None for r in ref],
        "with_eos": with_eos,
        "with_two": with_two,
        "two": two,
        "ref": ref,
        "frames": dict(counters["stats"]),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_decode_matches_generate(tp):
    for r in _results("greedy", tp):
        # eager loop, compiled, compiled again (reused), a shorter prompt (reused)
        assert r["same"] == [True, True, True, True]
        assert r["frames"]["unique_graphs"] == 1  # later calls reused the compiled step
        ref, got = r["ref"], r["with_eos"]
        for row in range(2):
            first = r["eos_rows"][row]
            if first is None:  # never emits EOS: runs to the end unchanged
                assert got.shape[1] == 20 and (got[row] == ref[row]).all()
            else:  # equal up to its first EOS, EOS after it
                assert (got[row, : first + 1] == ref[row, : first + 1]).all()
                assert (got[row, first:] == got[row, first]).all()
        got, two = r["with_two"], r["two"]
        assert got.shape[1] < 20  # both rows ended, so the loop stopped early
        for row in range(2):
            first = next(j for j, t in enumerate(ref[row].tolist()) if t in two)
            assert (got[row, : first + 1] == ref[row, : first + 1]).all()
            assert (got[row, first:] == ref[row, first]).all()  # filled with the EOS it met


def _sampled(rank: int, tp: int) -> dict:
    """fast_decode with temperature and top-p: eager and (at tp=2) compiled steps, per-row
    settings; tp=1 gives the reference draw only (each compile costs the suite seconds)."""
    import quantmesh as qm

    model, ids = _decoding_model(tp)
    kw = {"temperature": 0.9, "top_p": 0.9, "seed": 3}
    eager = qm.fast_decode(model, ids, 20, compile=False, **kw)
    compiled = [qm.fast_decode(model, ids, 20, mode=None, **kw) for _ in range(2 if tp > 1 else 0)]
    other_seed = qm.fast_decode(model, ids, 20, compile=False, temperature=0.9, top_p=0.9, seed=4)
    mixed = qm.fast_decode(model, ids, 20, compile=False, temperature=[0.0, 0.9], seed=3)
    greedy = qm.greedy_decode(model, ids, 20, compile=False)
    from torch._dynamo.utils import counters

    return {
        "eager": eager,
        "compiled": compiled,
        "other_seed": other_seed,
        "mixed": mixed,
        "greedy": greedy,
        "frames": dict(counters["stats"]),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_sampled_fast_decode_is_seeded_and_compiles_like_eager(tp):
    r0, r1 = _results("sampled", tp)
    assert torch.equal(r0["eager"], r1["eager"])  # ranks draw alike without a collective
    if tp == 2:
        assert len(r0["compiled"]) == 2
        assert all(torch.equal(c, r0["eager"]) for c in r0["compiled"])  # same noise, same tokens
        assert r0["frames"]["unique_graphs"] == 1  # the second call reused the compiled step
    assert not torch.equal(r0["other_seed"], r0["eager"])
    assert not torch.equal(r0["eager"], r0["greedy"])  # it does sample
    assert torch.equal(r0["mixed"][0], r0["greedy"][0])  # a temperature-0 row is greedy
    if tp == 2:  # the sharded model samples what the whole one samples from the same seed
        assert torch.equal(r0["eager"], _results("sampled", 1)[0]["eager"])


def _padded(rank: int) -> dict:
    """Rows of different lengths, left-padded with their attention mask, at tp=2: each row as it
    decodes alone (eager and compiled)."""
    import quantmesh as qm

    model, ids = _decoding_model(2)
    short = ids[1, 3:]  # 5 tokens
    batch = torch.stack([ids[0], torch.cat([torch.zeros(3, dtype=ids.dtype), short])])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    alone = [
        qm.fast_decode(model, ids[0:1], 12, compile=False),
        qm.fast_decode(model, short[None], 12, compile=False),
    ]
    eager = qm.fast_decode(model, batch, 12, attention_mask=mask, compile=False)
    compiled = qm.fast_decode(model, batch, 12, attention_mask=mask, mode=None)
    unmasked = qm.fast_decode(model, batch, 12, compile=False)  # the pads read as prompt tokens
    return {"alone": torch.cat(alone), "eager": eager, "compiled": compiled, "unmasked": unmasked}


def test_left_padded_rows_decode_as_they_would_alone():
    for r in _results("padded"):
        assert torch.equal(r["eager"], r["alone"])
        assert torch.equal(r["compiled"], r["alone"])
        assert torch.equal(r["unmasked"][0], r["alone"][0])
        assert not torch.equal(r["unmasked"][1], r["alone"][1])  # the mask is what made it right


def _repeat(rank: int) -> dict:
    """fast_decode with a repetition penalty at tp=2: transformers' `generate` with the same
    penalty (greedy), eager and compiled; left-padded rows as each alone; a sampled draw compiled
    like eager."""
    import quantmesh as qm

    model, ids = _decoding_model(2)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.5,
                         eos_token_id=None, pad_token_id=0)[:, 8:]  # fmt: skip
    plain = qm.greedy_decode(model, ids, 20, compile=False)
    eager = qm.fast_decode(model, ids, 20, repetition_penalty=1.5, compile=False)
    compiled = qm.fast_decode(model, ids, 20, repetition_penalty=1.5, mode=None)
    short = ids[1, 3:]
    kw = {"repetition_penalty": [1.5, 2.0], "compile": False}
    alone = torch.cat([
        qm.fast_decode(model, ids[0:1], 12, repetition_penalty=1.5, compile=False),
        qm.fast_decode(model, short[None], 12, repetition_penalty=2.0, compile=False),
    ])  # fmt: skip
    pad = torch.full((3,), int(alone[1, 0]), dtype=ids.dtype)  # penalized, it would change row 1
    batch = torch.stack([ids[0], torch.cat([pad, short])])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    padded = qm.fast_decode(model, batch, 12, attention_mask=mask, **kw)
    padded_compiled = qm.fast_decode(model, batch, 12, attention_mask=mask, mode=None,
                                     repetition_penalty=[1.5, 2.0])  # fmt: skip
    sampled = {"temperature": 0.9, "top_p": 0.9, "seed": 3, "repetition_penalty": 1.3}
    drawn = [qm.fast_decode(model, ids, 20, compile=c, mode=None, **sampled) for c in (False, True)]
    return {"ref": ref, "plain": plain, "eager": eager, "compiled": compiled, "alone": alone,
            "padded": padded, "padded_compiled": padded_compiled, "drawn": drawn}  # fmt: skip


def test_repetition_penalty_decodes_like_generate():
    """`quantmesh generate --fast` refused `--repetition-penalty` (the demo's setting): the fast
    loop had none."""
    for r in _results("repeat"):
        assert not torch.equal(r["ref"], r["plain"])  # the penalty changes these replies
        assert torch.equal(r["eager"], r["ref"])
        assert torch.equal(r["compiled"], r["ref"])
        assert torch.equal(r["padded"], r["alone"])  # pads are not penalized: each row alone
        assert torch.equal(r["padded_compiled"], r["alone"])
        assert torch.equal(r["drawn"][1], r["drawn"][0])


def _stacked(rank: int) -> dict:
    """nf4 + LoRA (non-zero B) at tp=2: the decode step with sibling adapters stacked against
    each adapter on its own, eager and compiled; which stacks formed; that every member took its
    stacked slice (eager hits); and that the compiled step reads the stacks (stale ones change
    its tokens)."""
    import quantmesh as qm
    from quantmesh.infer.decode import AdapterStack

    mesh = qm.init_mesh(tp=2)
    from tests.models import nonzero_lora_b_

    model = qm.parallelize(_llama(), mesh, quant="nf4", lora=qm.LoraConfig(r=4, alpha=8))
    nonzero_lora_b_(model, std=0.5).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {"plain": qm.greedy_decode(model, ids, 20, compile=False, fuse_adapters=False)}
    hits = []
    delta = AdapterStack.delta

    def counted(self, i, x, cast):
        d = delta(self, i, x, cast)
        hits.append(d is not None)
        return d

    AdapterStack.delta = counted  # type: ignore[method-assign]
    try:
        out["fused"] = qm.greedy_decode(model, ids, 20, compile=False)
    finally:
        AdapterStack.delta = delta  # type: ignore[method-assign]
    out["hits"] = hits
    dec = model.__dict__["_quantmesh_decoder"]
    out["stacks"] = [[m.fqn.split(".", 3)[-1] for m in st.members] for st in dec.stacks]
    out["compiled"] = qm.greedy_decode(model, ids, 20, mode=None)
    from quantmesh.infer import decode

    refresh = decode.refresh_stacks

    def stale(stacks):
        refresh(stacks)
        for st in stacks:
            st.b.zero_()  # the stacks no longer hold the adapters' B

    decode.refresh_stacks = stale
    try:
        out["stale"] = qm.greedy_decode(model, ids, 20, mode=None)
    finally:
        decode.refresh_stacks = refresh
    out["unfused_compiled"] = qm.greedy_decode(model, ids, 20, mode=None, fuse_adapters=False)
    # one row: the compiled step's adapters (stacked, and the lone rowwise ones, whose partial
    # products are all-reduced) as fused products and sums (lean_linear: tests/unit/test_adapter.py
    # checks that a compiled row takes them), against the eager loop
    from quantmesh.lora import adapter

    out["row_lean"] = adapter.LEAN_ROWS
    out["row_plain"] = qm.greedy_decode(model, ids[:1], 20, compile=False, fuse_adapters=False)
    out["row_compiled"] = qm.greedy_decode(model, ids[:1], 20, mode=None)
    out["row_unfused"] = qm.greedy_decode(model, ids[:1], 20, mode=None, fuse_adapters=False)
    return out


def test_stacked_sibling_adapters_decode_like_separate_ones():
    for r in _results("stacked"):
        per_block = [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
        ]
        assert r["stacks"] == per_block * 2  # rowwise o_proj / down_proj stay on their own
        assert len(r["hits"]) == 19 * 2 * 5 and all(r["hits"])  # steps x layers x members
        for k in ("fused", "compiled", "unfused_compiled"):
            assert torch.equal(r[k], r["plain"]), k
        assert not torch.equal(r["stale"], r["plain"])  # the compiled step does read the stacks
        assert r["row_lean"]  # one row: the compiled steps take the fused adapter products
        for k in ("row_compiled", "row_unfused"):
            assert torch.equal(r[k], r["row_plain"]), k


def _joined(rank: int) -> dict:
    """nf4 + LoRA at tp=2: the model's outputs, LoRA gradients, full state and decoded tokens
    before and after fast_decode joined its sibling layers' codes (kernel4.JOIN_ENABLED): the
    join changes where the codes live (views of one tensor per run), nothing else."""
    import quantmesh as qm
    from quantmesh.quant import kernel4 as k4
    from tests.models import nonzero_lora_b_

    k4.JOIN_ENABLED = False  # joined below only (on these CPU ranks as on a GPU: the seam)
    k4.joins_pay_on = lambda device: k4.JOIN_ENABLED
    mesh = qm.init_mesh(tp=2)
    model = qm.parallelize(_llama(), mesh, quant="nf4", lora=qm.LoraConfig(r=4, alpha=8))
    nonzero_lora_b_(model, std=0.5)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))

    def facts() -> dict:
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.eval()
        return {"logits": out.logits.detach(), "grads": grads, "state": qm.full_state_dict(model),
                "tokens": qm.greedy_decode(model, ids, 12, compile=False)}  # fmt: skip

    before = facts()
    saved = k4.JOIN_ENABLED
    try:
        k4.JOIN_ENABLED = True
        joined_tokens = qm.greedy_decode(model, ids, 12, compile=False)  # the prefill joins
        locals_ = [m.__dict__.get("local", m) for m in model.modules()]
        runs = {id(r): r for m in locals_ if (r := getattr(m, "codes_run", None)) is not None}
        views = all(
            m.weight.data.untyped_storage().data_ptr() == m.codes_run.codes.untyped_storage().data_ptr()
            for m in locals_ if getattr(m, "codes_run", None) is not None
        )  # fmt: skip
        after = facts()
    finally:
        k4.JOIN_ENABLED = saved
    same = {k: torch.equal(before[k], after[k]) for k in ("logits", "tokens")}
    same["grads"] = before["grads"].keys() == after["grads"].keys() and all(
        torch.equal(before["grads"][n], after["grads"][n]) for n in before["grads"]
    )
    if rank == 0:  # (full_state_dict gathers to rank 0)
        same["state"] = before["state"].keys() == after["state"].keys() and all(
            torch.equal(before["state"][k], after["state"][k]) for k in before["state"]
        )
    members = sorted(len(r.outs) for r in runs.values())
    return {"same": same, "runs": members, "views": views,
            "joined_tokens": torch.equal(joined_tokens, before["tokens"])}  # fmt: skip


def test_joined_sibling_codes_change_nothing_but_where_the_codes_live():
    for r in _results("joined"):
        # gate/up of each of 2 blocks; the q/k/v shards (128 and 64 blocks of 64) do not hold
        # whole nested blocks of 256, so they stay apart (their statistics could not be joined)
        assert r["runs"] == [2, 2], r
        assert r["views"] and r["joined_tokens"], r
        assert all(r["same"].values()), r["same"]


def _dropout_warning(rank: int) -> list[str]:
    import warnings

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = qm.parallelize(_llama(), mesh, lora=qm.LoraConfig(r=4, dropout=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm.compile_blocks(model)
    return [str(w.message) for w in caught]


def test_compile_blocks_warns_when_dropout_breaks_the_graphs():
    for messages in _results("dropout"):
        assert any("dropout is active" in m for m in messages), messages


# --------------------------------------------------------------------------- the one spawn
CASES = {  # name -> (rank function, its arguments after rank)
    ("train", None): (_both, (None,)),
    ("train", "nf4"): (_both, ("nf4",)),
    ("ckpt",): (_ckpt_both, ()),
    ("collectives",): (_collectives_both, ()),
    ("mixed",): (_mixed_both, ()),
    ("decode",): (_decode, ()),
    ("greedy", 1): (_greedy, (1,)),
    ("greedy", 2): (_greedy, (2,)),
    ("sampled", 1): (_sampled, (1,)),
    ("sampled", 2): (_sampled, (2,)),
    ("padded",): (_padded, ()),
    ("repeat",): (_repeat, ()),
    ("stacked",): (_stacked, ()),
    ("joined",): (_joined, ()),
    ("dropout",): (_dropout_warning, ()),
}


def _fresh(all_reduce) -> None:
    """Forget what an earlier case left in this process: compiled graphs, dynamo's counters (the
    tests read graph breaks and graph counts) and a counting all-reduce (_all_reduce_counter)."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dist.all_reduce = all_reduce


def _every_case(rank: int) -> dict:
    import torch.distributed as dist

    original = dist.all_reduce
    out = {}
    for key, (fn, args) in CASES.items():
        _fresh(original)
        out[key] = fn(rank, *args)
    _fresh(original)
    return out


@functools.cache
def _spawn() -> list[dict]:
    return run_ranks(_every_case, 2, timeout=1200)


def _results(*key) -> list:
    """The per-rank results of one case of the shared spawn."""
    return [r[key] for r in _spawn()]
