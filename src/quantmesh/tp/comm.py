"""Autograd-aware collectives over the tp group (Megatron's f / g pair and friends).

copy_to_tp:    forward identity,              backward all-reduce   (input of a colwise layer)
reduce_from_tp: forward all-reduce,            backward identity     (output of a rowwise layer)
gather_from_tp: forward all-gather along dim,  backward keep own part (gathered colwise output)
split_to_tp:   forward keep own part,         backward all-gather   (full input into a rowwise layer)

Uneven shards are legal (9 heads on 2 ranks): gathers pad every part to the largest and trim, because
gloo has no uneven all_gather.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "all_gather_uneven",
    "copy_to_tp",
    "copy_to_tp_once",
    "CopyShare",
    "reduce_from_tp",
    "gather_from_tp",
    "split_to_tp",
    "rng_regions",
]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # A functional collective (no mutation): torch 2.11 traced the in-place form inside our
        # autograd Functions but dropped their gradients (the compiled blocks' adapters got none).
        return funcol.all_reduce(t.contiguous(), "sum", group)
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def all_gather_uneven(t: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`; rank i contributes sizes[i] entries there."""
    dim = dim % t.dim()
    width = max(sizes)
    if t.shape[dim] < width:  # pad to the largest part (gloo needs equal shapes)
        pad_shape = list(t.shape)
        pad_shape[dim] = width - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


def _own_part(t: torch.Tensor, dim: int, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t.narrow(dim, start, sizes[rank]).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, rank, group):
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, rank
        return all_gather_uneven(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _own_part(g, ctx.dim, ctx.sizes, ctx.rank), None, None, None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, rank, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _own_part(x, dim, sizes, rank)

    @staticmethod
    def backward(ctx, g):
        return all_gather_uneven(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `group` backward.

    Example:
        >>> y = local_linear(copy_to_tp(x, mesh.tp_group))  # doctest: +SKIP
    """
    return _CopyToTP.apply(x, group)


_LAST_COPY: dict[object, tuple[weakref.ref, torch.Tensor]] = {}  # group -> (input, its copy)


class CopyShare:
    """One copy_to_tp of a block input for sibling colwise layers (q, k, v; gate, up), under compile.

    `_LAST_COPY` (a module-level slot holding a weak reference) is Python state that dynamo cannot
    trace, so compiled blocks would all-reduce each sibling's input gradient separately. apply_tp
    gives the colwise sharded children of one parent module that share a tp group and an input
    width one CopyShare, and the parent a forward hook that empties it. Within the parent's forward,
    the first sibling copies its input and keeps (input, copy) here, and a sibling given the very
    same tensor (dynamo traces `is` on tensors) reuses the copy; only colwise layers of one group
    ever meet here, so a replicated reader of the tensor keeps its own gradient. Emptied at the end
    of the parent's forward, it holds no tensor between forwards: a compiled block starts and ends
    with an empty share (no extra graph inputs or outputs, no guard on a stale tensor).
    """

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def copy(self, x: torch.Tensor, group) -> torch.Tensor:
        if self.x is x:
            return self.y
        y = copy_to_tp(x, group)
        self.x, self.y = x, y
        return y

    def clear(self) -> None:
        self.x = self.y = None


def copy_to_tp_once(x: torch.Tensor, group, share: CopyShare | None = None) -> torch.Tensor:
    """copy_to_tp, shared by every colwise layer that reads the same tensor (q, k, v; gate, up).

    Autograd then sums their input gradients *before* the one all-reduce, instead of all-reducing
    each layer's gradient of x separately: 1 collective per block input instead of 3 (attention) or
    2 (gated MLP). Eagerly, one slot per group remembers the last input (weakly) and its copy
    (strongly: the copy may have no other owner between q_proj and k_proj), so at most one
    activation is held. Under torch.compile the layer's `share` (see CopyShare) does it instead;
    a layer without one gets a copy of its own there.

    Example:
        >>> q_in = copy_to_tp_once(x, g); k_in = copy_to_tp_once(x, g)  # doctest: +SKIP
        >>> q_in is k_in                                                # doctest: +SKIP
        True
    """
    if not x.requires_grad:
        return x  # no gradient to reduce
    if torch.compiler.is_compiling():
        return copy_to_tp(x, group) if share is None else share.copy(x, group)
    last = _LAST_COPY.get(group)
    if last is not None and last[0]() is x:
        return last[1]
    y = copy_to_tp(x, group)
    _LAST_COPY[group] = (weakref.ref(x), y)
    return y


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over `group` forward; gradient passed through unchanged backward.

    Example:
        >>> y = reduce_from_tp(local_linear(x_shard), mesh.tp_group)  # doctest: +SKIP
    """
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, dim: int, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Concatenate the ranks' shards along `dim` (rank i holds sizes[i]); backward keeps own part.

    Example:
        >>> logits = gather_from_tp(local_logits, -1, [24576, 24576], mesh.tp_rank, mesh.tp_group)  # doctest: +SKIP
    """
    return _GatherFromTP.apply(x, dim, list(sizes), rank, group)


def split_to_tp(x: torch.Tensor, dim: int, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Keep this rank's contiguous part of a replicated `x` along `dim`; backward all-gathers.

    Example:
        >>> x_shard = split_to_tp(x, -1, [288, 288], mesh.tp_rank, mesh.tp_group)  # doctest: +SKIP
    """
    return _SplitToTP.apply(x, dim, list(sizes), rank, group)


class RngRegions:
    """Dropout masks: the same on every rank for whole activations, per rank for split ones.

    Every rank starts from the same generator state (torch's default seed, or the same
    torch.manual_seed), and whole activations draw the same amounts, so their masks agree. A split
    region (between a colwise input and the rowwise output) draws per-rank amounts: uneven splits
    (2+2+1+1 heads) would leave the ranks' generators apart, and every later mask on a whole
    activation (residual dropout, LoRA dropout of a colwise layer) would differ per rank, so
    replicated parameters would get different gradients and drift apart. So the sharded layers
    mark the regions: `enter` saves the shared state and switches to a stream of this rank's own,
    seeded from the shared state and the rank (so activation checkpointing, which replays the
    shared state, replays these masks too); `exit` restores the shared state, untouched by the
    region's draws. `replicated()` draws from the shared stream inside a region.
    """

    def __init__(self) -> None:
        self._shared: dict[torch.device, torch.Tensor] = {}  # saved while inside a region

    @staticmethod
    def _get(device: torch.device) -> torch.Tensor:
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    @staticmethod
    def _set(device: torch.device, state: torch.Tensor) -> None:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)

    def enter(self, device: torch.device, rank: int) -> None:
        """Start (or stay in) a split region on `device`."""
        if device in self._shared:
            return
        state = self._get(device)
        seed = (zlib.crc32(state.numpy().tobytes()) + 0x9E3779B1 * (rank + 1)) % 2**63
        torch.empty(1, device=device).uniform_()  # advance the shared stream: next region differs
        self._shared[device] = self._get(device)
        own = torch.Generator(device=device)
        own.manual_seed(seed)
        self._set(device, own.get_state())

    def exit(self, device: torch.device) -> None:
        """Leave the split region: the shared stream continues where it was left."""
        state = self._shared.pop(device, None)
        if state is not None:
            self._set(device, state)

    @contextlib.contextmanager
    def replicated(self, device: torch.device) -> Iterator[None]:
        """Draw from the shared stream, inside a split region or not."""
        if device not in self._shared:
            yield
            return
        own = self._get(device)
        self._set(device, self._shared[device])
        try:
            yield
        finally:
            self._shared[device] = self._get(device)
            self._set(device, own)


rng_regions = RngRegions()
