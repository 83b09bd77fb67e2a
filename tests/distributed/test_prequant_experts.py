"""Mixture-of-experts folders saved quantized by bitsandbytes one linear per expert (as transformers
4 saved them, e.g. the `-bnb-4bit` uploads), loaded by `qm.from_pretrained` "as stored".

transformers 5 fuses the experts into 3-D tensors and fails on this layout (its loading report
refuses the packed shapes), so the reference is built from bitsandbytes' own dequantize: a float
folder holding the dequantized values of every stored weight. The experts are read as those values,
fused, and quantized again in the model's blocks; the attention's codes are kept as stored.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from tests.moe_folders import moe_dir, quantized_per_expert

pytestmark = pytest.mark.slow

IDS = torch.tensor([[1, 5, 9, 33, 12, 7, 40, 22], [3, 60, 2, 17, 8, 8, 51, 30]])
REL_TOL = 2e-6  # summation order of fp32 logits, relative to the largest logit (test_hf.py)
# double quant: the absmax of the fused tensor's blocks is quantized again in other groups of 256
DQ_TOL = 1e-4


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _load(folder: Path, **kw) -> tuple[torch.nn.Module, list[str]]:
    import quantmesh as qm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qm.from_pretrained(folder, qm.init_mesh(tp=1), progress=False, **kw)
    return model, [str(w.message) for w in caught]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("kind", ["nf4", "nf4_dq", "fp4", "int8"])
def test_per_expert_codes_load_into_fused_quantized_experts(tmp_path, arch, kind):
    from transformers import AutoModelForCausalLM

    from quantmesh.tp.experts import ShardedExperts

    folder = moe_dir(arch, tmp_path / "float", hidden_size=64)
    stored, reference = quantized_per_expert(folder, tmp_path / "q", kind)
    model, warned = _load(stored)
    warned = [w for w in warned if "requantized" in w]
    experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    # quantized as stored, not held in float (a 30B MoE's experts would not fit)
    assert len(experts) == 2 and all(e.fmt.name == kind.split("_")[0] for e in experts)
    got = _logits(model)
    if kind == "int8":  # a float matmul is not int8's; the same model from the reference's values
        want = _logits(_load(reference, quant="int8")[0])
        assert _err(got, want) < REL_TOL
    else:
        ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        assert _err(got, _logits(ref)) < (DQ_TOL if kind.endswith("_dq") else REL_TOL)
    # said: the experts were quantized again
    assert len(warned) == 1 and "one linear per expert" in warned[0]


def test_a_float_model_takes_the_per_expert_values_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantmesh.io.hf import hf_key_map
    from quantmesh.io.load import load_checkpoint

    folder = moe_dir("qwen3_moe", tmp_path / "float", hidden_size=64)
    stored, reference = quantized_per_expert(folder, tmp_path / "q", "nf4_dq")
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    model, _ = _load(reference)  # a float model, then the quantized folder's values into it
    res = load_checkpoint(model, stored, key_map=hf_key_map(model), progress=False)
    assert _err(_logits(model), _logits(ref)) < REL_TOL
    assert res.prequantized["model.layers.0.mlp.experts"].startswith("dequantized (nf4 pieces")
    assert res.prequantized["model.layers.0.self_attn.q_proj"].startswith("dequantized (nf4")


def _tp2(rank: int, stored: str, reference: str, out: str) -> None:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    got = _logits(qm.from_pretrained(stored, mesh, progress=False))
    same = qm.QuantConfig(format="nf4", double_quant=False)  # the stored folder's
    want = _logits(qm.from_pretrained(reference, mesh, quant=same, progress=False))
    if rank == 0:
        torch.save((got, want), out)


def test_per_expert_codes_load_at_tp2(tmp_path):
    """Each rank reads its slice of the fused experts from the per-expert codes, and quantizes it
    as it would the same values read from a float folder."""
    from quantmesh.testing import run_ranks

    folder = moe_dir("qwen3_moe", tmp_path / "float", hidden_size=64)
    stored, reference = quantized_per_expert(folder, tmp_path / "q", "nf4")
    run_ranks(_tp2, 2, str(stored), str(reference), str(tmp_path / "tp2.pt"), timeout=300)
    got, want = torch.load(tmp_path / "tp2.pt")
    assert _err(got, want) < REL_TOL


def test_float_experts_of_a_quantized_folder_are_said_and_quantized_on_request(tmp_path):
    """transformers 5 + bitsandbytes quantizes the attention only: the experts stay float as
    stored, said with the fix; quant="nf4" quantizes them too (the attention from its codes)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from quantmesh.tp.experts import ShardedExperts

    folder = moe_dir("qwen3_moe", tmp_path / "float", hidden_size=64)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    saved = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, device_map="cpu")
    saved.save_pretrained(tmp_path / "q")
    import quantmesh as qm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qm.from_pretrained(tmp_path / "q", qm.init_mesh(tp=1), progress=False)
    said = [str(w.message) for w in caught if "experts module(s) in float" in str(w.message)]
    assert len(said) == 1 and "quant='nf4'" in said[0]
    assert not any(isinstance(m, ShardedExperts) for m in model.modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qm.from_pretrained(tmp_path / "q", qm.init_mesh(tp=1), quant="nf4", progress=False)
    assert not [w for w in caught if "in float" in str(w.message)]
    experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    assert len(experts) == 2 and all(e.fmt.name == "nf4" for e in experts)


# ---- fp8 with block scales (DeepSeek-V3's and Qwen3's -FP8 checkpoints) ------------------------
# moe_intermediate 384 is 3 blocks of 128; 320 cuts its last block (as DeepSeek-V3's
# kv_a_proj_with_mqa, 576 rows, does): its block is still 128, the scale grid's
FP8_SHAPES = {"qwen3_moe": dict(hidden_size=256, moe_intermediate_size=384),
              "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=320)}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(FP8_SHAPES))
def test_fp8_folders_load_as_their_values_float_or_quantized(tmp_path, arch):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.moe_folders import fp8_folder

    folder = moe_dir(arch, tmp_path / "float", **FP8_SHAPES[arch])
    stored, reference = fp8_folder(folder, tmp_path / "q")
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    model, warned = _load(stored, dtype=torch.float32)  # quant=None: float values, said
    floats = _logits(model)
    assert _err(floats, _logits(ref)) < REL_TOL
    said = [w for w in warned if "stored in fp8" in w]
    assert len(said) == 1 and "quant='nf4'" in said[0]
    if arch == "qwen3_moe":  # every shape a multiple of 128: transformers' own dequantize agrees
        deq = FineGrainedFP8Config(dequantize=True)
        tf = AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32,
                                                  quantization_config=deq).eval()  # fmt: skip
        assert _err(floats, _logits(tf)) < REL_TOL
    # read bytes are counted at the stored width: the fp8 weights and the rest, not the scales
    from safetensors import safe_open

    from quantmesh.io.hf import hf_key_map
    from quantmesh.io.load import load_checkpoint

    res = load_checkpoint(model, stored, key_map=hf_key_map(model), progress=False)
    with safe_open(str(stored / "model.safetensors"), framework="pt") as f:
        nbytes = [(k, f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()]
    size = {"F8_E4M3": 1, "F32": 4, "BF16": 2, "F16": 2}
    want = sum(math.prod(shape) * size[dt] for k, shape, dt in nbytes if "scale_inv" not in k)
    assert res.bytes_read == want
    # quant="nf4": the same model as the float values quantized
    got = _logits(_load(stored, quant="nf4", dtype=torch.float32)[0])
    want = _logits(_load(reference, quant="nf4", dtype=torch.float32)[0])
    assert _err(got, want) < REL_TOL


def _nf4_tp2(rank: int, stored: str, reference: str, out: str) -> None:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    kw = dict(quant="nf4", dtype=torch.float32, progress=False)
    got = _logits(qm.from_pretrained(stored, mesh, **kw))
    want = _logits(qm.from_pretrained(reference, mesh, **kw))
    if rank == 0:
        torch.save((got, want), out)


def test_fp8_folders_load_by_slices_at_tp2(tmp_path):
    from quantmesh.testing import run_ranks
    from tests.moe_folders import fp8_folder

    folder = moe_dir("deepseek_v3", tmp_path / "float", **FP8_SHAPES["deepseek_v3"])
    stored, reference = fp8_folder(folder, tmp_path / "q")
    run_ranks(_nf4_tp2, 2, str(stored), str(reference), str(tmp_path / "tp2.pt"), timeout=300)
    got, want = torch.load(tmp_path / "tp2.pt")
    assert _err(got, want) < REL_TOL


def test_fp8_folders_other_than_e4m3_blocks_are_refused(tmp_path):
    import json

    import quantmesh as qm
    from tests.moe_folders import fp8_folder

    folder = moe_dir("qwen3_moe", tmp_path / "float", **FP8_SHAPES["qwen3_moe"])
    stored, _ = fp8_folder(folder, tmp_path / "q")
    cfg = json.loads((stored / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = None  # per-tensor scales
    (stored / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(qm.QuantError, match="block scales"):
        qm.from_pretrained(stored, qm.init_mesh(tp=1), progress=False)


# ---- MXFP4 (gpt-oss' experts on the Hub) ----------------------------------------------------------
MXFP4_SHAPE = dict(hidden_size=64, intermediate_size=32)  # inputs in groups of 32 codes


def test_mxfp4_folders_load_as_transformers_dequantizes_them(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantmesh.tp.experts import ShardedExperts
    from tests.moe_folders import mxfp4_folder

    folder = moe_dir("gpt_oss", tmp_path / "float", **MXFP4_SHAPE)
    stored, reference = mxfp4_folder(folder, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    model, warned = _load(stored, dtype=torch.float32)  # quant=None: the float values, said
    assert _err(_logits(model), _logits(ref)) < REL_TOL
    said = [w for w in warned if "stored in mxfp4" in w]
    assert len(said) == 1 and "quant='nf4'" in said[0]
    # quant="nf4": the experts quantized from those values, as from the float folder
    model = _load(stored, quant="nf4", dtype=torch.float32)[0]
    experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    assert len(experts) == 2 and all(e.fmt.name == "nf4" for e in experts)
    want = _logits(_load(reference, quant="nf4", dtype=torch.float32)[0])
    assert _err(_logits(model), want) < REL_TOL


def test_mxfp4_folders_load_by_slices_at_tp2(tmp_path):
    from quantmesh.testing import run_ranks
    from tests.moe_folders import mxfp4_folder

    folder = moe_dir("gpt_oss", tmp_path / "float", **MXFP4_SHAPE)
    stored, reference = mxfp4_folder(folder, tmp_path)
    run_ranks(_nf4_tp2, 2, str(stored), str(reference), str(tmp_path / "tp2.pt"), timeout=300)
    got, want = torch.load(tmp_path / "tp2.pt")
    assert _err(got, want) < REL_TOL
