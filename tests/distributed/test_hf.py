"""from_pretrained on 4 gloo ranks: transformers folders (Llama with uneven heads, GPT-2 with Conv1D,
an old-style GPT-2 checkpoint) at tp=4, dp=2 x tp=2 and tp=1 x dp=4, against plain transformers;
and the "done when" check: the same Llama folder in nf4 at tp=1, 2, 4.

The nf4 folder is shaped so that every tensor-parallel cut falls on a 64-element quantization
block (hidden 256, 8 heads of 32, 4 KV heads, intermediate 256): with double_quant off every rank
then quantizes exactly the blocks the tp=1 model quantizes, so the codes and scales are identical
and only summation order differs between layouts. See docs/loading-and-saving.md for the bound.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks

from ._io_cases import gpt2_dir, gpt2_legacy_dir, hf_logits, llama_dir, logits, token_ids

# summation-order differences of fp32 logits, relative to the largest logit: see test_load.py
REL_TOL = 2e-6
LAYOUTS = [(1, 4), (2, 2), (4, 1)]  # (dp, tp) on 4 ranks
slow = pytest.mark.slow  # the launch of 4 ranks (`facts`): left out by make test-fast


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _facts(rank: int, d: dict) -> dict:
    import quantmesh as qm

    f: dict = {"nf4": {}, "nf4_flat": {}, "fp32": {}}
    ids = token_ids()
    flat = qm.QuantConfig(format="nf4", double_quant=False)
    for dp, tp in LAYOUTS:
        mesh = qm.init_mesh(dp=dp, tp=tp)
        for name, quant in (("nf4", "nf4"), ("nf4_flat", flat), ("fp32", None)):
            m = qm.from_pretrained(d["aligned"], mesh, quant=quant, progress=False)
            f[name][tp] = logits(m, ids)
            if tp == 4 and quant is not None:
                f[f"{name}_weights"] = qm.full_state_dict(m)  # collective; rank 0 gets them
    mesh = qm.init_mesh(dp=2, tp=2)
    m = qm.from_pretrained(d["llama"], mesh, progress=False)
    f["llama"] = logits(m, ids)
    f["training"] = m.training
    f["max_new_tokens"] = m.generation_config.max_new_tokens
    f["buffers"] = {n: b.clone() for n, b in m.named_buffers()}
    f["gpt2"] = logits(qm.from_pretrained(d["gpt2"], mesh, progress=False), ids)
    f["legacy"] = logits(qm.from_pretrained(d["legacy"], mesh, progress=False), ids)
    f["dtypes"] = {}
    for name in HELD:  # in bf16, as transformers loads them
        m = qm.from_pretrained(d[name], mesh, dtype=torch.bfloat16, progress=False)
        f["dtypes"][name] = _dtypes(m)
    return f


HELD = ("deepseek_v3", "hunyuan_v1_moe", "afmoe")  # a router or a bias kept in float32


def _dtypes(model) -> dict[str, torch.dtype]:
    """Every parameter's and buffer's dtype, but for the shards of quantmesh's layers."""
    return {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    aligned = llama_dir(root / "aligned", hidden=256, heads=8, kv=4, head_dim=32, inter=256,
                        bias=False)  # fmt: skip
    gpt2 = gpt2_dir(root / "gpt2")
    from tests.zoo import ZOO

    held = {}
    for name in HELD:
        ZOO[name].build(0).save_pretrained(root / name)
        held[name] = str(root / name)
    return {"aligned": str(aligned), "llama": str(llama_dir(root / "llama")), "gpt2": str(gpt2),
            "legacy": str(gpt2_legacy_dir(gpt2, root / "legacy")), **held}  # fmt: skip


@pytest.fixture(scope="module")
def facts(dirs):
    return run_ranks(_facts, 4, dirs, timeout=240)


@slow
@pytest.mark.parametrize("name", HELD)
def test_weights_transformers_keeps_in_float32_stay_float32(facts, dirs, name):
    """In bf16, DeepSeek-V3's router weight, HunYuan-MoE's router linear (built in float32) and
    AFMoE's expert bias were cast to bf16 (transformers keeps them in float32: its
    `_keep_in_fp32_modules_strict`, and a parameter the model makes in a dtype of its own)."""
    from transformers import AutoModelForCausalLM

    want = _dtypes(AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.bfloat16))
    got = facts[0]["dtypes"][name]
    kept = {n for n, d in want.items() if d == torch.float32}
    assert kept, "nothing kept in float32: this would test nothing"
    assert {n: got.get(n) for n in kept} == {n: torch.float32 for n in kept}
    assert {n for n, d in got.items() if d == torch.float32} <= kept | {
        n
        for n in got
        if n not in want  # quantmesh's own tensors (none in float32 expected)
    }


@slow
def test_llama_and_gpt2_match_transformers_on_dp_x_tp(facts, dirs):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(dirs["llama"]).eval()
    for f in facts:
        assert _err(f["llama"], hf_logits(dirs["llama"], token_ids())) <= REL_TOL
        assert _err(f["gpt2"], hf_logits(dirs["gpt2"], token_ids())) <= REL_TOL
        assert _err(f["legacy"], hf_logits(dirs["gpt2"], token_ids())) <= REL_TOL
        assert f["training"] is False and f["max_new_tokens"] == 7
        # rotary tables are computed by __init__ on CPU (empty_model moves only parameters)
        want = dict(ref.named_buffers())
        assert f["buffers"].keys() == want.keys() and len(want) > 0
        for n, b in f["buffers"].items():
            assert torch.equal(b, want[n]), n


@slow
def test_fp32_is_layout_invariant(facts, dirs):
    want = hf_logits(dirs["aligned"], token_ids())
    for f in facts:
        for tp in (1, 2, 4):
            assert _err(f["fp32"][tp], want) <= REL_TOL, tp


@slow
def test_nf4_same_logits_at_tp_1_2_4(facts):
    for f in facts:
        # double_quant off, cuts on block boundaries: identical codes and scales at every tp, so
        # only summation order differs (the fp32 tolerance)
        for tp in (2, 4):
            assert _err(f["nf4_flat"][tp], f["nf4_flat"][1]) <= REL_TOL, tp
        # double_quant on (quant="nf4"): each rank quantizes its own absmax vector (8 bit,
        # blocks of 256, offset = that vector's mean), so scales differ slightly between layouts;
        # that second-level error must stay an order of magnitude below nf4's own error
        nf4_err = _err(f["nf4"][1], f["fp32"][1])
        for tp in (2, 4):
            assert _err(f["nf4"][tp], f["nf4"][1]) <= 0.1 * nf4_err, (tp, nf4_err)
        # nf4 is really quantized (its logit error on these random models is measured and
        # explained in the docs; the weight-level bound is checked below)
        assert nf4_err > 1e-2
        print(f"nf4 vs fp32 logits: {nf4_err:.3f} of max|logit|; dq layouts: "
              f"{[round(_err(f['nf4'][tp], f['nf4'][1]), 5) for tp in (2, 4)]}")  # fmt: skip


@slow
def test_nf4_matches_transformers_bitsandbytes_on_cpu(facts, dirs):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    ref = AutoModelForCausalLM.from_pretrained(dirs["aligned"], quantization_config=bnb,
                                               device_map="cpu").eval()  # fmt: skip
    n4 = 0
    for mod in ref.modules():
        if type(mod).__name__ == "Linear4bit":
            # the CPU avx512-bf16 repack path drops gradients and asserts on small shapes
            mod.support_avx512bf16_for_cpu = False
            n4 += 1
    assert n4 == 14  # 7 linears x 2 layers; lm_head kept in float, as quantmesh's skip does
    want = logits(ref, token_ids())
    for f in facts:
        for tp in (1, 2, 4):  # transformers' default: no double quant, blocksize 64
            assert _err(f["nf4_flat"][tp], want) <= REL_TOL, tp


# NF4's 16 levels in [-1, 1]; the widest gap (-1 .. -0.6962) bounds the rounding error of a weight
# at half of it, times its block's absmax. Double quant stores each absmax in 8 bits (blocks of
# 256, offset = the tensor's mean absmax), adding a small relative error to the scale.
NF4_HALF_GAP = (1 - 0.6961928009986877) / 2


@slow
@pytest.mark.parametrize("name, slack", [("nf4_flat", 1e-6), ("nf4", 0.02)])
def test_nf4_weights_within_the_nf4_bound(facts, dirs, name, slack):
    from safetensors.torch import load_file

    got = facts[0][f"{name}_weights"]  # dequantized at tp=4, gathered
    n = 0
    for key, w in load_file(f"{dirs['aligned']}/model.safetensors").items():
        if not key.endswith("proj.weight"):
            assert torch.equal(got[key], w), key  # embeddings, norms, head: not quantized
            continue
        blocks = w.reshape(-1, 64)  # (out*in/64, 64): every row holds whole blocks (in = 256)
        err = (got[key].reshape(-1, 64) - blocks).abs()
        absmax = blocks.abs().max(dim=1, keepdim=True).values
        assert (err <= (NF4_HALF_GAP + slack) * absmax).all(), key
        assert err.max() > 0.01 * absmax.max()  # quantized for real
        n += 1
    assert n == 14


def test_refuses_missing_folders_and_false_quantization_configs(tmp_path, dirs):
    import json
    import shutil

    import quantmesh as qm

    with pytest.raises(FileNotFoundError, match="no config.json"):
        qm.from_pretrained(tmp_path / "nothing", mesh=None)
    q = tmp_path / "q"
    shutil.copytree(dirs["llama"], q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        qm.QuantError, match="holds no quantized weights; remove quantization_config"
    ):
        qm.from_pretrained(q, mesh=None)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(qm.QuantError, match="holds a checkpoint quantized by awq"):
        qm.from_pretrained(q, mesh=None)


def _quantized_where(rank: int, folder: str) -> dict:
    """Which linears quantmesh quantizes in T5 (whose `wo` transformers keeps in float32) at
    tp=2, and the warnings it gave."""
    import warnings

    from transformers import T5ForConditionalGeneration

    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model = T5ForConditionalGeneration.from_pretrained(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm.parallelize(model, mesh, quant="nf4")
        named = qm.QuantConfig(targets=["wo"])  # named targets: quantized as named
        other = qm.parallelize(T5ForConditionalGeneration.from_pretrained(folder), mesh,
                               quant=named)  # fmt: skip

    def four_bit(m) -> set[str]:
        return {n for n, mod in m.named_modules()  # (a sharded layer holds its own in `local`)
                if type(mod.__dict__.get("local", mod)).__name__ == "QuantLinear4bit"}  # fmt: skip

    return {"quantized": four_bit(model), "named": four_bit(other),
            "warned": [str(w.message) for w in caught if "_keep_in_fp32_modules" in str(w.message)]}  # fmt: skip


def test_nf4_leaves_the_modules_transformers_keeps_in_float_as_its_bitsandbytes_does(tmp_path):
    """T5 keeps its feed-forward `wo` in float32 (`_keep_in_fp32_modules`), and transformers'
    bitsandbytes integration leaves those linears unquantized: quantmesh's nf4 quantizes the very
    layers transformers' does (no more), says which it left and why, and quantizes them when
    `targets` names them."""
    from transformers import BitsAndBytesConfig, T5ForConditionalGeneration

    from tests.zoo import ZOO

    ZOO["t5"].build(0).save_pretrained(tmp_path / "t5")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path / "t5", quantization_config=bnb,
                                                     device_map="cpu")  # fmt: skip
    want = {n for n, m in ref.named_modules() if type(m).__name__ == "Linear4bit"}
    wo = {n for n, _ in ref.named_modules() if n.endswith(".wo")}
    assert wo and not wo & want  # transformers' own: T5's wo left in float
    for got in run_ranks(_quantized_where, 2, str(tmp_path / "t5"), timeout=240):
        assert got["quantized"] == want, sorted(got["quantized"] ^ want)
        assert got["named"] == wo, sorted(got["named"] ^ wo)
        assert len(got["warned"]) == 1 and "wo" in got["warned"][0], got["warned"]
