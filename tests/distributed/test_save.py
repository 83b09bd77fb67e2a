"""save_adapter / load_adapter (PEFT format), save_state / load_state (bit-exact resume) and export
(a transformers folder), on gloo ranks, checked against peft and transformers in this process.

Spawns: A (tp=2) saves adapters, exports, and runs the uninterrupted reference training; B (4
ranks) loads those saves at tp=4 and tp=1; C (tp=2, fresh processes) resumes and must reproduce A
bit for bit; D kills rank 0 in the middle of a save and the previous save must survive.
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
from torch import nn

from quantmesh.testing import RanksFailed, run_ranks

from ._io_cases import gpt2_dir, llama_dir, logits, token_ids

pytestmark = pytest.mark.slow  # make test-fast leaves this module out

# summation-order differences of fp32 logits, relative to the largest logit: see test_load.py
REL_TOL = 2e-6
LLAMA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]  # colwise and rowwise bases


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


# --------------------------------------------------------------------------- rank-side helpers
def _lora(**kw):
    import quantmesh as qm

    return qm.LoraConfig(r=4, alpha=8, **kw)


@torch.no_grad()
def _random_b(model: nn.Module) -> None:
    """Nonzero B (a fresh adapter's B is 0 and would hide a wrong B); each local tensor from a
    generator seeded by its name, so replicated Bs stay equal on every rank."""
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(n) * 7919 + p.numel()))


def _seed_all() -> None:
    import numpy as np

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _train(model, opt, mesh, steps) -> list[float]:
    """AdamW steps on batches drawn from torch's, python's and numpy's global RNGs (so resuming
    must restore all three) plus a per-(step, dp rank) generator."""
    import numpy as np

    losses = []
    for s in steps:
        ids = torch.randint(
            0, 128, (2, 9), generator=torch.Generator().manual_seed(100 * s + mesh.dp_rank)
        )
        ids[0, 0] = int(torch.randint(0, 128, ()))
        ids[0, 1] = random.randrange(128)
        ids[1, 0] = int(np.random.randint(128))
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _trainable(model):
    import quantmesh as qm

    m = qm.full_state_dict(model)  # collective
    return {k: v for k, v in m.items() if "lora_" in k}


def _fresh(path, mesh):
    import quantmesh as qm

    # LoRA dropout on: resuming must restore the generators its masks come from
    lora = _lora(targets=LLAMA_TARGETS, dropout=0.1)
    model = qm.from_pretrained(path, mesh, lora=lora, progress=False)
    model.train()
    return model, torch.optim.AdamW(qm.trainable_parameters(model), lr=1e-2)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _spawn_a(rank: int, d: dict) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    f: dict = {}
    ids = token_ids()
    # adapters + export, fp32 Llama (uneven heads) and GPT-2 (Conv1D, fused q|k|v)
    for name, targets in (("llama", LLAMA_TARGETS), ("gpt2", ["c_attn", "c_proj"])):
        m = qm.from_pretrained(d[name], mesh, lora=_lora(targets=targets), progress=False)
        _random_b(m)
        f[f"{name}_logits"] = logits(m, ids)
        qm.save_adapter(m, d[f"{name}_adapter"])
        qm.export(m, d[f"{name}_export"], max_shard_size=20_000)  # several files + an index
    # rsLoRA (scale alpha / sqrt(r)): saved, and PEFT's own adapter loaded
    m = qm.from_pretrained(d["llama"], mesh, lora=_lora(targets=LLAMA_TARGETS, rslora=True),
                           progress=False)  # fmt: skip
    _random_b(m)
    f["rslora_logits"] = logits(m, ids)
    qm.save_adapter(m, d["rslora_adapter"])
    from quantmesh.io.adapter import adapter_lora_config

    lora = adapter_lora_config(d["peft_rslora"])
    m = qm.from_pretrained(d["llama"], mesh, lora=lora, progress=False)
    qm.load_adapter(m, d["peft_rslora"])
    f["peft_rslora_logits"] = logits(m, ids)
    # nf4 base + LoRA: exported dequantized and merged
    m = qm.from_pretrained(d["llama"], mesh, quant="nf4", lora=_lora(targets=LLAMA_TARGETS),
                           progress=False)  # fmt: skip
    _random_b(m)
    f["nf4_logits"] = logits(m, ids)
    qm.export(m, d["nf4_export"])
    # adapters that do not fit
    wrong_r = qm.from_pretrained(d["llama"], mesh, lora=qm.LoraConfig(r=8, targets=LLAMA_TARGETS),
                                 progress=False)  # fmt: skip
    f["wrong_r"] = _error(lambda: qm.load_adapter(wrong_r, d["llama_adapter"]))
    fewer = qm.from_pretrained(d["llama"], mesh, lora=_lora(targets=["q_proj"]), progress=False)
    f["fewer"] = _error(lambda: qm.load_adapter(fewer, d["llama_adapter"]))
    # resume reference: 6 steps uninterrupted; then 3 steps and a save, in a fresh model
    model, opt = _fresh(d["llama"], mesh)
    _seed_all()
    f["straight"] = _train(model, opt, mesh, range(6))
    f["straight_final"] = _trainable(model)
    model, opt = _fresh(d["llama"], mesh)
    _seed_all()
    _train(model, opt, mesh, range(3))
    qm.save_state(model, opt, d["state"], step=3)
    f["saved_lora"] = _trainable(model)
    f["saved_opt"] = {k: _full_opt(model, opt, k) for k in ("exp_avg", "exp_avg_sq")}
    return f


def _full_opt(model, opt, key: str) -> dict:
    """Every trainable parameter's optimizer state `key`, gathered over tp (collective)."""
    from quantmesh.io.save import full_tensor
    from quantmesh.tp.layers import sharded_modules

    out = {}
    for fqn, m in sharded_modules(model).items():
        for name in ("lora_A.weight", "lora_B.weight"):
            if m.lora is not None:
                out[f"{fqn}.{name}"] = full_tensor(m, name, opt.state[m.get_parameter(name)][key])
    return out


def _reload(d: dict, dp: int, tp: int) -> dict:
    """The tp=2 adapter and state, loaded at another layout."""
    import warnings

    import quantmesh as qm

    mesh = qm.init_mesh(dp=dp, tp=tp)
    m = qm.from_pretrained(d["llama"], mesh, lora=_lora(targets=LLAMA_TARGETS), progress=False)
    qm.load_adapter(m, d["llama_adapter"])
    f = {"adapter": logits(m, token_ids())}
    model, opt = _fresh(d["llama"], mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f["step"] = qm.load_state(model, opt, d["state"])
    f["rng_warning"] = any("RNG states are not" in str(w.message) for w in caught)
    f["state_lora"] = _trainable(model)
    f["state_opt"] = {k: _full_opt(model, opt, k) for k in ("exp_avg", "exp_avg_sq")}
    if dp > 1:  # saving from dp x tp: replica 0 writes, the files equal the tp=2 originals
        qm.save_adapter(m, d["adapter_dp"])
        qm.export(m, d["export_dp"])
        qm.save_state(model, opt, d["state_dp"], step=f["step"])
    return f


def _spawn_b(rank: int, d: dict) -> dict:
    return {4: _reload(d, 1, 4)}


def _spawn_c(rank: int, d: dict) -> dict:
    """Fresh processes at the saved layout: resume; then the same saves at dp=2 x tp=1."""
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2)
    model, opt = _fresh(d["llama"], mesh)
    step = qm.load_state(model, opt, d["state"])
    f = {"step": step, "losses": _train(model, opt, mesh, range(step, step + 3)),
         "final": _trainable(model)}  # fmt: skip
    f[1] = _reload(d, 2, 1)
    return f


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _spawn_d(rank: int, path: str) -> None:
    import quantmesh as qm
    import quantmesh.io.save as save

    mesh = qm.init_mesh(tp=2)
    torch.manual_seed(0)
    model = qm.parallelize(Tiny(), mesh, lora=qm.LoraConfig(r=2, targets=["up", "down"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(1.0)
    qm.save_adapter(model, path)  # the save that must survive
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(2.0)

    def write_then_die(tensors, file):
        file.write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 0:
        save._save_file = write_then_die
    qm.save_adapter(model, path)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def d(tmp_path_factory):
    root = tmp_path_factory.mktemp("save")
    out = {"llama": str(llama_dir(root / "llama")), "gpt2": str(gpt2_dir(root / "gpt2"))}
    for name in ("llama_adapter", "gpt2_adapter", "llama_export", "gpt2_export", "nf4_export",
                 "state", "adapter_dp", "export_dp", "state_dp", "rslora_adapter"):  # fmt: skip
        out[name] = str(root / name)
    out["peft_rslora"] = _peft_rslora(out["llama"], root / "peft_rslora")
    return out


def _peft_rslora(base: str, path) -> str:
    """An rsLoRA adapter written by PEFT itself (nonzero B)."""
    import peft
    from transformers import AutoModelForCausalLM

    pm = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, use_rslora=True),
    )
    _random_b(pm)
    pm.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def a(d):
    return run_ranks(_spawn_a, 2, d, timeout=240)


@pytest.fixture(scope="module")
def b(d, a):
    return run_ranks(_spawn_b, 4, d, timeout=240)


@pytest.fixture(scope="module")
def c(d, a):
    return run_ranks(_spawn_c, 2, d, timeout=180)


# --------------------------------------------------------------------------- adapters
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_peft_loads_the_adapter(a, d, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = json.loads(open(f"{d[f'{name}_adapter']}/adapter_config.json").read())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["bias"] == "none"
    assert cfg["fan_in_fan_out"] is (name == "gpt2")  # Conv1D bases store (in, out)
    assert cfg["base_model_name_or_path"] == d[name]
    base = AutoModelForCausalLM.from_pretrained(d[name])
    peft_model = PeftModel.from_pretrained(base, d[f"{name}_adapter"]).eval()
    want = logits(peft_model, token_ids())
    assert _err(a[0][f"{name}_logits"], want) <= REL_TOL
    plain = logits(AutoModelForCausalLM.from_pretrained(d[name]).eval(), token_ids())
    assert _err(plain, want) > 1e-2  # the adapter really changes the outputs


def test_rslora_adapters_are_peft_s(a, d):
    """rsLoRA (`use_rslora`, alpha / sqrt(r)) adapters were refused as a LoRA feature quantmesh
    does not load; now trained, saved and loaded at tp=2, each equal to PEFT's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = json.loads(open(f"{d['rslora_adapter']}/adapter_config.json").read())
    assert cfg["use_rslora"] is True and cfg["lora_alpha"] == 8 and cfg["r"] == 4
    for adapter, ours in (
        ("rslora_adapter", "rslora_logits"),
        ("peft_rslora", "peft_rslora_logits"),
    ):
        base = AutoModelForCausalLM.from_pretrained(d["llama"])
        want = logits(PeftModel.from_pretrained(base, d[adapter]).eval(), token_ids())
        assert _err(a[0][ours], want) <= REL_TOL, adapter
    plain = AutoModelForCausalLM.from_pretrained(d["llama"])
    lora = logits(PeftModel.from_pretrained(plain, d["llama_adapter"]).eval(), token_ids())
    assert _err(a[0]["rslora_logits"], lora) > 1e-3  # not the plain scale (the same B)


def test_adapter_loads_at_any_tp(a, b, c):
    for ranks, tp in ((b, 4), (c, 1)):  # every rank of each spawn, at that spawn's tp
        for f in ranks:
            assert _err(f[tp]["adapter"], a[0]["llama_logits"]) <= REL_TOL, tp


def test_adapter_that_does_not_fit_is_refused(a):
    for f in a:
        assert f["wrong_r"].startswith("LoraError") and "model r=8, adapter r=4" in f["wrong_r"]
        msg = f["fewer"]
        assert "adapter modules without LoRA in the model" in msg
        assert "model.layers.0.self_attn.v_proj" in msg and "adapter_lora_config" in msg


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("name", ["llama", "gpt2", "nf4"])
def test_export_opens_in_transformers(a, d, name):
    from transformers import AutoModelForCausalLM

    folder = d[f"{name}_export"]
    files = sorted(os.listdir(folder))
    assert "config.json" in files
    if name == "nf4":
        assert "model.safetensors" in files
    else:
        assert "model.safetensors.index.json" in files and len(files) > 4
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert ref.config.tie_word_embeddings  # the tied head stayed tied (written once)
    key = "nf4" if name == "nf4" else name
    # LoRA merged: plain transformers on the merged weights gives the adapted logits. For nf4
    # the weights are the dequantized values, which bitsandbytes also multiplies in fp32 here.
    assert _err(logits(ref, token_ids()), a[0][f"{key}_logits"]) <= REL_TOL


# --------------------------------------------------------------------------- resume
def test_resume_is_bit_exact(a, c):
    for fa, fc in zip(a, c, strict=True):
        assert fc["step"] == 3
        assert fc["losses"] == fa["straight"][3:]  # exact float equality
    for k, v in a[0]["straight_final"].items():
        assert torch.equal(c[0]["final"][k], v), k
    assert len(a[0]["straight_final"]) == 16


def test_state_reshards_to_another_layout(a, b, c):
    # saved at dp=1 x tp=2 (2 ranks), loaded at dp=1 x tp=4 (4 ranks) and dp=2 x tp=1 (2 ranks):
    # the slices each rank reads reassemble to exactly the saved tensors
    assert [f[4]["rng_warning"] for f in b] == [True, False, False, False]  # world 4 != 2: once
    assert [f[1]["rng_warning"] for f in c] == [False, False]  # same world size: RNG restored
    assert a[0]["saved_lora"] and all(a[0]["saved_opt"][k] for k in ("exp_avg", "exp_avg_sq"))
    for ranks, tp in ((b, 4), (c, 1)):
        for k, v in a[0]["saved_lora"].items():
            assert torch.equal(ranks[0][tp]["state_lora"][k], v), (tp, k)
        for f in ranks:
            assert f[tp]["step"] == 3
            for key in ("exp_avg", "exp_avg_sq"):
                for k, v in a[0]["saved_opt"][key].items():
                    assert torch.equal(f[tp]["state_opt"][key][k], v), (tp, key, k)


def _tensors(folder: str, stem: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(
        f for f in os.listdir(folder) if f.startswith(stem) and f.endswith(".safetensors")
    )
    return {k: v for f in files for k, v in load_file(f"{folder}/{f}").items()}


def test_saves_from_dp_x_tp_equal_the_originals(c, d):
    # a save made at dp=2 x tp=1 after loading the tp=2 saves holds the same bits
    for new, old, stem in (("adapter_dp", "llama_adapter", "adapter_model"),
                           ("export_dp", "llama_export", "model"),
                           ("state_dp", "state", "trainable"), ("state_dp", "state", "optimizer")):  # fmt: skip
        got, want = _tensors(d[new], stem), _tensors(d[old], stem)
        assert got.keys() == want.keys() and len(want) > 0, (new, stem)
        for k, v in want.items():
            assert torch.equal(got[k], v), (new, k)
    assert json.loads(open(f"{d['state_dp']}/state.json").read())["mesh"] == {"dp": 2, "tp": 1}


# --------------------------------------------------------------------------- crash safety
def test_killed_save_leaves_the_previous_one(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from quantmesh.io.atomic import recover

    path = tmp_path / "adapter"
    with pytest.raises(RanksFailed, match=r"rank 0: (did not finish|process exited with code -9)"):
        run_ranks(_spawn_d, 2, str(path), timeout=60)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "adapter"]
    assert leftovers and all(n.startswith(".adapter.tmp-") for n in leftovers)
    sd = load_file(path / "adapter_model.safetensors")
    assert sd and all(torch.equal(v, torch.ones_like(v)) for k, v in sd.items() if "lora_B" in k)
    PeftModel.from_pretrained(Tiny(), path)  # the surviving folder is a complete adapter
    assert recover(path) and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
