"""Cutting a model into pipeline stages of whole repeated blocks, and dropping what a rank does not
hold.

The repeated blocks (`blocks_of`, the same ones the planner and compile_blocks see) are split into
`pp` consecutive runs; every other module with parameters belongs to the stage of the block before
it in the model's module order (embeddings -> the first stage, final norm and head -> the last).
Modules without parameters (rotary tables, dropout) are kept on every stage: each stage runs the
model's own root forward, so what the model computes from the inputs for every block (positions,
masks, rotary embeddings) is computed by the model itself on every stage.

A module that belongs to another stage is replaced in its parent by a `StandIn`, a module without
parameters that keeps the original (on the meta device, not as a child: no name of the kept parts
changes) and, when the root forward reaches it, runs the original on meta tensors for its output
shapes and returns NaN tensors of those shapes. The stage's first block then gets the activation
received from the previous stage in place of its hidden-state input, so the NaN never enters the
stage's math; if any of it did (a value computed by another stage's module that reaches the blocks
by another path), the stage's output is NaN and the first step says so (`stage.py`).

Example:
    >>> cut = plan_stages(model, pp=2)      # doctest: +SKIP
    >>> cut.blocks                          # doctest: +SKIP
    [['model.layers.0', 'model.layers.1'], ['model.layers.2', 'model.layers.3']]
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..config import PipelineConfig, PipelineError
from ..plan.auto import blocks_of
from ..plan.plan import Resolved
from ..plan.styles import balanced_counts

__all__ = [
    "PipelineConfig",
    "PipelineError",
    "StageCut",
    "StandIn",
    "check_ties",
    "drop_others",
    "plan_stages",
    "stage_plan",
]


@dataclass
class StageCut:
    """Where every part of a model goes: `blocks[s]` are stage s's block names, `owner` maps the
    name of each placed module (a block, or a module with parameters outside the blocks) to its
    stage. `pp` is the number of stages, `ranks` the pp ranks they live on (stage s on rank
    s % ranks)."""

    pp: int
    blocks: list[list[str]]
    owner: dict[str, int] = field(default_factory=dict)
    ranks: int = 0

    def __post_init__(self) -> None:
        self.ranks = self.ranks or self.pp

    def local(self, rank: int) -> list[int]:
        """The stages pp rank `rank` holds, in order."""
        return [s for s in range(self.pp) if s % self.ranks == rank]

    def stage_of(self, fqn: str) -> int | None:
        """The stage of module `fqn` (or of the placed module it is inside); None if unplaced."""
        best, found = -1, None
        for k, s in self.owner.items():
            if (fqn == k or fqn.startswith(k + ".")) and len(k) > best:
                best, found = len(k), s
        return found

    def modules_of(self, stage: int) -> list[str]:
        """Placed module names of `stage`, in model order."""
        return [k for k, s in self.owner.items() if s == stage]


def _matmul_elems(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if p.dim() >= 2)


def _compute_balanced(model: nn.Module, blocks: list[str], pp: int) -> list[int]:
    """Blocks per stage minimizing the most expensive stage (module docstring of PipelineConfig).

    Example:
        >>> _compute_balanced(model, [f"layers.{i}" for i in range(4)], 2)  # doctest: +SKIP
        [2, 2]
    """
    cost = [_matmul_elems(model.get_submodule(b)) for b in blocks]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tail = _matmul_elems(head) if isinstance(head, nn.Module) else 0
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the least largest stage cost of blocks[:i] cut into k stages (the last of them
    # ending at i); choice[k][i]: where that last stage starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    choice = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            extra = tail if k == pp else 0
            for j in range(k - 1, i):  # the k-th stage holds blocks[j:i]
                worst = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if worst < best[k][i]:
                    best[k][i], choice[k][i] = worst, j
    counts, i = [], n
    for k in range(pp, 0, -1):
        j = choice[k][i]
        counts.append(i - j)
        i = j
    counts.reverse()

    def largest(cs: list[int]) -> float:
        ends = [sum(cs[: k + 1]) for k in range(pp)]
        starts = [0, *ends[:-1]]
        return max(prefix[e] - prefix[b] + (tail if k == pp - 1 else 0)
                   for k, (b, e) in enumerate(zip(starts, ends, strict=True)))  # fmt: skip

    even = balanced_counts(n, pp)  # equal counts, extras first: kept whenever it is as good
    return even if largest(even) <= largest(counts) else counts


def plan_stages(model: nn.Module, pp: int, config: PipelineConfig | None = None) -> StageCut:
    """Cut `model` into `pp` stages of whole repeated blocks; raises PipelineError when it cannot.

    Example:
        >>> cut = plan_stages(model, pp=2, config=PipelineConfig(stages=[3, 1]))  # doctest: +SKIP
    """
    ranks = pp
    pp = pp * (config.virtual if config is not None else 1)  # the number of stages
    blocks = [n for n, _ in blocks_of(model)]
    if not blocks:
        raise PipelineError(
            f"pp={pp}: {type(model).__name__} has no repeated blocks (no nn.ModuleList of layers), "
            f"so it cannot be cut into pipeline stages; use pp=1 (tp and dp still apply)"
        )
    lists = {b.rsplit(".", 1)[0] for b in blocks}
    if len(lists) > 1:
        raise PipelineError(
            f"pp={pp}: {type(model).__name__} has several block lists ({', '.join(sorted(lists))}; "
            f"an encoder and a decoder?): the pipeline cuts one stack of blocks; use pp=1"
        )
    counts = config.stages if config is not None and config.stages is not None else None
    if counts is None:
        if len(blocks) < pp:
            raise PipelineError(
                f"{pp} stages (pp={ranks}"
                + (f" x virtual={pp // ranks}" if pp != ranks else "")
                + f") but {type(model).__name__} has {len(blocks)} blocks; every stage needs at "
                f"least one: use pp{' x virtual' if pp != ranks else ''} <= {len(blocks)}"
            )
        counts = _compute_balanced(model, blocks, pp)
    else:
        counts = list(counts)
        if len(counts) != pp or sum(counts) != len(blocks) or min(counts) < 1:
            raise PipelineError(
                f"PipelineConfig(stages={counts}): expected {pp} counts >= 1 summing to the "
                f"model's {len(blocks)} blocks, e.g. stages={balanced_counts(len(blocks), pp)}"
            )
    per_stage: list[list[str]] = []
    it = iter(blocks)
    for c in counts:
        per_stage.append([next(it) for _ in range(c)])
    owner: dict[str, int] = {b: s for s, bs in enumerate(per_stage) for b in bs}
    order = [n for n, _ in model.named_modules()]
    pos = {n: i for i, n in enumerate(order)}
    for n, m in model.named_modules():
        if not n or n in owner or any(n.startswith(k + ".") for k in owner):
            continue
        if any(n == lst or lst.startswith(n + ".") for lst in lists):
            if any(True for _ in m.parameters(recurse=False)):
                names = [p for p, _ in m.named_parameters(recurse=False)]
                raise PipelineError(
                    f"pp={pp}: {n or type(model).__name__} holds parameters directly "
                    f"({', '.join(names)}) and also contains the blocks, so no stage can own "
                    f"them; move them into a submodule, or use pp=1"
                )
            continue  # a container of the blocks: not placed
        if not any(True for _ in m.parameters()):
            continue  # no parameters: kept (and run) on every stage
        before = [b for b in blocks if pos[b] < pos[n]]
        owner[n] = owner[before[-1]] if before else 0
    for pname, _ in model.named_parameters(recurse=False):
        raise PipelineError(
            f"pp={pp}: the root module holds parameter {pname!r} directly, so no stage can own it; "
            f"move it into a submodule, or use pp=1"
        )
    return StageCut(pp=pp, blocks=per_stage, owner=owner, ranks=ranks)


def check_ties(model: nn.Module, cut: StageCut, trainable: bool) -> None:
    """A parameter shared by modules of two stages (an input embedding tied to the head) is held
    by both; each would compute its own half of the gradient, so a trainable one is refused."""
    where: dict[int, list[tuple[str, int]]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        s = cut.stage_of(fqn)
        for pname, p in mod._parameters.items():
            if p is not None and s is not None:
                where.setdefault(id(p), []).append((f"{fqn}.{pname}", s))
    for holders in where.values():
        stages = sorted({s for _, s in holders})
        if (
            len(stages) > 1
            and trainable
            and any(model.get_parameter(n).requires_grad for n, _ in holders)
        ):
            names = ", ".join(f"{n} (stage {s})" for n, s in holders)
            raise PipelineError(
                f"the trainable parameter shared by {names} spans pipeline stages; its gradient "
                f"would be split between them. Freeze it (train LoRA adapters), untie it "
                f"(tie_word_embeddings=False), or use pp=1"
            )


# ----------------------------------------------------------------------------------------------
# running another stage's module as a stand-in

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "quantmesh_pipeline_stage", default=None
)


@contextlib.contextmanager
def active(runner: Any) -> Iterator[None]:
    """Mark `runner` (a stage.StageModule) as the stage running now on this thread."""
    token = _ACTIVE.set(runner)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> Any:
    return _ACTIVE.get()


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    return x


class StandIn(nn.Module):
    """Another stage's module, by shape only: outputs NaN (floats) or zeros of the right shapes.
    The shapes come from running the original on meta tensors once per input signature (shapes,
    dtypes, plain values), then from a cache."""

    def __init__(self, fqn: str, original: nn.Module, stage: int, device: torch.device) -> None:
        super().__init__()
        self.fqn = fqn
        self.stage = stage
        self.device = device
        object.__setattr__(self, "_original", original)  # not a child: no names, no parameters
        self._outputs: dict[tuple, tuple[list, Any]] = {}  # input signature -> output leaves, spec

    @property
    def original(self) -> nn.Module:
        """The module this stands in for (its parameters on meta)."""
        return self.__dict__["_original"]

    def extra_repr(self) -> str:
        return f"{self.fqn} on pipeline stage {self.stage}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if current() is None:
            raise PipelineError(
                f"{self.fqn} lives on pipeline stage {self.stage}, not on this rank; at pp > 1 run "
                f"the model through qm.train_step (each rank runs its own stage)"
            )
        leaves, spec = tree_flatten((args, kwargs))
        key = _signature(leaves, spec)
        hit = self._outputs.get(key) if key is not None else None
        if hit is None:
            hit = tree_flatten(self._shapes(args, kwargs))
            if key is not None:  # the same input shapes give the same output shapes
                self._outputs[key] = hit
        out_leaves, out_spec = hit

        def real(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            fill = float("nan") if t.dtype.is_floating_point else 0
            return torch.full(t.shape, fill, dtype=t.dtype, device=self.device)

        return tree_unflatten([real(t) for t in out_leaves], out_spec)

    def _shapes(self, args: tuple, kwargs: dict) -> Any:
        """The original's output on meta tensors (shapes and dtypes only)."""
        import torch.fx.experimental._config as fx_config

        from ..tp.kinds import expert_tensors

        margs, mkwargs = tree_map(_to_meta, (args, kwargs))
        # a mixture of experts routes tokens by their values (nonzero, .item()), which meta
        # tensors do not have: an experts module's output has its input's shape, so on meta it
        # gives just that; other data-dependent sizes are taken as their largest (only the
        # output's shape is read)
        experts = [m for m in self.original.modules() if expert_tensors(m) is not None]
        for m in experts:
            m.forward = _same_shape  # an instance attribute, deleted below
        try:
            with torch.no_grad(), cast(Any, fx_config).patch(meta_nonzero_assume_all_nonzero=True):
                return self.original(*margs, **mkwargs)
        except Exception as e:  # the shapes are all we need; a module that cannot give them
            raise PipelineError(
                f"{self.fqn} (pipeline stage {self.stage}) must run on meta tensors on the other "
                f"stages to give its output shapes, and it raised {type(e).__name__}: {e}; this "
                f"model cannot be cut there (try other PipelineConfig(stages=...), or pp=1)"
            ) from e
        finally:
            for m in experts:
                del m.forward


def _same_shape(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An experts module's output on meta: the shape of its input."""
    return torch.zeros_like(x)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _signature(leaves: list, spec: Any) -> tuple | None:
    """A hashable key of a call's input structure, shapes and plain values; None when an input is
    neither a tensor nor a plain value (a cache object): such calls are not cached."""
    key: list = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.device))
        elif isinstance(x, _PLAIN):
            key.append((type(x), x))
        else:
            return None
    return tuple(key)


def drop_others(
    model: nn.Module, cut: StageCut, stages: int | list[int], device: torch.device
) -> dict[int, dict[str, StandIn]]:
    """Replace every placed module not of `stages` (this rank's) by a StandIn (its parameters and
    buffers on meta; a parameter also held by a kept module stays with it). With several local
    stages, returns for each the StandIns of the other local stages' modules, which its
    StageModule swaps in while it runs (made now, while the modules are plain: meta copies)."""
    keep = {stages} if isinstance(stages, int) else set(stages)
    swaps: dict[int, dict[str, StandIn]] = {s: {} for s in keep}
    if len(keep) > 1:
        for fqn, s in cut.owner.items():
            if s in keep:
                for other in keep - {s}:
                    swaps[other][fqn] = StandIn(
                        fqn, _meta_copy(model.get_submodule(fqn)), s, device
                    )
    for fqn, s in list(cut.owner.items()):
        if s in keep:
            continue
        mod = model.get_submodule(fqn)
        for sub in mod.modules():
            for k, p in list(sub._parameters.items()):
                if p is not None:
                    # a fresh meta tensor: the original (maybe shared with a kept module) is untouched
                    meta = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                    sub._parameters[k] = meta
            for k, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[k] = torch.empty_like(b, device="meta")
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent._modules[child] = StandIn(fqn, mod, s, device)
    return swaps


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are on meta (nothing real is copied)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def stage_plan(
    model: nn.Module, resolved: Resolved, wrap: dict[str, dict]
) -> tuple[Resolved, dict]:
    """The whole model's resolved plan and wrap list, kept to the modules this stage still holds
    (decisions are the whole model's: a tie split alike on both stages stays alike)."""
    present = {n for n, m in model.named_modules() if not isinstance(m, StandIn)}
    entries = {k: e for k, e in resolved.entries.items() if k in present}
    attrs = {k: v for k, v in resolved.attr_updates.items() if k in present}
    views = {k: v for k, v in resolved.head_views.items() if k in present}
    norms = {k: v for k, v in resolved.split_norms.items() if k in present}
    return Resolved(resolved.tp, entries, attrs, views, norms), {
        k: v for k, v in wrap.items() if k in present
    }
