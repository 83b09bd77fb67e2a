"""TP-aware LoRA: A and B sharded as derived from the base layer's style.

  colwise base (output split):  A (r, in) whole, applied before the copy-to-tp op; B (out_local, r)
  rowwise base (input split):   A (r, in_local) split on in; its partial sums are reduced together
                                with the base output in one all-reduce; B (out, r) whole
  replicated base:              A and B whole

A is drawn from the full logical (r, in) tensor with a generator seeded by (seed, module name), then
sliced: tp=1 and tp=4 start from identical adapters. B starts at zero (PEFT's default), so a fresh
adapter leaves the model's outputs unchanged.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .plan.styles import Style, slice_dim

if TYPE_CHECKING:
    from .tp.layers import ShardedModule

__all__ = ["LoraConfig", "LoraError", "attach_lora", "lora_targets", "trainable_parameters"]


class LoraError(ValueError):
    """A LoRA request that cannot be honoured; the message names the fix."""


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on linear layers (plain or quantized), sharded to follow the base layer.

    Example:
        >>> LoraConfig(r=16, alpha=32, dropout=0.05, targets=["q_proj", "v_proj"])
        LoraConfig(r=16, alpha=32, ...)
    """

    r: int = 16
    """Rank of the adapter (A is r x in, B is out x r)."""
    alpha: float = 32
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""
    targets: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Module names (a bare name matches any module of that name) or globs on full names."""
    seed: int = 0
    """Seed of A's initialization; the same seed gives the same adapters at any tp size."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise LoraError(f"LoRA rank r={self.r!r}; use a positive int such as 8 or 16")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoRA dropout={self.dropout}; use a value in [0, 1)")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if not self.targets:
            raise LoraError("LoRA targets is empty; name modules such as ['q_proj', 'v_proj']")
        self.targets = list(self.targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def matches(self, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        return any(t == last or t == fqn or fnmatch.fnmatchcase(fqn, t) for t in self.targets)


def lora_targets(model: nn.Module, config: LoraConfig) -> list[str]:
    """FQNs of the modules `config.targets` selects; raises when a target matches nothing.

    Example:
        >>> lora_targets(model, LoraConfig(targets=["q_proj"]))  # doctest: +SKIP
        ['model.layers.0.self_attn.q_proj', ...]
    """
    names = [n for n, _ in model.named_modules() if n]
    found = [n for n in names if config.matches(n)]
    for t in config.targets:
        if not any(t == n.rsplit(".", 1)[-1] or t == n or fnmatch.fnmatchcase(n, t) for n in names):
            leaves = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if n and isinstance(m, nn.Linear)
                }
            )
            raise LoraError(
                f"LoRA target {t!r} matches no module of {type(model).__name__}; linear layer "
                f"names in this model: {', '.join(leaves[:20])}"
            )
    return found


def _init_A(fqn: str, r: int, in_full: int, seed: int) -> torch.Tensor:
    """The full (r, in_full) A of module `fqn`: kaiming-uniform as PEFT does, from its own seed."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63)
    a = torch.empty(r, in_full)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def attach_lora(
    module: ShardedModule,
    config: LoraConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Give a ShardedModule `lora_A`, `lora_B` and `lora_dropout`, sharded to follow its style.

    Example:
        >>> attach_lora(sharded_q_proj, LoraConfig(r=8), device="cpu")  # doctest: +SKIP
    """
    if not module.kind.linear_like:
        raise LoraError(
            f"{module.fqn} is a {module.kind.name}; LoRA applies to linear layers only; remove it "
            f"from LoraConfig(targets=...)"
        )
    r = config.r
    a_full = _init_A(module.fqn, r, module.in_full, config.seed)  # (r, in)
    if module.style == Style.ROWWISE:
        assert module.split is not None  # rowwise splits its input
        a = slice_dim(a_full, 1, module.split.ranges(module.tp_rank))  # (r, in_local)
        out_b = module.out_full
    else:
        a = a_full
        out_b = module.out_local  # colwise: B split on out; replicate: whole
    module.lora_A = nn.Linear(a.shape[1], r, bias=False, device=device, dtype=dtype)
    module.lora_B = nn.Linear(r, out_b, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        module.lora_A.weight.copy_(a)
        module.lora_B.weight.zero_()
    module.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
    module.lora_scale = config.scaling
    module.lora_r = r


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should see: those with requires_grad (LoRA adapters by default).

    Example:
        >>> opt = torch.optim.AdamW(qm.trainable_parameters(model), lr=2e-4)  # doctest: +SKIP
    """
    return [p for p in model.parameters() if p.requires_grad]
