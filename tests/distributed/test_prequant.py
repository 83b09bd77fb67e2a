"""Folders saved quantized by transformers + bitsandbytes (nf4, nf4 double quant, fp4, int8), loaded
by `qm.from_pretrained` on 4 gloo ranks at tp=1, 2, 4, against the same folder loaded by
transformers in one process (the one-process bitsandbytes model is the reference).

The aligned folder (hidden 256, 8 heads of 32, 4 KV heads, intermediate 256) has every tp cut on a
64-element block: each rank gets the stored codes and statistics, so only the summation order of
the split matmuls differs from the reference (the fp32 tolerance of test_hf.py). The unaligned
folder (intermediate 192) cuts down_proj's 192 input columns into 96 or 48 per rank, which splits
blocks: those parts are requantized (said in LoadResult.prequantized and a warning) and checked
against the nf4 rounding bound instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantmesh.testing import run_ranks

from ._io_cases import hf_logits, llama_dir, logits, token_ids

REL_TOL = 2e-6  # summation order of fp32 logits, relative to the largest logit (test_hf.py)
LAYOUTS = [(4, 1), (2, 2), (1, 4)]  # (dp, tp) on 4 ranks
KINDS = ("nf4", "nf4_dq", "fp4", "int8")


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _bnb_config(kind: str):
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind.split("_")[0],
                              bnb_4bit_use_double_quant=kind.endswith("_dq"),
                              bnb_4bit_compute_dtype=torch.float32)  # fmt: skip


def bnb_dir(src: Path, root: Path, kind: str) -> Path:
    """`src` loaded by transformers with a BitsAndBytesConfig on CPU and saved as it is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=_bnb_config(kind),
                                                 device_map="cpu")  # fmt: skip
    model.save_pretrained(root)
    return root


def reference(path) -> torch.nn.Module:
    """The folder loaded by transformers + bitsandbytes in one process, eval mode."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    for mod in ref.modules():
        if type(mod).__name__ == "Linear4bit":
            mod.support_avx512bf16_for_cpu = False  # the repacked CPU layout loses gradients
    return ref


def _facts(rank: int, dirs: dict) -> dict:
    import warnings

    import quantmesh as qm
    from quantmesh.io.prequant import folder_quant

    ids = token_ids()
    f: dict = {k: {} for k in KINDS}
    for dp, tp in LAYOUTS:
        mesh = qm.init_mesh(dp=dp, tp=tp)
        for kind in KINDS:
            m = qm.from_pretrained(dirs[kind], mesh, progress=False)
            f[kind][tp] = logits(m, ids)
            if kind == "int8":  # train mode: bitsandbytes dequantizes the weight (no dropout)
                f["int8_train"] = f.get("int8_train", {})
                f["int8_train"][tp] = logits(m.train(), ids)
    # what load_checkpoint did, per module, at tp=4: aligned and unaligned folders
    mesh = qm.init_mesh(dp=1, tp=4)
    for name in ("nf4_dq", "int8", "unaligned"):
        from transformers import AutoConfig, AutoModelForCausalLM

        with qm.empty_model():
            m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dirs[name]))
        quant = folder_quant(dirs[name], None)
        assert quant is not None
        quant.skip = ["lm_head"]
        qm.parallelize(m, mesh, quant=quant)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = qm.load_checkpoint(m, dirs[name], progress=False)
        f[f"how_{name}"] = res.prequantized
        f[f"warned_{name}"] = [str(w.message) for w in caught if "requantized" in str(w.message)]
        f[f"logits_{name}"] = logits(m, ids)
        if name == "unaligned":
            f["unaligned_weights"] = qm.full_state_dict(m)  # collective; rank 0 gets them
    # a model without quantization takes the stored weights' exact float values
    with qm.empty_model():
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dirs["nf4_dq"]))
    qm.parallelize(m, mesh)
    f["how_float"] = qm.load_checkpoint(m, dirs["nf4_dq"], progress=False).prequantized
    f["logits_float"] = logits(m, ids)
    return f


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prequant")
    aligned = llama_dir(root / "aligned", hidden=256, heads=8, kv=4, head_dim=32, inter=256,
                        bias=False)  # fmt: skip
    unaligned = llama_dir(root / "float192", hidden=256, heads=8, kv=4, head_dim=32, inter=192,
                          bias=False)  # fmt: skip
    out = {k: str(bnb_dir(aligned, root / k, k)) for k in KINDS}
    out["unaligned"] = str(bnb_dir(unaligned, root / "unaligned", "nf4"))
    out["unaligned_float"], out["float"] = str(unaligned), str(aligned)
    return out


@pytest.fixture(scope="module")
def facts(dirs):
    return run_ranks(_facts, 4, dirs, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_prequantized_folder_matches_one_process_bnb(facts, dirs, kind):
    ref = reference(dirs[kind])
    want = logits(ref, token_ids())
    for f in facts:
        for tp in (1, 2, 4):
            if kind != "int8" or tp == 1:  # stored codes: only the summation order differs
                assert _err(f[kind][tp], want) <= REL_TOL, (kind, tp)
    if kind == "int8":
        # eval mode: LLM.int8 quantizes each activation row over the features a rank holds, so a
        # row-split (rowwise) layer sees other activation scales than one process: bounded by
        # int8's own error against the float model. Train mode dequantizes the stored weight
        # (CB * SCB / 127) and must match to the fp32 tolerance.
        own = _err(want, hf_logits(dirs["float"], token_ids()))
        train = logits(ref.train(), token_ids())
        for f in facts:
            for tp in (2, 4):
                assert _err(f[kind][tp], want) <= own, (tp, own)
            for tp in (1, 2, 4):
                assert _err(f["int8_train"][tp], train) <= REL_TOL, tp


@pytest.mark.slow
def test_a_float_model_takes_the_exact_dequantized_values(facts, dirs):
    f = facts[0]
    assert set(f["how_float"].values()) == {"dequantized (nf4 -> float, exact)"}
    assert len(f["how_float"]) == 14
    want = logits(reference(dirs["nf4_dq"]), token_ids())  # bitsandbytes dequantizes to fp32 too
    assert _err(f["logits_float"], want) <= REL_TOL


@pytest.mark.slow
def test_load_says_what_it_did_per_module(facts):
    f = facts[0]
    assert len(f["how_nf4_dq"]) == 14  # 7 linears x 2 layers; lm_head stays float
    assert set(f["how_nf4_dq"].values()) == {"codes cut on block boundaries"}
    assert set(f["how_int8"].values()) == {"int8 rows and scales as stored"}
    assert f["warned_nf4_dq"] == [] and f["warned_int8"] == []
    redo = {m for m, how in f["how_unaligned"].items() if how.startswith("requantized")}
    assert redo == {f"model.layers.{i}.mlp.down_proj" for i in (0, 1)}  # 48 of 192 columns
    assert "columns [(" in f["how_unaligned"]["model.layers.0.mlp.down_proj"]
    assert len(f["warned_unaligned"]) == 1 and "requantized" in f["warned_unaligned"][0]


# NF4's 16 levels in [-1, 1]; the widest gap (-1 .. -0.6962) bounds the rounding error of a value
# at half of it, times its block's absmax (as in test_hf.py)
NF4_HALF_GAP = (1 - 0.6961928009986877) / 2


@pytest.mark.slow
def test_unaligned_parts_are_requantized_within_the_nf4_bound(facts, dirs):
    ref = reference(dirs["unaligned"])
    got = facts[0]["unaligned_weights"]  # tp=4, dequantized and gathered on rank 0
    n = 0
    for name, mod in ref.named_modules():
        if type(mod).__name__ != "Linear4bit":
            continue
        import bitsandbytes.functional as F

        qs = mod.weight.quant_state
        flat = F.QuantState(absmax=qs.absmax, shape=torch.Size((1, qs.shape.numel())),
                            code=qs.code, blocksize=64, quant_type="nf4", dtype=qs.dtype,
                            offset=qs.offset, state2=qs.state2)  # fmt: skip
        stored = F.dequantize_4bit(mod.weight.data, flat).view(qs.shape)  # (out, in) exact
        w = got[f"{name}.weight"]
        if not name.endswith("down_proj"):
            assert torch.equal(w, stored), name  # stored codes, cut on blocks
            continue
        for r in range(4):  # each rank requantized its (256, 48) columns in new 64-blocks
            part, mine = stored[:, 48 * r : 48 * (r + 1)], w[:, 48 * r : 48 * (r + 1)]
            blocks = part.reshape(-1, 64)
            bound = NF4_HALF_GAP * blocks.abs().max(dim=1, keepdim=True).values
            assert ((mine.reshape(-1, 64) - blocks).abs() <= bound + 1e-6).all(), (name, r)
        assert not torch.equal(w, stored)  # really requantized
        n += 1
    assert n == 2
    want = logits(ref, token_ids())
    own = _err(want, hf_logits(dirs["unaligned_float"], token_ids()))  # nf4's own error
    assert _err(facts[0]["logits_unaligned"], want) <= own
