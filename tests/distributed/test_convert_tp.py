"""Converted checkpoint keys at tp=2 on 2 gloo ranks.

- Folders saved by transformers with one tensor per expert (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
  DeepSeek-V3; gpt-oss stored fused) load at tp=2 with the experts split over tp: float through
  `qm.from_pretrained` (logits against transformers' own from_pretrained), and nf4 with LoRA on
  every projection, equal bit for bit to the model loaded from a folder that stores the fused
  tensors directly, each rank reading the same bytes (its slice of every stored expert).
- At pp=2 each stage loads its own experts from the per-expert folder (strictly: the other stage's
  pieces are not unexpected), equal to the fused folder's.
- A dense model whose checkpoint fuses q|k|v and gate|up (a conversion rule with Split and Chunk,
  as several architectures have): the tp-split q/k/v/gate/up are read as slices of the fused stored
  tensors; each rank reads exactly the bytes it reads from the unfused folder, logits match.
"""

from __future__ import annotations

import pytest
import torch

from quantmesh.testing import run_ranks
from tests.moe_folders import ARCHS, moe_dir

from ._io_cases import hf_logits, llama_dir, logits

# summation order of fp32 partial sums over two ranks, relative to the largest logit (the loading
# itself is checked bit for bit: against the fused folder's model)
pytestmark = pytest.mark.slow  # three spawns loading six MoE folders: left out by make test-fast

REL_TOL = 1e-5
VOCAB = 64


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))


def _fused_folder(src, dst) -> None:
    """The folder as transformers holds it in memory: fused experts, saved with save_file."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dst.mkdir()
    sd = AutoModelForCausalLM.from_pretrained(src).state_dict()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())


def _load(path, mesh, **kw):
    """What from_pretrained does, with the LoadResult kept; kw to parallelize."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import quantmesh as qm
    from quantmesh.io.hf import hf_key_map

    with qm.empty_model():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    qm.parallelize(model, mesh, **kw)
    result = qm.load_checkpoint(model, path, key_map=hf_key_map(model), progress=False)
    return model.eval(), result.bytes_read


def _split_experts(model) -> list[tuple[bool, bool]]:
    """(split over tp, quantized) of every experts module."""
    from quantmesh.tp.experts import ShardedExperts

    found = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    return [(m.tp == 2 and m.param_slices()["gate_up_proj"] is not None, bool(m.qlocal))
            for m in found]  # fmt: skip


def _moe_facts(rank: int, dirs: dict) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    out: dict = {}
    for name in ARCHS:
        model = qm.from_pretrained(dirs[name], mesh, progress=False)
        out[name], out[f"{name}_experts"] = logits(model, _ids()), _split_experts(model)
        for kind in ("", "_fused"):
            # nf4, LoRA on every projection (the default targets reach the experts' tensors)
            model, out[f"{name}{kind}_bytes"] = _load(dirs[name + kind], mesh, quant="nf4",
                                                      lora=qm.LoraConfig(r=2))  # fmt: skip
            out[f"{name}{kind}_nf4"] = logits(model, _ids())
        out[f"{name}_nf4_experts"] = _split_experts(model)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp")
    dirs = {}
    for name in ARCHS:
        dirs[name] = str(moe_dir(name, root / name))
        _fused_folder(root / name, root / f"{name}_fused")
        dirs[f"{name}_fused"] = str(root / f"{name}_fused")
    return dirs


@pytest.fixture(scope="module")
def moe(folders):
    return folders, run_ranks(_moe_facts, 2, folders, timeout=400)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", list(ARCHS))
def test_per_expert_folders_load_at_tp2_like_transformers(moe, name):
    dirs, facts = moe
    want = hf_logits(dirs[name], _ids())
    for f in facts:
        # the experts are split over tp (each rank read its slice of every stored expert), and
        # quantized in nf4
        assert f[f"{name}_experts"] == [(True, False)] * (1 if name == "deepseek_v3" else 2)
        assert f[f"{name}_nf4_experts"] == [(True, True)] * (1 if name == "deepseek_v3" else 2)
        assert _err(f[name], want) <= REL_TOL
        # nf4 + LoRA: the same model as from the fused folder, bit for bit, the same bytes read
        assert torch.equal(f[f"{name}_nf4"], f[f"{name}_fused_nf4"])
        assert f[f"{name}_bytes"] == f[f"{name}_fused_bytes"] > 0
        assert not torch.equal(f[f"{name}_nf4"], f[name])  # something was quantized


def _fuse_llama(src, dst) -> None:
    """q|k|v and gate|up of every layer stored fused, as some architectures' checkpoints are."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            if f".{part}." in k:
                break
        else:
            out[k] = v
    for i in range(2):
        p = f"model.layers.{i}"
        for kind in ("weight", "bias"):
            qkv = [sd[f"{p}.self_attn.{x}_proj.{kind}"] for x in "qkv"]
            out[f"{p}.self_attn.qkv_proj.{kind}"] = torch.cat(qkv)
        out[f"{p}.mlp.gate_up.weight"] = torch.cat(
            [sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]]
        )
        out[f"{p}.mlp.gate_up.bias"] = torch.cat([sd[f"{p}.mlp.gate_proj.bias"],
                                                  sd[f"{p}.mlp.up_proj.bias"]])  # fmt: skip
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())


def _dense_facts(rank: int, plain: str, fused: str) -> dict:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, Split, WeightConverter

    import quantmesh as qm

    rules = [
        WeightConverter(f"self_attn.qkv_proj.{kind}",
                        [f"self_attn.{x}_proj.{kind}" for x in "qkv"], [Split(dim=0)])
        for kind in ("weight", "bias")
    ] + [
        WeightConverter(f"mlp.gate_up.{kind}", [f"mlp.gate_proj.{kind}", f"mlp.up_proj.{kind}"],
                        [Chunk(dim=0)])
        for kind in ("weight", "bias")
    ]  # fmt: skip
    register_checkpoint_conversion_mapping("llama", rules, overwrite=True)  # this process only
    mesh = qm.init_mesh(tp=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    m, fused_bytes = _load(fused, mesh)
    q = m.get_submodule("model.layers.0.self_attn.q_proj")
    _, plain_bytes = _load(plain, mesh)
    return {"logits": logits(m, ids), "bytes": fused_bytes, "plain_bytes": plain_bytes,
            "q_split": tuple(q.weight.shape) != (q.out_full, q.in_full)}  # fmt: skip


def test_fused_dense_checkpoint_streams_tp_slices(tmp_path):
    plain = llama_dir(tmp_path / "plain")  # 9 heads / 3 KV heads: uneven q, k, v splits
    _fuse_llama(plain, tmp_path / "fused")
    facts = run_ranks(_dense_facts, 2, str(plain), str(tmp_path / "fused"), timeout=240)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    want = hf_logits(plain, ids)
    for f in facts:
        assert f["q_split"]  # the fused q|k|v is really cut per rank
        assert _err(f["logits"], want) <= REL_TOL
        assert f["bytes"] == f["plain_bytes"] > 0


def _pp_facts(rank: int, dirs: dict) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(pp=2)
    out = {}
    for kind in ("", "_fused"):
        net = qm.from_pretrained(dirs["qwen3_moe" + kind], mesh, progress=False)
        out[kind] = {n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def test_per_expert_folder_loads_each_pipeline_stage(folders):
    """pp=2: each stage assembles only its own experts; the other stage's pieces are skipped, not
    unexpected (strict load), and every stage holds what it holds from the fused folder."""
    facts = run_ranks(_pp_facts, 2, folders, timeout=240)
    for stage, f in enumerate(facts):
        assert f[""].keys() == f["_fused"].keys()
        experts = [n for n in f[""] if n.endswith("mlp.experts.gate_up_proj")]
        assert experts == [f"model.layers.{stage}.mlp.experts.gate_up_proj"]
        for n, p in f[""].items():
            assert torch.equal(p, f["_fused"][n]), n
