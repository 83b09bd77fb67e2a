"""Mixtures of experts beyond the zoo's checks (tests/distributed/test_zoo.py runs every MoE
architecture's forward, every gradient, LoRA on the expert tensors against peft and nf4 at tp=2 and
tp=3): the adapter file peft reads, training an nf4 MoE base, what a rank holds, the refusals.

Two launches share one folder: tp=2 trains and saves, tp=3 loads the adapter back.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import tempfile
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

ARCH = "qwen3_moe"  # experts (E, 2I, H), no biases
ARCH_BIASED = "gpt_oss"  # experts transposed, interleaved gate/up, biases


def _nonzero_b(model: nn.Module) -> None:
    """Every adapter's B drawn whole (seeded by name) and sliced as this rank holds it."""
    from quantmesh.tp.experts import ShardedExperts
    from quantmesh.tp.gather import tp_sharded
    from quantmesh.tp.layers import ShardedModule

    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, ShardedModule):
                continue
            split = tp_sharded(m)
            params = (
                [f"expert_lora.{t}.lora_B.weight" for t in m.expert_lora]
                if isinstance(m, ShardedExperts)
                else (["lora_B.weight"] if m.lora is not None else [])
            )
            for pname in params:
                p = m.get_parameter(pname)
                rows = split[pname][1].full if pname in split else p.shape[0]
                g = torch.Generator().manual_seed(zlib.crc32(f"{name}.{pname}".encode()))
                b = torch.randn(rows, p.shape[1], generator=g) * 0.3
                if pname in split:
                    b = torch.cat([b[a:z] for a, z in split[pname][1].ranges(m.tp_rank)])
                p.copy_(b)


def _base_bytes(model: nn.Module) -> int:
    return sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if "lora_" not in n and "expert_lora" not in n
    )


def job_save(mesh, folder: str) -> dict:
    """Default LoRA (every projection, experts included) at tp=2, B nonzero, saved, and exported
    merged (`qm.export`: the expert adapters merged into the fused tensors) to `folder`-merged."""
    import quantmesh as qm
    from tests.zoo import ZOO

    case = ZOO[ARCH]
    model = copy.deepcopy(case.build(0))
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=2, alpha=4))
    _nonzero_b(model)
    qm.save_adapter(model, folder)
    qm.export(model, f"{folder}-merged")
    with torch.no_grad():
        return {"logits": model(**case.inputs()).logits}


def job_load(mesh, folder: str) -> dict:
    import quantmesh as qm
    from quantmesh.io.adapter import adapter_lora_config
    from tests.zoo import ZOO

    case = ZOO[ARCH]
    model = copy.deepcopy(case.build(0))
    qm.parallelize(model, mesh, lora=adapter_lora_config(folder))
    qm.load_adapter(model, folder)
    with torch.no_grad():
        return {"logits": model(**case.inputs()).logits}


def job_nf4_train(mesh) -> dict:
    """nf4 experts (biased, transposed) with adapters on every projection: a few AdamW steps."""
    import bitsandbytes as bnb

    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    case = ZOO[ARCH_BIASED]
    ref = case.build(0)
    model = copy.deepcopy(ref)
    qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=4, alpha=8))
    experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
    stores = {
        type(m._parameters[t]).__name__: m.fmt.name for m in experts for t in m.tensors
    }  # the expert tensors' storage
    opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=1e-2)
    inputs = case.inputs()
    losses = []
    for _ in range(4):
        out = model(**inputs, labels=inputs["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    return {
        "losses": losses,
        "stores": stores,
        "params4bit": all(
            isinstance(m._parameters[t], bnb.nn.Params4bit) for m in experts for t in m.tensors
        ),
        "n_experts": len(experts),
    }


def job_bytes(mesh) -> dict:
    """What a rank holds of each MoE model's base (fp32, no adapters), against one process, and
    what estimate_memory says it holds."""
    import quantmesh as qm
    from quantmesh.parallel.state import parallel_state
    from tests.zoo import ZOO

    out = {}
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"):
        ref = ZOO[name].build(0)
        model = copy.deepcopy(ref)
        qm.parallelize(model, mesh)
        entries = parallel_state(model).plan.entries
        # the plan verify_plan settled on (the estimate alone does not run the probe)
        plan = {f: str(e.style) if e.split is not None else "replicate" for f, e in entries.items()}
        est = qm.estimate_memory(ref, tp=mesh.tp, seq_len=8, plan=plan).weights
        verify_kept = [f for f, e in entries.items() if "verify:" in e.reason]
        out[name] = {"fraction": _base_bytes(model) / _base_bytes(ref), "estimate": est,
                     "held": _base_bytes(model), "verify_kept": verify_kept}  # fmt: skip
    return out


def job_compiled(mesh) -> dict:
    """nf4 experts with adapters in compiled blocks (fullgraph: no graph break), against eager:
    the adapters as weight deltas and on the activations (ShardedExperts._grouped_forward)."""
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    case = ZOO["mixtral"]
    facts = {}
    for on in (False, True):
        out = {}
        for compiled in (False, True):
            model = copy.deepcopy(case.build(0))
            model.config._experts_implementation = "grouped_mm"  # the path compiled blocks take
            # r=4: a row of 4 fp32 values is the 16 bytes grouped matmuls take
            qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=4, alpha=8))
            _nonzero_b(model)
            for m in model.modules():
                if isinstance(m, ShardedExperts):
                    m.adapters_on_activations = on
            if compiled:
                assert qm.compile_blocks(model, fullgraph=True, backend="aot_eager") == 2
            y = model(**case.inputs()).logits
            y.float().pow(2).mean().backward()
            grads = [p.grad.clone() for p in qm.trainable_parameters(model)]
            out[compiled] = (y.detach(), grads)
        (y0, g0), (y1, g1) = out[False], out[True]
        facts["activations" if on else "deltas"] = {
            "logits": float((y0 - y1).abs().max()),
            "grads": max(float((a - b).abs().max()) for a, b in zip(g0, g1, strict=True)),
            "n_grads": len(g0),
        }
    return facts


def job_activations(mesh) -> dict:
    """The grouped experts forward with the adapters on the activations, against the weight-delta
    path (the reference), on every architecture: logits and every gradient, tp=2."""
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    calls = []
    grouped = ShardedExperts._grouped_forward

    def counted(self, *a):  # noqa: ANN001, ANN202
        calls.append(1)
        return grouped(self, *a)

    ShardedExperts._grouped_forward = counted  # type: ignore[method-assign]
    out = {}
    try:
        for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"):
            case = ZOO[name]
            model = copy.deepcopy(case.build(0))
            model.config._experts_implementation = "grouped_mm"
            qm.parallelize(model, mesh, lora=qm.LoraConfig(r=4, alpha=8))
            _nonzero_b(model)
            experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
            runs = {}
            for on in (True, False):
                for m in experts:
                    m.adapters_on_activations = on
                del calls[:]
                y = model(**case.inputs()).logits
                y.float().pow(2).mean().backward()
                params = qm.trainable_parameters(model)
                runs[on] = (y.detach(), [p.grad.clone() for p in params], len(calls))
                for p in params:
                    p.grad = None
            (y1, g1, n1), (y0, g0, n0) = runs[True], runs[False]
            out[name] = {
                "logits": _rel(y1, y0),
                "grads": max(_rel(a, b) for a, b in zip(g1, g0, strict=True)),
                "n_grads": len(g0),
                "grouped_calls": (n1, n0),
                "experts": len(experts),
            }
    finally:
        ShardedExperts._grouped_forward = grouped  # type: ignore[method-assign]
    return out


def job_routed(mesh) -> dict:
    """One token (decoding): nf4 experts with adapters run on the experts it routes to only, and
    give the whole path's logits and gradients."""
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts
    from tests.zoo import ZOO

    out = {}
    for name in ("mixtral", "gpt_oss"):
        case = ZOO[name]
        model = copy.deepcopy(case.build(0))
        qm.parallelize(model, mesh, quant="nf4", lora=qm.LoraConfig(r=2, alpha=4))
        _nonzero_b(model)
        experts = [m for m in model.modules() if isinstance(m, ShardedExperts)]
        ids = case.inputs()["input_ids"][:1, :1]
        runs = {}
        for routed in (True, False):
            for m in experts:
                m.routed_only, m.last_routed = routed, 0
            y = model(input_ids=ids).logits
            y.float().pow(2).mean().backward()
            grads = [p.grad.clone() for p in qm.trainable_parameters(model)]
            model.zero_grad()
            runs[routed] = (y.detach(), grads, [m.last_routed for m in experts])
        (y1, g1, n1), (y0, g0, n0) = runs[True], runs[False]
        out[name] = {
            "logits": _rel(y1, y0),
            "grads": max(_rel(a, b) for a, b in zip(g1, g0, strict=True) if b.abs().max() > 0),
            "routed": n1, "whole": n0, "experts": experts[0].num_experts,
        }  # fmt: skip
    return out


def job_refusals(mesh) -> dict:
    import quantmesh as qm
    from tests.zoo import ZOO

    out: dict = {}
    model = copy.deepcopy(ZOO[ARCH].build(0))
    try:
        qm.parallelize(model, mesh, lora=qm.LoraConfig(dropout=0.1))
    except qm.LoraError as e:
        out["dropout"] = str(e)

    class Custom(nn.Module):  # experts in a 3-D tensor of a layout quantmesh does not know
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) + torch.einsum("bi,eoi->bo", x, self.w)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm.parallelize(Custom(), mesh, quant="nf4", verify=False)
    out["warned"] = [str(w.message) for w in caught if "3 or more dims" in str(w.message)]
    return out


def _jobs(rank: int, world: int, folder: str) -> dict:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=world)
    if world == 3:
        return {"load": job_load(mesh, folder)}
    return {
        "save": job_save(mesh, folder),
        "nf4": job_nf4_train(mesh),
        "bytes": job_bytes(mesh),
        "refusals": job_refusals(mesh),
        "compiled": job_compiled(mesh),
        "routed": job_routed(mesh),
        "activations": job_activations(mesh),
    }


@functools.cache
def results() -> dict:
    """{"tp2": rank 0's results, "tp3": ..., "peft": logits of peft on the saved folder}."""
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantmesh.testing import run_ranks
    from tests.zoo import ZOO

    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/adapter"
        tp2 = run_ranks(_jobs, 2, 2, folder, timeout=900)
        tp3 = run_ranks(_jobs, 3, 3, folder, timeout=600)
        case = ZOO[ARCH]
        pm = peft.PeftModel.from_pretrained(case.build(0), folder)
        merged = AutoModelForCausalLM.from_pretrained(f"{folder}-merged")
        merged_keys = list(load_file(f"{folder}-merged/model.safetensors"))
        merged.config._experts_implementation = "eager"  # as the zoo's models run
        with torch.no_grad():
            peft_logits = pm(**case.inputs()).logits
            base_logits = case.build(0)(**case.inputs()).logits
            merged_logits = merged(**case.inputs()).logits
    return {"tp2": tp2, "tp3": tp3, "peft": peft_logits, "base": base_logits,
            "merged": merged_logits, "merged_keys": merged_keys}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_saved_expert_adapter_is_peft_format_and_loads_at_another_tp() -> None:
    r = results()
    saved = r["tp2"][0]["save"]["logits"]
    assert _rel(r["base"], saved) > 0.05  # the adapters (experts included) change the output
    assert _rel(saved, r["peft"]) < 1e-5  # peft.PeftModel.from_pretrained: the same model
    for rank in r["tp3"]:
        assert _rel(rank["load"]["logits"], saved) < 1e-5  # load_adapter at tp=3


def test_export_merges_the_expert_adapters() -> None:
    """qm.export at tp=2 gathers the fused expert tensors with their per-expert adapters merged
    (they had been left out without a word) and writes them one tensor per expert, as
    `save_pretrained` and the Hub store them: transformers' model of the folder gives the
    adapted model's logits."""
    r = results()
    assert _rel(r["merged"], r["tp2"][0]["save"]["logits"]) < 1e-5
    experts = [k for k in r["merged_keys"] if ".experts." in k]
    assert experts and all(k.split(".experts.")[1][0].isdigit() for k in experts), experts
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in experts, experts


def test_nf4_experts_train() -> None:
    for rank in results()["tp2"]:
        nf4 = rank["nf4"]
        assert nf4["n_experts"] == 2 and nf4["params4bit"], nf4
        assert nf4["stores"] == {"Params4bit": "nf4"}
        losses = nf4["losses"]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] - 0.1, losses
    assert results()["tp2"][0]["nf4"]["losses"] == results()["tp2"][1]["nf4"]["losses"]


def test_rank_holds_its_share_of_the_base_and_the_estimate_says_so() -> None:
    facts = results()["tp2"][0]["bytes"]
    for name, f in facts.items():
        assert f["estimate"] == f["held"], (name, f)
        # 1/2 + the replicated rest (norms, routers, embeddings' rest); 24 expert features
        # (Qwen3-MoE's, gpt-oss') are cut 16 / 8 (groups of 8 for grouped_mm): 0.633 / 0.636
        if not f["verify_kept"]:
            assert f["fraction"] <= 0.64, (name, f)
    # none is kept whole: OLMoE's q / k norms over all heads take their statistic over tp, and
    # gpt-oss's attention sinks (one per head) are read through each rank's heads
    assert all(not f["verify_kept"] for f in facts.values()), facts


def test_a_token_runs_only_the_experts_it_routes_to_and_gives_the_whole_paths_values() -> None:
    for name, r in results()["tp2"][0]["routed"].items():
        assert r["whole"] == [0] * len(r["whole"]), (name, r)  # the whole path: no routed run
        # top-2 of 4 experts: every block ran on the 2 it routes to
        assert r["routed"] == [2] * len(r["routed"]) and r["experts"] == 4, (name, r)
        assert r["logits"] < 1e-5 and r["grads"] < 1e-5, (name, r)


def test_refusals_name_the_fix() -> None:
    ref = results()["tp2"][0]["refusals"]
    assert "dropout=0.1" in ref["dropout"] and "use dropout=0" in ref["dropout"]
    assert ref["warned"], ref
    assert "stay whole and in float on every rank: w (" in ref["warned"][0]


def _pp_loss(rank: int, pp: int, folder: str) -> tuple[float, float]:
    """A step's loss with every adapter's B nonzero (experts included), the adapter saved to
    `folder`, and the loss of a fresh model with that adapter loaded, at pp stages."""
    import quantmesh as qm
    from quantmesh.io.adapter import adapter_lora_config
    from tests.zoo import ZOO

    mesh = qm.init_mesh(pp=pp)
    case = ZOO["mixtral"]
    model = copy.deepcopy(case.build(0))
    qm.parallelize(model, mesh, lora=qm.LoraConfig(r=2, alpha=4), quant="nf4")
    _nonzero_b(model)
    ids = case.inputs()["input_ids"]
    batch = {"input_ids": ids, "labels": ids}
    loss = float(qm.train_step(model, batch, microbatches=2))
    qm.save_adapter(model, folder)
    fresh = copy.deepcopy(case.build(0))
    qm.parallelize(fresh, mesh, lora=adapter_lora_config(folder), quant="nf4")
    qm.load_adapter(fresh, folder)
    return loss, float(qm.train_step(fresh, batch, microbatches=2))


def test_pipeline_stages_cut_through_moe_blocks() -> None:
    """The other stages learn an MoE block's output shape on meta tensors, where the routing (by
    values) cannot run: pp=2 trains like pp=1, nf4 experts with adapters. The adapter saved at
    pp=2 (the experts' from every stage: refused before) is pp=1's, tensor for tensor, and loads
    back at pp=2."""
    from safetensors.torch import load_file

    from quantmesh.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        (one,) = run_ranks(_pp_loss, 1, 1, f"{tmp}/pp1", timeout=300)
        two = run_ranks(_pp_loss, 2, 2, f"{tmp}/pp2", timeout=300)
        files = [load_file(f"{tmp}/pp{n}/adapter_model.safetensors") for n in (1, 2)]
        configs = [json.loads(Path(f"{tmp}/pp{n}/adapter_config.json").read_text()) for n in (1, 2)]
    assert two == [one, one], (one, two)
    assert one[1] == one[0]  # loaded back: the same step
    assert sorted(files[0]) == sorted(files[1]) and any(".experts." in k for k in files[0])
    for k, v in files[0].items():
        assert torch.equal(files[1][k], v), k
    assert configs[1] == configs[0] and configs[0]["target_parameters"], configs


def test_grouped_experts_add_their_adapters_on_the_activations_like_the_weight_deltas() -> None:
    for rank in results()["tp2"]:
        for name, f in rank["activations"].items():
            assert f["experts"] > 0 and f["n_grads"] > 0, (name, f)
            # on the new path the grouped forward ran twice per experts module (forward, and its
            # recompute in backward: activation checkpointing), never on the old one
            assert f["grouped_calls"] == (2 * f["experts"], 0), (name, f)
            assert f["logits"] < 1e-5 and f["grads"] < 1e-4, (name, f)


def test_compiled_blocks_trace_nf4_experts_with_adapters() -> None:
    for rank in results()["tp2"]:
        for path, c in rank["compiled"].items():
            assert c["n_grads"] > 0 and c["logits"] < 1e-5 and c["grads"] < 1e-5, (path, c)


def _grouped_tp3(rank: int, folder: str) -> tuple[list, torch.Tensor]:
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts

    model = qm.from_pretrained(folder, qm.init_mesh(tp=3), progress=False)
    assert model.config._experts_implementation == "grouped_mm"
    experts = next(m for m in model.modules() if isinstance(m, ShardedExperts))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 33, 12, 7, 40, 22]])).logits
    return [tuple(p.shape) for p in experts.parameters()], logits


def test_experts_split_in_groups_that_grouped_mm_takes(tmp_path):
    """grouped_mm refuses strides that are not a multiple of 16 bytes: 40 intermediate features
    over tp 3 were cut 14 / 13 / 13 and failed deep in transformers' forward; now 16 / 16 / 8."""
    import quantmesh as qm
    from quantmesh.testing import run_ranks
    from tests.moe_folders import moe_dir

    folder = moe_dir("mixtral", tmp_path / "m", intermediate_size=40)
    res = run_ranks(_grouped_tp3, 3, str(folder), timeout=300)
    assert [shapes for shapes, _ in res] == [
        [(4, 32, 32), (4, 32, 16)], [(4, 32, 32), (4, 32, 16)], [(4, 16, 32), (4, 32, 8)]
    ]  # fmt: skip
    one = qm.from_pretrained(folder, qm.init_mesh(tp=1), progress=False)
    with torch.no_grad():
        want = one(torch.tensor([[1, 5, 9, 33, 12, 7, 40, 22]])).logits
    got = res[0][1]
    assert float((got - want).abs().max() / want.abs().max()) < 2e-6


def _grouped_tp2(rank: int, folder: str) -> tuple[list, str | None, torch.Tensor]:
    import quantmesh as qm
    from quantmesh.tp.experts import ShardedExperts

    model = qm.from_pretrained(folder, qm.init_mesh(tp=2), progress=False)
    assert model.config._experts_implementation == "grouped_mm"
    experts = next(m for m in model.modules() if isinstance(m, ShardedExperts))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 33, 12, 7, 40, 22]])).logits
    return [tuple(p.shape) for p in experts.parameters()], experts.split_reason, logits


def test_experts_with_no_cut_in_groups_of_8_stay_whole_and_say_so(tmp_path):
    """20 intermediate features have no cut over tp 2 that grouped_mm takes (10 / 10 failed deep
    in transformers' forward: strides not a multiple of 16 bytes): the experts stay whole on every
    rank, as at tp 1, and the plan's row says why."""
    import quantmesh as qm
    from quantmesh.testing import run_ranks
    from quantmesh.tp.experts import expert_rows
    from tests.moe_folders import moe_dir

    folder = moe_dir("mixtral", tmp_path / "m", intermediate_size=20)
    res = run_ranks(_grouped_tp2, 2, str(folder), timeout=300)
    for shapes, reason, _ in res:
        assert shapes == [(4, 40, 32), (4, 32, 20)], shapes
        assert reason is not None and "groups of 8" in reason, reason
    one = qm.from_pretrained(folder, qm.init_mesh(tp=1), progress=False)
    with torch.no_grad():
        want = one(torch.tensor([[1, 5, 9, 33, 12, 7, 40, 22]])).logits
    assert float((res[0][2] - want).abs().max() / want.abs().max()) < 2e-6
    (row,) = expert_rows(one, 2)[:1]
    assert "experts whole on every rank: 20 intermediate features cannot be cut" in row[4], row
