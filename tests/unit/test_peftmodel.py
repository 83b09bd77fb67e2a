"""What parallelize refuses of a peft-wrapped model, before touching it (quantmesh.lora.peft)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantmesh.lora.adapter import LoraConfig, LoraError
from quantmesh.lora.peft import inner_model, is_peft_model, unwrap_peft


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_lora_is_unwrapped_into_base_layers_and_one_config():
    import peft

    torch.manual_seed(0)
    pm = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, lora_alpha=6, lora_dropout=0.1,
                                                     target_modules=["up", "down"],
                                                     init_lora_weights=False))  # fmt: skip
    a_up = pm.base_model.model.up.lora_A["default"].weight.detach().clone()
    assert is_peft_model(pm) and isinstance(inner_model(pm), Tiny)
    got = unwrap_peft(pm, None)
    assert got is not None
    assert (got.config.r, got.config.alpha, got.config.dropout) == (2, 6.0, 0.1)
    assert sorted(got.config.targets) == ["down", "up"]
    assert torch.equal(got.weights["up"]["lora_A.weight"], a_up)
    assert type(inner_model(pm).up) is nn.Linear  # the base layer is back at its name


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p.IA3Config(target_modules=["up", "down"], feedforward_modules=["down"]),
         "the model is a peft IA3 model"),
        (lambda p: p.LoraConfig(r=2, target_modules=["up"], use_dora=True), "uses DoRA"),
    ],
)  # fmt: skip
def test_other_peft_methods_are_refused_with_the_fix(make, match):
    import peft

    pm = peft.get_peft_model(Tiny(), make(peft))
    with pytest.raises(LoraError, match=match) as e:
        unwrap_peft(pm, None)
    assert "merge_and_unload()" in str(e.value)
    assert "BaseTunerLayer" in {c.__name__ for c in type(inner_model(pm).up).__mro__}  # untouched


def test_lora_argument_with_peft_adapters_is_refused():
    import peft

    pm = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["up"]))
    with pytest.raises(LoraError, match="carries peft LoRA adapters already"):
        unwrap_peft(pm, LoraConfig(r=2, targets=["up"]))


def test_rewrap_puts_peft_layers_back():
    import peft

    from quantmesh.lora.peft import rewrap

    pm = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["up", "down"]))
    before = dict(inner_model(pm).named_children())
    got = unwrap_peft(pm, None)
    assert got is not None and type(inner_model(pm).up) is nn.Linear
    rewrap(pm, got)  # what parallelize does when a later check refuses the model
    assert dict(inner_model(pm).named_children()) == before
