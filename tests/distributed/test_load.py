"""load_checkpoint on 2 gloo ranks (tp=2): slices land where they belong, errors are complete and
raised on every rank, tied weights load from either name, and host memory stays near one slice.

One spawn gathers every fact (spawning costs seconds); the tests below assert on them. A second
spawn measures memory on a 512 MiB checkpoint. References are plain transformers / plain torch
models built from the same files; tolerances are stated where they are used.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from quantmesh.testing import run_ranks

from ._io_cases import PeakRss, gpt2_dir, hf_logits, llama_dir, logits, rss_anon, token_ids

# fp32 logits of a tp-sharded model differ from the unsharded ones only by summation order
# (row-parallel partial sums, then an all-reduce), a few ulps per layer; relative to the largest
# logit (|logit| <= ~5 here, ulp 4.8e-7) we allow 2e-6, i.e. ~20 ulps. Observed: <= 3.6e-6
# absolute. A slice landing in the wrong place shows as errors of order 1.
REL_TOL = 2e-6


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= REL_TOL * want.abs().max())


MiB = 1 << 20


class Block(nn.Module):
    def __init__(self, d: int = 16, h: int = 48):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """A plain-torch LM: vocab 64, width 16, two blocks, head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# --------------------------------------------------------------------------- rank-side code
def _skeleton(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _facts(rank: int, llama: str, gpt2: str) -> dict:
    from safetensors.torch import load_file

    import quantmesh as qm
    from quantmesh.io.load import LoadError
    from quantmesh.tp.gather import tp_sharded
    from quantmesh.tp.layers import sharded_modules

    mesh = qm.init_mesh(tp=2)
    f: dict = {}
    ids = token_ids()
    file = load_file(f"{llama}/model.safetensors")

    # 1. from meta: logits, exact tensors, bytes read
    m = qm.parallelize(_skeleton(llama), mesh)
    res = qm.load_checkpoint(m, llama, progress=rank == 0)
    f["meta_logits"] = logits(m.eval(), ids)
    full = qm.full_state_dict(m)
    f["meta_exact"] = rank != 0 or all(torch.equal(full[k], file[k]) for k in file)
    f["bytes_read"] = res.bytes_read
    f["split_keys"] = sorted(
        f"{n}.{p}" for n, mod in sharded_modules(m).items() for p in tp_sharded(mod)
    )
    from quantmesh.parallel.state import parallel_state

    f["uninit_left"] = sorted(parallel_state(m).uninitialized)

    # 2. a model with real CPU weights (parallelize slices them), overwritten by the checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    cpu = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama))
    qm.parallelize(cpu, mesh)
    qm.load_checkpoint(cpu, llama, progress=False)
    f["cpu_logits"] = logits(cpu.eval(), ids)

    # 3. dtype: a bf16 model from the fp32 file (cast in the read)
    bf = qm.parallelize(_skeleton(llama), mesh, dtype=torch.bfloat16)
    qm.load_checkpoint(bf, llama, progress=False)
    full = qm.full_state_dict(bf)
    f["bf16_exact"] = rank != 0 or all(
        full[k].dtype == torch.bfloat16 and torch.equal(full[k], file[k].bfloat16()) for k in file
    )

    # 4. strict: one error naming missing, unexpected and mis-shaped keys; nothing read before it
    bad = dict(file)
    del bad["model.norm.weight"]
    bad["extra.weight"] = torch.zeros(3)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(70, 72)
    bad["model.embed_tokens.weight"] = file["model.embed_tokens.weight"] + 1
    before = qm.full_state_dict(m).get("model.embed_tokens.weight")
    f["strict_error"] = _error(lambda: qm.load_checkpoint(m, bad, progress=False))
    after = qm.full_state_dict(m).get("model.embed_tokens.weight")  # collective: every rank
    f["untouched"] = rank != 0 or torch.equal(after, before)
    f["error_type_ok"] = isinstance(
        _catch(lambda: qm.load_checkpoint(m, bad, progress=False)), LoadError
    )

    # 5. strict=False: missing / unexpected reported, the left-over tensor named in a warning
    part = {k: v for k, v in file.items() if k != "model.norm.weight"}
    part["extra.weight"] = torch.zeros(3)
    fresh = qm.parallelize(_skeleton(llama), mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = qm.load_checkpoint(fresh, part, strict=False, progress=False)
    f["lenient"] = (r.missing_keys, r.unexpected_keys)
    f["lenient_warn"] = [str(w.message) for w in caught if "hold no values" in str(w.message)]
    f["strict_left_error"] = _error(
        lambda: qm.load_checkpoint(qm.parallelize(_skeleton(llama), mesh), part, progress=False)
    )

    # 6. tied: a checkpoint holding only lm_head.weight; and a quantized head that untied them
    only_head = {k: v for k, v in file.items() if k != "model.embed_tokens.weight"}
    only_head["lm_head.weight"] = file["model.embed_tokens.weight"]
    t = qm.parallelize(_skeleton(llama), mesh)
    qm.load_checkpoint(t, only_head, progress=False)
    f["head_only_logits"] = logits(t.eval(), ids)
    q = qm.parallelize(_skeleton(llama), mesh, quant=qm.QuantConfig(format="int8", skip=[]))
    f["untied_error"] = _error(lambda: qm.load_checkpoint(q, llama, progress=False))
    f["untied_head_loaded"] = bool(q.lm_head.loaded)
    f["untied_head"] = qm.full_state_dict(q).get("lm_head.weight")  # collective: every rank

    # 7. LoRA round trip through full_state_dict; LoRA is never "missing" from a base checkpoint
    lcfg = qm.LoraConfig(r=4, targets=["q_proj", "o_proj"])
    a = qm.parallelize(_skeleton(llama), mesh, lora=lcfg)
    qm.load_checkpoint(a, llama, progress=False)
    with torch.no_grad():
        for n, p in a.named_parameters():
            if "lora_" in n:
                p.uniform_(-1, 1)
    sd = qm.full_state_dict(a, rank0_only=False)
    b = qm.parallelize(_skeleton(llama), mesh, lora=lcfg)
    qm.load_checkpoint(b, sd, progress=False)
    f["lora_roundtrip"] = all(
        torch.equal(x, y)
        for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True)
        if "lora_" in n
    )

    # 8. a plain torch model (no transformers), auto-planned, tied head, from meta
    torch.manual_seed(3)
    ref = Net()
    for p in ref.parameters():
        nn.init.normal_(p, std=0.5)
    with qm.empty_model():
        net = Net()
    qm.parallelize(net, mesh)
    qm.load_checkpoint(net, ref.state_dict(), progress=False)
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(x)
        f["net_err"] = ((net(x) - want).abs().max() / want.abs().max()).item()
    f["net_sharded"] = sorted(n for n, mod in sharded_modules(net).items() if mod.split is not None)

    # 9. GPT-2 (Conv1D, fused q|k|v, rowwise biases) from meta
    g = qm.parallelize(_skeleton(gpt2), mesh)
    qm.load_checkpoint(g, gpt2, progress=False)
    f["gpt2_logits"] = logits(g.eval(), ids)

    # 10. a failure on one rank only: every rank raises, none waits
    src = llama if rank == 0 else f"{llama}/no-such-file.safetensors"
    f["one_rank_error"] = _error(
        lambda: qm.load_checkpoint(qm.parallelize(_skeleton(llama), mesh), src, progress=False)
    )
    return f


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


# --------------------------------------------------------------------------- memory (rank side)
class Wide(nn.Module):
    """Two 256 MiB fp32 matrices: up (16384, 4096) colwise, down (4096, 16384) rowwise."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4096, 16384, bias=False)
        self.down = nn.Linear(16384, 4096, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _memory(rank: int, path: str) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    # bitsandbytes' CPU quantizer needs scratch memory of its own (a few times its input); measured
    # here on one slice-shaped tensor so the bound below can name it separately
    import bitsandbytes.functional as F

    w = torch.randn(8192, 4096)
    base = rss_anon()
    with PeakRss() as peak:
        F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    out: dict = {"quantizer": peak.peak - base}
    del w
    for quant in (None, "nf4"):
        with qm.empty_model():
            model = Wide()
        base = rss_anon()  # the skeleton is on meta: nothing allocated yet
        with PeakRss() as peak:
            # verify=False: the probe (a random fp32 copy of this block-less model, made from its
            # first layer's input size) is not the loading this test measures
            qm.parallelize(
                model, mesh, plan={"up": "colwise", "down": "rowwise"}, quant=quant, verify=False
            )
            res = qm.load_checkpoint(model, path, progress=False)
        local = sum(t.nbytes for t in model.state_dict().values())  # what this rank keeps
        out[quant or "fp32"] = {
            "growth": peak.peak - base,
            "local": local,
            "bytes_read": res.bytes_read,
            "after": rss_anon() - base,
        }
        del model
    return out


# --------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    return {"llama": llama_dir(root / "llama"), "gpt2": gpt2_dir(root / "gpt2")}


@pytest.fixture(scope="module")
def facts(dirs):
    return run_ranks(_facts, 2, str(dirs["llama"]), str(dirs["gpt2"]), timeout=60)


def test_meta_skeleton_loads_exactly(facts, dirs):
    want = hf_logits(dirs["llama"], token_ids())
    for f in facts:
        assert f["meta_exact"], "full_state_dict after loading differs from the file"
        assert close(f["meta_logits"], want)
        assert close(f["cpu_logits"], want)
        assert f["bf16_exact"]
        assert f["uninit_left"] == []


def test_each_rank_reads_only_its_slices(facts, dirs):
    from safetensors import safe_open

    with safe_open(dirs["llama"] / "model.safetensors", "pt") as fh:
        sizes = {k: math.prod(fh.get_slice(k).get_shape()) * 4 for k in fh.keys()}
    split = set(facts[0]["split_keys"])
    assert "model.embed_tokens.weight" in split and "model.layers.0.mlp.up_proj.weight" in split
    # split tensors are read once in total (each rank its part), the rest once per rank; the
    # tied head is not in the file and is not read twice
    want = sum(n for k, n in sizes.items() if k in split) + 2 * sum(
        n for k, n in sizes.items() if k not in split
    )
    assert facts[0]["bytes_read"] + facts[1]["bytes_read"] == want


def test_strict_lists_everything_at_once_on_every_rank(facts):
    for f in facts:
        msg = f["strict_error"]
        assert msg.startswith("LoadError")
        assert "missing (1): model.norm.weight" in msg
        assert "unexpected (1): extra.weight" in msg
        assert "mis-shaped (1): model.layers.0.self_attn.q_proj.weight: checkpoint (70, 72)" in msg
        assert f["error_type_ok"] and f["untouched"]


def test_lenient_load_reports_and_warns(facts):
    f0 = facts[0]
    assert f0["lenient"] == (["model.norm.weight"], ["extra.weight"])
    assert len(f0["lenient_warn"]) == 1 and "model.norm.weight" in f0["lenient_warn"][0]
    assert facts[1]["lenient_warn"] == []  # warned once, by rank 0
    for f in facts:
        assert "missing (1): model.norm.weight" in f["strict_left_error"]


def test_tied_weights_load_from_either_name(facts, dirs):
    from safetensors.torch import load_file

    want = hf_logits(dirs["llama"], token_ids())
    for f in facts:
        assert close(f["head_only_logits"], want)
        assert f["untied_error"] == "no error" and f["untied_head_loaded"]
    # the int8 head was quantized from the embedding's values: error <= absmax/127/2 per row,
    # plus the fp16 rounding of the input (2^-11 relative)
    emb = load_file(dirs["llama"] / "model.safetensors")["model.embed_tokens.weight"]
    err = (facts[0]["untied_head"] - emb).abs().max(dim=1).values
    assert (err <= emb.abs().max(dim=1).values * (0.5 / 127 + 2**-10)).all()


def test_lora_and_plain_torch_and_gpt2(facts, dirs):
    want = hf_logits(dirs["gpt2"], token_ids())
    for f in facts:
        assert f["lora_roundtrip"]
        assert f["net_err"] <= REL_TOL
        assert f["net_sharded"] == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up",
                                    "emb", "head"]  # fmt: skip
        assert close(f["gpt2_logits"], want)


def test_a_failure_on_one_rank_raises_on_all(facts):
    assert facts[1]["one_rank_error"].startswith("FileNotFoundError")
    assert facts[0]["one_rank_error"].startswith(
        "RuntimeError: load_checkpoint failed on rank(s) [1]"
    )


@pytest.mark.slow  # writes and loads a 512 MiB checkpoint
def test_host_memory_stays_near_one_slice(tmp_path):
    from quantmesh.io.save import ShardWriter

    writer = ShardWriter(tmp_path, "model", 300 * MiB)  # two files + an index, one tensor each
    g = torch.Generator().manual_seed(0)
    writer.add("up.weight", torch.randn(16384, 4096, generator=g))
    writer.add("down.weight", torch.randn(4096, 16384, generator=g))
    writer.close()
    del writer
    out = run_ranks(_memory, 2, str(tmp_path), timeout=60)
    slice_bytes = 128 * MiB  # half of one 256 MiB matrix, fp32
    for r in out:
        scratch = {"fp32": 0, "nf4": r.pop("quantizer")}
        for fmt, m in r.items():
            print(
                f"{fmt}: peak growth {m['growth'] / MiB:.0f} MiB, kept {m['local'] / MiB:.0f} MiB, "
                f"read {m['bytes_read'] / MiB:.0f} MiB, quantizer scratch {scratch[fmt] / MiB:.0f} MiB"
            )
            assert m["bytes_read"] == 2 * slice_bytes
            # growth <= what the rank keeps + one fp32 slice in flight + the quantizer's own
            # scratch + 48 MiB of slack (allocator arenas, the sampler thread, statistics). A
            # loader holding a whole 256 MiB tensor, or the 512 MiB file, exceeds it.
            assert m["growth"] <= m["local"] + slice_bytes + scratch[fmt] + 48 * MiB, m
