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

Adapters on expert tensors (PEFT's `target_parameters`) are banked too: a slot's copy of an
expert is an expert of its own (`_BankedExpertLora.route` renumbers each token's routing ids by its
row's slot), so the experts module's own loop runs every (slot, expert) pair on its tokens; see
tp/experts.py.

Adapters of lower rank than the bank's are zero-padded (exact: the padded products are zeros);
adapters may target any subset of the bank's modules (the others get zeros in that slot). Each
adapter's own scale (lora_alpha / r) is applied per row after B, as the plain layer does.

Example:
    >>> bank = AdapterBank(model, slots=8)                    # doctest: +SKIP
    >>> bank.load(1, "out/adapter")                           # doctest: +SKIP  (every tp rank)
    >>> bank.set_rows([0, 1, 1]); logits = model(ids).logits   # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import lora_scale
from ..infer.decode import sibling_runs
from ..io.adapter import (
    _adapter_weights,
    _is_expert_key,
    _key_problems,
    _peft_key,
    _read_adapter_config,
    _shape_problems,
    expert_shapes,
    peft_expert_keys,
    targets_parameter,
)
from ..io.reader import CheckpointReader, open_checkpoint
from ..lora.adapter import (
    Adapter,
    ExpertLora,
    Factors,
    LoraError,
    expert_products,
    lora_splits,
)
from ..plan.styles import Style
from ..tp.experts import ShardedExperts
from ..tp.layers import ShardedModule, sharded_modules
from .host import upload

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
        self.stack: _BankStack | None = None  # its siblings' stack (`AdapterBank.stack_siblings`)
        self.index = 0  # its place in the stack

    @property
    def r(self) -> int:
        return int(self.a_bank.shape[1])

    def shortcut(self, x: torch.Tensor) -> torch.Tensor | None:
        st = self.stack
        if st is None or not st.active or torch.is_grad_enabled():
            return None
        return st.delta(self.index, x, self.cast_in)

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


class _BankStack:
    """The banked adapters of sibling layers that read one tensor (q, k, v; gate, up), as one A
    matmul and one B matmul a forward instead of two per sibling (as decoding's `AdapterStack`,
    over every slot): A of the n siblings stacked to (slots, n * r, in), B block-diagonal to
    (sum of outs, slots, n * r). Each sibling's `a_bank` / `b_bank` become views of these, so
    `AdapterBank.load` writes both. The zero blocks add exact zeros: each sibling's slice is its
    own delta, up to the order in which the matmuls sum."""

    def __init__(self, bank: AdapterBank, members: list[_BankedLora]) -> None:
        self.bank, self.members = bank, members
        a0 = members[0].a_bank  # (slots, r, in)
        slots, r, fin = (int(s) for s in a0.shape)
        n = len(members)
        self.outs = [int(m.b_bank.shape[0]) for m in members]
        self.out_at = [sum(self.outs[:i]) for i in range(n)]
        self.a = a0.new_zeros(slots, n * r, fin)
        self.b = a0.new_zeros(sum(self.outs), slots, n * r)
        for i, m in enumerate(members):
            a_view = self.a[:, i * r : (i + 1) * r]
            b_view = self.b[self.out_at[i] : self.out_at[i] + self.outs[i], :, i * r : (i + 1) * r]
            a_view.copy_(m.a_bank)
            b_view.copy_(m.b_bank)
            m.a_bank, m.b_bank = a_view, b_view
            m.stack, m.index = self, i
        if a0.device.type == "cuda":  # CUDA graphs read them in place
            for t in (self.a, self.b, *(w for m in members for w in (m.a_bank, m.b_bank))):
                torch._dynamo.mark_static_address(t, guard=False)
        self.active = True
        self.x: torch.Tensor | None = None  # the input of this forward's first sibling
        self.out: torch.Tensor | None = None  # (..., sum of outs): every sibling's delta

    def delta(
        self, i: int, x: torch.Tensor, cast: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor | None:
        """Sibling `i`'s scaled delta (..., out_i), or None when `x` is not the tensor the first
        sibling got in this forward."""
        d = None
        if i == 0:
            self.x = x
            self.out = self._all(cast(x))
        if self.x is x and self.out is not None:
            o = self.out_at[i]
            d = self.out[..., o : o + self.outs[i]]
        if i == len(self.members) - 1:  # the last sibling: hold no tensor past this forward
            self.x = self.out = None
        return d

    def _all(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., sum of outs), scaled
        bank = self.bank
        if bank.uniform == 0:  # the base everywhere
            return x.new_zeros(*x.shape[:-1], self.b.shape[0])
        if bank.uniform is not None:
            u = bank.uniform
            return F.linear(F.linear(x, self.a[u]), self.b[:, u]) * bank.scales[u]
        # every row keeps its slot's n * r outputs of A (zeros in the other slots' blocks), then
        # one matmul with the span's B (as _BankedLora's down and up, for the n siblings at once)
        lo, hi = bank.span
        nr = self.a.shape[1]
        both = F.linear(x, self.a[lo:hi].reshape(-1, self.a.shape[2]))  # (..., w * n * r)
        both = both.view(*x.shape[:-1], hi - lo, nr)
        pick = bank.rel.view(-1, *([1] * (x.dim() - 1)), 1).expand(*x.shape[:-1], 1, nr)
        z = torch.zeros_like(both).scatter_(-2, pick, both.gather(-2, pick))
        y = F.linear(z.flatten(-2), self.b[:, lo:hi].reshape(self.b.shape[0], -1))
        scale = bank.scale_t.index_select(0, bank.ids).to(y.dtype)  # (b,)
        return y * scale.view(-1, *([1] * (y.dim() - 1)))


class _BankedExpertLora(ExpertLora):
    """One expert tensor's adapters of every slot: `a_bank` (slots, E, r, in_x) and `b_bank`
    (slots, E, out_x, r), this rank's slices. Expert e of a row on slot s is expert s * E + e of
    slots * E (`route`); its delta is slot s's B_e @ A_e times slot s's scale."""

    a_bank: torch.Tensor
    b_bank: torch.Tensor

    def __init__(self, bank: AdapterBank, a_bank: torch.Tensor, b_bank: torch.Tensor) -> None:
        super().__init__()
        self.bank = [bank]  # a list: not a child module
        self.experts = int(a_bank.shape[1])
        self.register_buffer("a_bank", a_bank, persistent=False)
        self.register_buffer("b_bank", b_bank, persistent=False)
        if a_bank.device.type == "cuda":
            torch._dynamo.mark_static_address(a_bank, guard=False)
            torch._dynamo.mark_static_address(b_bank, guard=False)

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        bank, e = self.bank[0], self.experts
        if bank.uniform == 0:
            return None  # the base everywhere: the module's own experts
        units = bank.slots * e
        if bank.uniform is not None:
            slot: torch.Tensor | int = bank.uniform
        else:
            rows = bank.ids
            if ids.dim() == 0 or ids.shape[0] % rows.shape[0]:
                raise RuntimeError(
                    f"an experts forward got routing ids of shape {tuple(ids.shape)}, which do not "
                    f"split into the batch's {rows.shape[0]} rows (tokens row-major first): the "
                    "adapter bank cannot tell each token's adapter"
                )
            per = rows.repeat_interleave(ids.shape[0] // rows.shape[0])  # (tokens,)
            slot = per.view(-1, *([1] * (ids.dim() - 1)))
        valid = (ids >= 0) & (ids < e)  # other ids (a "no expert" marker) stay past the end
        return torch.where(valid, ids + e * slot, units), units

    def weight_delta(
        self,
        transposed: bool,
        experts: torch.Tensor | None,
        factors: Factors,
    ) -> torch.Tensor:
        """Slot `experts // E`'s delta of expert `experts % E`, times that slot's scale (the
        bank's buffers need no gradient: `factors` is not applied)."""
        e = self.experts
        if experts is None:  # the module's own experts: slot 0's (zeros)
            experts = torch.arange(e, device=self.a_bank.device)
        slot, ex = experts // e, experts % e
        d = expert_products(self.a_bank[slot, ex], self.b_bank[slot, ex], transposed)
        scale = self.bank[0].scale_t.index_select(0, slot).to(d.dtype)
        return d * scale.view(-1, 1, 1)


class AdapterBank:
    """`slots` adapters (slot 0: the base) on every LoRA-carrying module of a parallelized model.

    The model must have been parallelized with `lora=LoraConfig(r=R, targets=...)`: the modules and
    the rank R of that config are the bank's (adapters of rank <= R on any subset of those
    modules fit). Building the bank replaces each module's adapter by a banked one (`set_adapter`;
    the LoraAdapter's values are discarded). `dtype`: the bank's (default: the adapters'). Under
    autocast every matmul casts the bank to its dtype anyway, so a bank held in the autocast dtype
    (`engine.autocast_dtype`, what the server passes) gives the same values without a cast per
    matmul and step (docs/benchmarks.md, "Figures the code relies on").

    Example:
        >>> model = qm.from_pretrained(path, mesh, lora=qm.LoraConfig(r=16))  # doctest: +SKIP
        >>> bank = AdapterBank(model, slots=4)                               # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, slots: int, dtype: torch.dtype | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}; expected >= 1 (slot 0 is the base model)")
        layers = sharded_modules(model)
        self.experts: dict[str, ShardedExperts] = {
            f: m for f, m in layers.items() if isinstance(m, ShardedExperts) and len(m.expert_lora)
        }
        experts = {f: m.expert_adapters() for f, m in self.experts.items()}
        unrouted = [f for f, m in self.experts.items() if not hasattr(m.local, "num_experts")]
        if unrouted:  # never silently wrong: a bank needs the module's count of experts
            raise LoraError(
                f"{unrouted[0]} has adapters on its expert tensors but no `num_experts` attribute: "
                "a bank of adapters renumbers the experts per row through it; serve adapters on "
                "the attention / dense projections, or generate with one adapter"
            )
        loras = {f: ad for f, m in layers.items() if (ad := m.lora) is not None}
        self.mods: dict[str, ShardedModule] = {f: m for f, m in layers.items() if f in loras}
        self.slots = slots
        self.r = max([ad.r for ad in loras.values()]
                     + [ad.r for ads in experts.values() for ad in ads.values()], default=0)  # fmt: skip
        self.scales = [0.0] * slots  # host copy, for the uniform path
        firsts = [ad.lora_A.weight for ad in loras.values()]
        firsts += [ad.lora_A.weight for ads in experts.values() for ad in ads.values()]
        dev = firsts[0].device if firsts else torch.device("cpu")
        self.scale_t = torch.zeros(slots, device=dev)  # (slots,)
        self.ids = torch.zeros(1, dtype=torch.long, device=dev)  # (batch,) slot of each row
        self.span = (0, 1)  # the slots [lo, hi) a mixed batch uses
        self.rel = self.ids  # (batch,) each row's slot - lo
        self.uniform: int | None = 0
        self.device = dev
        self._fixed: torch.Tensor | None = None  # (max rows,) row slots of compiled steps
        self.stacks: list[_BankStack] = []  # sibling adapters run together (`stack_siblings`)
        self.runs: list[list[ShardedModule]] = []  # the sibling layers `stack_siblings` found
        self.banked: dict[str, _BankedLora] = {}
        for f, m in self.mods.items():
            a, b = loras[f].lora_A.weight, loras[f].lora_B.weight  # (r, in_x), (out_x, r)
            bank_a = a.new_zeros(slots, *a.shape, dtype=dtype).requires_grad_(False)
            bank_b = b.new_zeros(b.shape[0], slots, b.shape[1], dtype=dtype).requires_grad_(
                False
            )  # (slots, r, in_x) and (out_x, slots, r)
            self.banked[f] = _BankedLora(self, bank_a, bank_b)
            m.set_adapter(self.banked[f])  # the per-adapter scales are applied by its `up`
        self.banked_experts: dict[str, dict[str, _BankedExpertLora]] = {}
        for f, ads in experts.items():
            self.banked_experts[f] = {}
            for t, ead in ads.items():
                a, b = ead.lora_A.weight, ead.lora_B.weight  # (E*r, in_x), (out_x, E*r)
                e, r = ead.experts, ead.r
                bank_a = a.new_zeros(slots, e, r, a.shape[1], dtype=dtype)
                bank_b = b.new_zeros(slots, e, b.shape[0], r, dtype=dtype)
                banked = _BankedExpertLora(self, bank_a, bank_b)
                self.banked_experts[f][t] = banked
                self.experts[f].set_expert_adapter(t, banked)

    def pair_bytes(self) -> int:
        """Bytes of the largest experts layer's (slot, expert) weights built whole, as a compiled
        step builds them (every slot's copy of every expert, each with its delta): what it holds
        at once beyond the base, per layer. 0 without expert adapters.

        Example:
            >>> bank.pair_bytes()  # doctest: +SKIP
            1207959552
        """
        out = 0
        for e in self.experts.values():
            elems = sum(math.prod(e.local_shapes[t]) for t in e.tensors)
            out = max(
                out, 2 * self.slots * elems * e.float_dtype.itemsize
            )  # the weights and their deltas
        return out

    def stack_siblings(self, forward: Callable[[], object]) -> int:
        """Run `forward` (one eager forward of the model) and stack the banked adapters of the
        sibling layers it shows reading one tensor (q, k, v; gate, up: `_BankStack`), so that
        forwards without autograd run each group's adapters as two matmuls. Loaded adapters are
        kept; later loads reach the stacks. Returns the number of stacks (once per bank: a
        second call runs `forward` and changes nothing).

        Example:
            >>> bank.stack_siblings(lambda: model(input_ids=ids))  # doctest: +SKIP
            4
        """
        if self.stacks:
            forward()
            return len(self.stacks)
        mods = [m for m in self.mods.values() if m.style not in (Style.ROWWISE, Style.VOCAB)]
        with sibling_runs(mods, lambda first, m: True) as runs:
            forward()
        owner = {id(m): f for f, m in self.mods.items()}
        self.runs = [list(run) for run in runs]
        for run in runs:
            self.stacks.append(_BankStack(self, [self.banked[owner[id(m)]] for m in run]))
        return len(self.stacks)

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
            self._fixed[: len(slots)].copy_(upload(slots, self.device))
            self.uniform = None
            self.span = (0, self.slots)
            self.ids = self.rel = self._fixed[: len(slots)]
            return
        first = slots[0] if slots else 0
        self.uniform = first if all(s == first for s in slots) else None
        if self.uniform is None:
            lo, hi = min(slots), max(slots) + 1
            self.span = (lo, hi)
            self.ids = upload(slots, self.device)
            self.rel = self.ids - lo

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
        scale = lora_scale(alpha, r, bool(cfg.get("use_rslora")))
        if not self.mods and not self.experts:
            raise LoraError(
                "the server has no LoRA modules; restart it with --adapter NAME=DIR or "
                "--lora-targets to serve adapters"
            )
        if r > self.r:
            raise LoraError(
                f"adapter {str(folder)!r} has r={r}, more than the server's --max-lora-rank "
                f"{self.r}; restart with --max-lora-rank {r}"
            )
        params = [str(t) for t in cfg.get("target_parameters") or []]
        owners = [t.rpartition(".")[0] for t in params]
        problems = []
        with open_checkpoint(_adapter_weights(folder), key_map=_peft_key) as reader:
            keys = set(reader.keys())
            expert_keys = {k for k in keys if ".lora_" in k and _is_expert_key(k, owners)}
            fqns = sorted({k.rsplit(".", 2)[0] for k in keys - expert_keys if ".lora_" in k})
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
            tensors = self._expert_targets(params)
            wanted = set()
            for f, names in tensors.items():
                e = self.experts[f]
                for key, (t, ab) in peft_expert_keys(f, names).items():
                    wanted.add(key)
                    if t not in self.banked_experts[f]:
                        problems.append(
                            f"expert tensor {f}.{t}: the server has no LoRA on it (restart with "
                            "--lora-targets naming it)"
                        )
                        continue
                    want = expert_shapes(e, t, r)[ab]
                    of = f" (the adapter of expert tensor {f}.{t})"
                    problems += _key_problems(key, want, keys, reader, of)
            stray = sorted(expert_keys - wanted)
            if stray:
                problems.append(
                    f"expert adapters the server has no LoRA on: {stray[:5]} (restart with "
                    "--lora-targets naming their tensors)"
                )
        if problems:
            base = cfg.get("base_model_name_or_path")
            raise LoraError(
                f"adapter {str(folder)!r} does not fit the served model: "
                + "; ".join(problems[:5])
                + f". It was trained on {base!r}; serve that model, or an adapter trained on this one"
            )
        modules = tuple(fqns) + tuple(f"{f}.{t}" for f, names in tensors.items() for t in names)
        return AdapterInfo(path=str(folder), r=r, scale=scale, modules=modules)

    def _expert_targets(self, params: list[str]) -> dict[str, list[str]]:
        """{experts module: the tensors PEFT's `target_parameters` select, in the module's
        registration order (the nesting of its file keys)}."""
        out = {}
        for f, e in self.experts.items():
            names = [t for t in e.tensors if targets_parameter(params, f"{f}.{t}")]
            if names:
                out[f] = names
        return out

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
            for fqn, banked in self.banked_experts.items():
                self._load_experts(slot, info, fqn, banked, reader)
        self.scales[slot] = info.scale
        self.scale_t[slot] = info.scale
        return info

    def _load_experts(
        self, slot: int, info: AdapterInfo, fqn: str, banked: dict[str, _BankedExpertLora],
        reader: CheckpointReader,
    ) -> None:  # fmt: skip
        """Slot `slot` of experts module `fqn`'s banked tensors from the adapter file: this rank's
        slice of A (E*r, in) and B (out, E*r) laid out per expert; zeros where not targeted."""
        e = self.experts[fqn]
        names = [t for t in e.tensors if f"{fqn}.{t}" in info.modules]
        keys = {v: k for k, v in peft_expert_keys(fqn, names).items()}
        n, r = e.num_experts, info.r
        for t, b in banked.items():
            b.a_bank[slot].zero_()
            b.b_bank[slot].zero_()
            if t not in names:
                continue
            spec, split = e.tensors[t], e.splits.get(t)
            ranges = split.ranges(e.tp_rank) if split is not None else None
            # the factor on the split side follows the split (as attach_expert_lora cuts it)
            a = reader.read(keys[(t, "lora_A")], None if spec.first else 1,
                            None if spec.first else ranges, dtype=b.a_bank.dtype,
                            device=b.a_bank.device)  # fmt: skip
            w = reader.read(keys[(t, "lora_B")], 0 if spec.first else None,
                            ranges if spec.first else None, dtype=b.b_bank.dtype,
                            device=b.b_bank.device)  # fmt: skip
            b.a_bank[slot, :, :r] = a.view(n, r, -1)  # (E*r, in) -> (E, r, in)
            b.b_bank[slot, :, :, :r] = w.view(w.shape[0], r, n).permute(2, 0, 1)  # (E, out, r)
