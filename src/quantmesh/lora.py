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

import contextlib
import fnmatch
import math
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import DEFAULT_TARGETS, LoraConfig, LoraError
from .plan.styles import Style, slice_dim

if TYPE_CHECKING:
    from .tp.layers import ShardedModule

__all__ = [
    "AdapterStack",
    "LoraConfig",
    "LoraError",
    "attach_lora",
    "lora_targets",
    "stack_sibling_adapters",
    "trainable_parameters",
]


def lora_targets(model: nn.Module, config: LoraConfig, extra: list[str] | None = None) -> list[str]:
    """FQNs of the modules (and of the `extra` tensor names: expert tensors) `config.targets`
    selects; raises when a target given explicitly matches nothing, or the default nothing at all.

    Example:
        >>> lora_targets(model, LoraConfig(targets=["q_proj"]))  # doctest: +SKIP
        ['model.layers.0.self_attn.q_proj', ...]
    """
    names = [n for n, _ in model.named_modules() if n] + list(extra or [])
    found = [n for n in names if config.matches(n)]
    default = sorted(config.targets) == sorted(DEFAULT_TARGETS)
    for t in config.targets if not (default and found) else []:
        if default:
            t = ", ".join(DEFAULT_TARGETS)
        if not any(t == n.rsplit(".", 1)[-1] or t == n or fnmatch.fnmatchcase(n, t) for n in names):
            leaves = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if n and isinstance(m, nn.Linear)
                }
            )
            what = (
                f"the default LoRA targets ({t}) match" if default else f"LoRA target {t!r} matches"
            )
            raise LoraError(
                f"{what} no module of {type(model).__name__}; linear layer "
                f"names in this model: {', '.join(leaves[:20])}; pass LoraConfig(targets=[...])"
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


class AdapterStack:
    """The adapters of sibling layers that read one tensor (q, k, v; gate, up), as two matmuls.

    `x @ [A_1; ...; A_n]^T` gives every sibling's (..., r) at once, and that times the
    block-diagonal of B_1 ... B_n every sibling's (..., out_i): each sibling then adds its own slice,
    times its own scale. The zero blocks add exact zeros, so each slice is that sibling's
    `B_i(A_i(x))`, up to the order in which the matmul sums. Made for the decode step, where
    2n small matmuls per group cost more in launches than their bytes (`fast_decode` builds the
    stacks from its eager prefill and refreshes them before each call).

    The stack holds copies of the weights (`refresh` copies them in again, in place) and is used
    only while `active`, without autograd, and by siblings that get the very tensor the first one
    got; any other call takes the sibling's own adapter.

    Example:
        >>> with stack_sibling_adapters(model) as stacks:  # doctest: +SKIP
        ...     model(input_ids=ids)   # one eager forward: who reads what
        >>> len(stacks)                # q/k/v and gate/up of each block  # doctest: +SKIP
        4
    """

    def __init__(self, members: list[ShardedModule]) -> None:
        self.members = members
        self.ranks = [int(m.lora_A.weight.shape[0]) for m in members]
        self.outs = [int(m.lora_B.weight.shape[0]) for m in members]
        self.out_at = [sum(self.outs[:i]) for i in range(len(members))]
        self.active = False
        self.x: torch.Tensor | None = None  # the input of this forward's first sibling
        self.out: torch.Tensor | None = None  # (..., sum of outs): every sibling's B(A(x))
        self.a = torch.empty(0)
        self.b = torch.empty(0)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the members' current A and B in (in place, so a captured CUDA graph reads them)."""
        w = self.members[0].lora_A.weight
        r_at = [sum(self.ranks[:i]) for i in range(len(self.members) + 1)]
        a_shape = (r_at[-1], int(w.shape[1]))
        b_shape = (sum(self.outs), r_at[-1])
        if self.a.shape != a_shape or self.a.dtype != w.dtype or self.a.device != w.device:
            self.a = torch.empty(a_shape, dtype=w.dtype, device=w.device)
            self.b = torch.zeros(b_shape, dtype=w.dtype, device=w.device)
            if w.device.type == "cuda":  # fixed addresses: CUDA graphs read them, never copy them
                torch._dynamo.mark_static_address(self.a)
                torch._dynamo.mark_static_address(self.b)
        for i, m in enumerate(self.members):
            self.a[r_at[i] : r_at[i + 1]].copy_(m.lora_A.weight)
            o = self.out_at[i]
            self.b[o : o + self.outs[i], r_at[i] : r_at[i + 1]].copy_(m.lora_B.weight)

    def delta(
        self, i: int, x: torch.Tensor, cast: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """Member `i`'s `B(A(x))` (..., out_i), or None when `x` is not the tensor the first member
        got in this forward; `cast` turns x into what the adapters take (`_lora_in`)."""
        d = None
        if i == 0:
            self.x = x
            a = F.linear(cast(x), self.a)  # (..., sum of ranks)
            self.out = F.linear(a, self.b)  # (..., sum of outs)
        if self.x is x and self.out is not None:
            o = self.out_at[i]
            d = self.out[..., o : o + self.outs[i]]
        if i == len(self.members) - 1:  # the last sibling: hold no tensor past this forward
            self.x = self.out = None
        return d


def _stackable(m: nn.Module) -> bool:
    """A layer whose adapter sees the whole input as it comes (not a rowwise shard of it), with
    plain weights (FSDP's sharded DTensors are gathered only inside the forward)."""
    from torch.distributed.tensor import DTensor

    a, b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
    return (
        getattr(m, "lora_scale", None) is not None
        and isinstance(a, nn.Linear)
        and isinstance(b, nn.Linear)
        and not isinstance(a.weight, DTensor)
        and not isinstance(b.weight, DTensor)
        and getattr(m, "style", None) not in (Style.ROWWISE, Style.VOCAB)
    )


@contextlib.contextmanager
def stack_sibling_adapters(model: nn.Module) -> Iterator[list[AdapterStack]]:
    """Find, during the one eager forward run inside the block, the adapter layers that read the
    same tensor one after another, and give each such group an `AdapterStack` (attached to its
    members as `lora_stack`, inactive). The list it yields is filled when the block ends.

    A layer called more than once in that forward, or whose adapter has another dtype than the
    first of its run, is left out; a run whose adapters sit on several devices gets no stack.
    Earlier stacks of the model are dropped first.

    Example:
        >>> with stack_sibling_adapters(model) as stacks:  # doctest: +SKIP
        ...     model(input_ids=ids)
    """
    mods: list[Any] = [m for m in model.modules() if _stackable(m)]  # ShardedModules
    for old in model.modules():
        if getattr(old, "lora_stack", None) is not None:
            cast(Any, old).lora_stack = None
    runs: list[list[Any]] = []
    seen: dict[int, int] = {}
    last: list[torch.Tensor | None] = [None]

    def pre(mod: Any, args: tuple) -> None:
        x = args[0] if args else None
        seen[id(mod)] = seen.get(id(mod), 0) + 1
        if not isinstance(x, torch.Tensor):
            last[0] = None
            return
        w = mod.lora_A.weight
        first = runs[-1][0] if runs and last[0] is x else None
        if first is not None and first.lora_A.weight.dtype == w.dtype:
            runs[-1].append(mod)
        else:
            runs.append([mod])
            last[0] = x

    handles = [m.register_forward_pre_hook(pre) for m in mods]
    stacks: list[AdapterStack] = []
    try:
        yield stacks
    finally:
        for h in handles:
            h.remove()
        last[0] = None
    for run in runs:
        members = [m for m in run if seen[id(m)] == 1]
        if len(members) < 2 or len({m.lora_A.weight.device for m in members}) > 1:
            continue
        stack = AdapterStack(members)
        for i, m in enumerate(members):
            m.lora_stack, m.lora_stack_index = stack, i
        stacks.append(stack)
