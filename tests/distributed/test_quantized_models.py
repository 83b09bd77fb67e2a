"""Models as users build them before asking for parallelism: linears swapped for bitsandbytes
Linear4bit (real nf4 weights on CPU) and wrapped by peft's `get_peft_model` (LoRA), a custom
architecture and a transformers Llama loaded with `quantization_config`; `qm.parallelize` takes
them as they are at tp=2 x dp=2 and trains to the one-process losses; `qm.save_adapter` writes
what peft's own `save_pretrained` writes for the one-process model after the same steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantmesh.testing import run_ranks

from ._io_cases import llama_dir, token_ids

STEPS = 3
LR = 1e-2
LOSS_TOL = 1e-5  # relative: summation order of the split matmuls (fp32)
ADAPTER_TOL = 1e-4  # absolute, on adapter values of magnitude ~0.1 after 3 Adam steps


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A custom model: embedding projection, two residual MLP blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _to_nf4(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Swap the named linears for bitsandbytes Linear4bit, quantized on CPU by bitsandbytes."""
    import bitsandbytes as bnb

    for fqn, lin in list(model.named_modules()):
        if fqn.rsplit(".", 1)[-1] not in names:
            continue
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=True, quant_type="nf4",
                              compress_statistics=True, compute_dtype=torch.float32)  # fmt: skip
        q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True, module=q)  # fmt: skip
        q.bias = nn.Parameter(lin.bias.data.clone())
        q = q.to("cpu")  # Params4bit quantizes when moved to a device
        q.support_avx512bf16_for_cpu = False
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    return model


def _peft(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, cfg)


def _base(which: str, path: str) -> nn.Module:
    """The user's quantized model before peft."""
    if which == "custom":
        torch.manual_seed(0)
        return _to_nf4(Net(), ("up", "down"))
    return llama_base(path)


def llama_base(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, device_map="cpu")
    for m in model.modules():
        if type(m).__name__ == "Linear4bit":
            m.support_avx512bf16_for_cpu = False
    return model


def _data(which: str) -> torch.Tensor:
    if which == "custom":
        return torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    return token_ids(batch=4)


def _loss(which: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if which == "custom":
        target = torch.sin(x[:, :16])
        return nn.functional.mse_loss(model(x), target)
    return model(input_ids=x, labels=x).loss


def _train(which: str, model: nn.Module, x: torch.Tensor) -> list[float]:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = _loss(which, model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _build(which: str, path: str) -> nn.Module:
    targets = ["up", "down"] if which == "custom" else ["q_proj", "v_proj", "down_proj"]
    return _peft(_base(which, path), targets)


def _ranks(rank: int, which: str, path: str, out: str) -> dict:
    import quantmesh as qm
    from quantmesh.parallel.state import parallel_state

    mesh = qm.init_mesh(dp=2, tp=2)
    model = _build(which, path)
    x = _data(which)
    half = x.shape[0] // 2
    mine = x[mesh.dp_rank * half : (mesh.dp_rank + 1) * half]
    ex = (x[:2],) if which == "custom" else None
    qm.parallelize(model, mesh, example_inputs=ex)
    kinds = sorted({type(m).__name__ for m in model.modules()})
    losses = _train(which, model, mine)
    qm.save_adapter(model, out)
    st = parallel_state(model)  # the root PeftModel carries the state
    split = sorted(e.fqn for e in st.plan.sharded())
    return {"dp": mesh.dp_rank, "losses": losses, "kinds": kinds, "split": split}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("qmodels")
    return str(llama_dir(root / "llama", hidden=256, heads=8, kv=4, head_dim=32, inter=256,
                         bias=False))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("which", ["custom", "llama"])
def test_bnb_peft_model_trains_like_one_process(tmp_path, llama, which):
    from peft import PeftModel
    from safetensors.torch import load_file

    ref = _build(which, llama)
    ref_losses = _train(which, ref, _data(which))
    ref.save_pretrained(tmp_path / "peft")  # what peft itself writes

    facts = run_ranks(_ranks, 4, which, llama, str(tmp_path / "qm"), timeout=300)
    for f in facts:
        assert "ShardedModule" in f["kinds"] and "Linear4bit" not in f["kinds"]
        assert "LoraLayer" not in f["kinds"]  # peft's layers became quantmesh's
    # the quantized, adapted layers really are split over tp (not replicated)
    want = ["up", "down"] if which == "custom" else ["q_proj", "v_proj", "down_proj"]
    assert {s.rsplit(".", 1)[-1] for s in facts[0]["split"]} >= set(want)
    for step in range(STEPS):
        got = sum(f["losses"][step] for f in facts) / 4  # tp ranks agree; dp halves averaged
        print(which, step, got, ref_losses[step], abs(got - ref_losses[step]) / ref_losses[step])
        assert abs(got - ref_losses[step]) <= LOSS_TOL * abs(ref_losses[step]), (
            step,
            got,
            ref_losses,
        )
    assert ref_losses[-1] < ref_losses[0]  # it trained

    ours, theirs = (
        load_file(tmp_path / "qm/adapter_model.safetensors"),
        load_file(tmp_path / "peft/adapter_model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs) and len(ours) > 0
    for k, v in theirs.items():
        assert ours[k].shape == v.shape and (ours[k] - v).abs().max() <= ADAPTER_TOL, k
    print("adapter max diff", max(float((ours[k] - v).abs().max()) for k, v in theirs.items()))
    # peft opens our folder onto a fresh base and computes what the trained one-process model does
    loaded = PeftModel.from_pretrained(_base(which, llama), tmp_path / "qm").eval()
    x = _data(which)
    with torch.no_grad():
        a = loaded(x) if which == "custom" else loaded(input_ids=x).logits
        b = ref.eval()(x) if which == "custom" else ref.eval()(input_ids=x).logits
    print("peft-loaded vs trained", float((a - b).abs().max() / b.abs().max()))
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()
