"""AdapterBank: many PEFT LoRA adapters on one parallelized base, chosen per batch row.

Every ShardedModule that carries LoRA gets, in place of its one `LoraAdapter`, a banked adapter
(`set_adapter`): `slots` adapters stacked on a leading dimension, sharded exactly as the module's
own adapter was (colwise base: A whole, B split on its rows; rowwise base: A split on its columns,
B whole; see lora/adapter.py's `lora_splits`). Slot 0 is the base model: zeros. The rows of a batch read the slot ids set with
`set_rows`; a batch whose rows all use one slot runs the same `F.linear` calls as a model with that
one adapter loaded (`quantmesh generate --adapter`). A mixed batch runs one matmul per factor over
the span of slots it uses, whatever the number of rows: A of every slot in the span at once (each
row then keeps its own r outputs), and B of the span on a vector that holds each row's r values in
its slot's block and zeros elsewhere. The adapter weights are read once per step, not once per
row.

Adapters of lower rank than the bank's are zero-padded (exact: the padded products are zeros);
adapters may target any subset of the bank's modules (the others get zeros in that slot). Each
adapter's own scale (lora_alpha / r) is applied per row after B, as the plain layer does.

Example:
    >>> bank = AdapterBank(model, slots=8)                    # doctest: +SKIP
    >>> bank.load(1, "out/adapter")                           # doctest: +SKIP  (every tp rank)
    >>> bank.set_rows([0, 1, 1]); logits = model(ids).logits   # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..io.adapter import _adapter_weights, _peft_key, _read_adapter_config, _shape_problems
from ..io.reader import open_checkpoint
from ..lora.adapter import Adapter, LoraError, lora_splits
from ..tp.layers import ShardedModule, sharded_modules

__all__ = ["AdapterBank", "AdapterInfo"]


@dataclass(frozen=True)
class AdapterInfo:
    """What a PEFT adapter folder holds, checked against a bank (no tensor data read)."""

    path: str
    r: int
    scale: float
    modules: tuple[str, ...]


class _BankedLora(Adapter):
    """One layer's adapters of every slot, in the interface of a layer's adapter: each row of a
    batch reads its own slot's A and B, and its B output is times its slot's scale. No dropout.

    `a_bank` (slots, r, in_local or in) and `b_bank` (out_local or out, slots, r): a span of slots
    is one (w * r, in) A and one (out, w * r) B."""

    a_bank: torch.Tensor
    b_bank: torch.Tensor

    def __init__(self, bank: AdapterBank, a_bank: torch.Tensor, b_bank: torch.Tensor) -> None:
        super().__init__()
        self.bank = [bank]  # a list: not a child module
        self.register_buffer("a_bank", a_bank, persistent=False)
        self.register_buffer("b_bank", b_bank, persistent=False)
        if a_bank.device.type == "cuda":  # not the layer's buffers: CUDA graphs read them in place
            torch._dynamo.mark_static_address(a_bank, guard=False)
            torch._dynamo.mark_static_address(b_bank, guard=False)

    @property
    def r(self) -> int:
        return int(self.a_bank.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.a_bank.dtype

    def down(self, x: torch.Tensor) -> torch.Tensor:  # (b, t, in) -> (b, t, r)
        x = self.cast_in(x)
        bank, w = self.bank[0], self.a_bank
        if bank.uniform == 0:  # the base everywhere: no adapter work (y + 0 is y)
            return x.new_zeros(*x.shape[:-1], w.shape[1])
        if bank.uniform is not None:
            return F.linear(x, w[bank.uniform])
        # every slot in use at once: (b, t, in) @ (w * r, in)^T, then each row keeps its own block
        lo, hi = bank.span
        r = w.shape[1]
        both = F.linear(x, w[lo:hi].reshape(-1, w.shape[2]))  # (b, t, w * r)
        both = both.view(*x.shape[:-1], hi - lo, r)  # (b, t, w, r)
        pick = bank.rel.view(-1, *([1] * (x.dim() - 1)), 1).expand(*x.shape[:-1], 1, r)
        return both.gather(-2, pick).squeeze(-2)  # (b, t, r)

    def up(self, a: torch.Tensor) -> torch.Tensor:  # (b, t, r) -> (b, t, out), times the scales
        bank, w = self.bank[0], self.b_bank
        out_f, _, r = w.shape
        if bank.uniform == 0:
            return a.new_zeros(*a.shape[:-1], out_f)
        if bank.uniform is not None:
            return F.linear(a, w[:, bank.uniform]) * bank.scales[bank.uniform]
        # each row's a in its slot's block of a (b, t, w * r) vector, zeros elsewhere: one matmul
        # with the span's B (the zero blocks add exact zeros)
        lo, hi = bank.span
        z = a.new_zeros(*a.shape[:-1], hi - lo, r)  # (b, t, w, r)
        pick = bank.rel.view(-1, *([1] * (a.dim() - 1)), 1).expand(*a.shape[:-1], 1, r)
        z.scatter_(-2, pick, a.unsqueeze(-2))
        y = F.linear(z.flatten(-2), w[:, lo:hi].reshape(out_f, -1))  # (b, t, out)
        scale = bank.scale_t.index_select(0, bank.ids).to(y.dtype)  # (b,)
        return y * scale.view(-1, *([1] * (y.dim() - 1)))


class AdapterBank:
    """`slots` adapters (slot 0: the base) on every LoRA-carrying module of a parallelized model.

    The model must have been parallelized with `lora=LoraConfig(r=R, targets=...)`: the modules and
    the rank R of that config are the bank's (adapters of rank <= R on any subset of those
    modules fit). Building the bank replaces each module's adapter by a banked one (`set_adapter`;
    the LoraAdapter's values are discarded).

    Example:
        >>> model = qm.from_pretrained(path, mesh, lora=qm.LoraConfig(r=16))  # doctest: +SKIP
        >>> bank = AdapterBank(model, slots=4)                               # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}; expected >= 1 (slot 0 is the base model)")
        experts = [
            f for f, m in sharded_modules(model).items() if len(getattr(m, "expert_lora", ()))
        ]
        if experts:  # per-row weight deltas of experts: not banked, and never silently dropped
            raise ValueError(
                f"adapters on expert tensors ({experts[0]}, ...) cannot be served per request "
                "yet: an expert adapter is a weight delta that the bank does not switch per row; "
                "serve adapters on the attention / dense projections, or generate with "
                "`quantmesh generate --adapter` (one adapter)"
            )
        loras = {f: ad for f, m in sharded_modules(model).items() if (ad := m.lora) is not None}
        self.mods: dict[str, ShardedModule] = {
            f: m for f, m in sharded_modules(model).items() if f in loras
        }
        self.slots = slots
        self.r = max((ad.r for ad in loras.values()), default=0)
        self.scales = [0.0] * slots  # host copy, for the uniform path
        dev = next((ad.lora_A.weight.device for ad in loras.values()), torch.device("cpu"))
        self.scale_t = torch.zeros(slots, device=dev)  # (slots,)
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)  # (batch,) slot of each row
        self.span = (0, 1)  # the slots [lo, hi) a mixed batch uses
        self.rel = self.ids  # (batch,) each row's slot - lo
        self.uniform: int | None = 0
        self.device = dev
        self._fixed: torch.Tensor | None = None  # (max rows,) row slots of compiled steps
        self.banked: dict[str, _BankedLora] = {}
        for f, m in self.mods.items():
            a, b = loras[f].lora_A.weight, loras[f].lora_B.weight  # (r, in_x), (out_x, r)
            bank_a = a.new_zeros(slots, *a.shape).requires_grad_(False)  # (slots, r, in_x)
            bank_b = b.new_zeros(b.shape[0], slots, b.shape[1]).requires_grad_(
                False
            )  # (out_x, slots, r)
            self.banked[f] = _BankedLora(self, bank_a, bank_b)
            m.set_adapter(self.banked[f])  # the per-adapter scales are applied by its `up`

    # ---- rows ---------------------------------------------------------------------------------
    def set_rows(self, slots: list[int], fixed: int | None = None) -> None:
        """The slot of each row of the next forward calls (host list; no device sync).

        `fixed`: the largest batch a compiled step runs: the rows then always take the mixed path
        over every slot, their ids in one buffer of that many rows, so that one compiled graph
        serves every mix of adapters (the Python branches a compiler specializes on stay put).

        Example:
            >>> bank.set_rows([0, 2, 2])  # doctest: +SKIP
        """
        if fixed is not None:
            if self._fixed is None or self._fixed.shape[0] != fixed:
                self._fixed = torch.zeros(fixed, dtype=torch.long, device=self.device)
                torch._dynamo.mark_static_address(self._fixed, guard=False)
            self._fixed[: len(slots)].copy_(
                torch.tensor(slots, dtype=torch.long), non_blocking=True
            )
            self.uniform = None
            self.span = (0, self.slots)
            self.ids = self.rel = self._fixed[: len(slots)]
            return
        first = slots[0] if slots else 0
        self.uniform = first if all(s == first for s in slots) else None
        if self.uniform is None:
            lo, hi = min(slots), max(slots) + 1
            ids = torch.tensor(slots, dtype=torch.long)
            self.span = (lo, hi)
            self.ids = ids.to(self.device, non_blocking=True)
            self.rel = (ids - lo).to(self.device, non_blocking=True)

    # ---- adapters -----------------------------------------------------------------------------
    def inspect(self, path: str | os.PathLike) -> AdapterInfo:
        """Check that the PEFT adapter at `path` fits the bank (config and shapes; no data read).

        Raises LoraError / FileNotFoundError naming the fix.

        Example:
            >>> bank.inspect("out/adapter").r  # doctest: +SKIP
            8
        """
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"adapter folder {str(folder)!r} does not exist; pass a folder written by "
                "quantmesh finetune (OUTPUT/adapter) or by peft's save_pretrained"
            )
        cfg = _read_adapter_config(folder)
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        if not self.mods:
            raise LoraError(
                "the server has no LoRA modules; restart it with --adapter NAME=DIR or "
                "--lora-targets to serve adapters"
            )
        if r > self.r:
            raise LoraError(
                f"adapter {str(folder)!r} has r={r}, more than the server's --max-lora-rank "
                f"{self.r}; restart with --max-lora-rank {r}"
            )
        problems = []
        with open_checkpoint(_adapter_weights(folder), key_map=_peft_key) as reader:
            keys = set(reader.keys())
            fqns = sorted({k.rsplit(".", 2)[0] for k in keys if ".lora_" in k})
            other = sorted(k for k in keys if ".lora_A." not in k and ".lora_B." not in k)
            if other:
                problems.append(f"tensors other than lora_A/lora_B: {other[:5]}")
            outside = [f for f in fqns if f not in self.mods]
            if outside:
                problems.append(
                    f"modules the server has no LoRA on: {outside[:5]} (restart with "
                    "--lora-targets naming them)"
                )
            for f in fqns:
                m = self.mods.get(f)
                if m is None:
                    continue
                problems += _shape_problems(f, r, m.in_full, m.out_full, keys, reader)
        if problems:
            base = cfg.get("base_model_name_or_path")
            raise LoraError(
                f"adapter {str(folder)!r} does not fit the served model: "
                + "; ".join(problems[:5])
                + f". It was trained on {base!r}; serve that model, or an adapter trained on this one"
            )
        return AdapterInfo(path=str(folder), r=r, scale=alpha / r, modules=tuple(fqns))

    @torch.no_grad()
    def load(self, slot: int, path: str | os.PathLike) -> AdapterInfo:
        """Read this rank's slices of the adapter at `path` into `slot` (every tp rank calls it;
        no collective). Modules the adapter does not target get zeros in that slot.

        Example:
            >>> bank.load(1, "out/adapter")  # doctest: +SKIP
        """
        if not 0 < slot < self.slots:
            raise ValueError(f"slot {slot}; expected 1..{self.slots - 1} (0 is the base)")
        info = self.inspect(path)
        r = info.r
        with open_checkpoint(_adapter_weights(Path(info.path)), key_map=_peft_key) as reader:
            for fqn, m in self.mods.items():
                a_bank, b_bank = self.banked[fqn].a_bank, self.banked[fqn].b_bank
                a_bank[slot].zero_()
                b_bank[:, slot].zero_()
                if fqn not in info.modules:
                    continue
                split = lora_splits(m.style, m.split)  # the module's own (replaced) adapter's
                for name, dest in (("lora_A.weight", a_bank[slot, :r, :]),
                                   ("lora_B.weight", b_bank[:, slot, :r])):  # fmt: skip
                    dim, fs = split.get(name, (None, None))
                    ranges = fs.ranges(m.tp_rank) if fs is not None else None
                    dest.copy_(reader.read(f"{fqn}.{name}", dim, ranges, dtype=dest.dtype,
                                           device=dest.device))  # fmt: skip
        self.scales[slot] = info.scale
        self.scale_t[slot] = info.scale
        return info
