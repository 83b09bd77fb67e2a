"""Offloaded activations: the tensors a checkpointed block saves for backward live in host memory,
copied out on a side stream while the forward goes on and back one block ahead of the backward that
needs them.

`checkpoint_blocks(model, offload=True)` wraps each block's checkpoint in `Offloader.block()`. The
checkpoint saves only the block's inputs, so those are what move. torch's own `save_on_cpu` copies
on the compute stream, both ways: the forward waits for each copy out, and the backward of block i
waits for its inputs to come back before it can recompute. Here both copies run on a side stream:

    forward  block i:   compute ─────────────►        (copy of block i's inputs to host, beside it)
    backward block i:   wait for i's inputs, then start copying block i-1's back, then recompute i

so in steady state the copy back of block i-1 runs under block i's recompute and backward. One
block's inputs live on the device ahead of need. On CPU (tests) the same bookkeeping runs with
host copies and no streams, so which saved tensor comes back where is checked there too.

Example:
    >>> off = Offloader()                                     # doctest: +SKIP
    >>> with off.block():                                     # doctest: +SKIP
    ...     y = checkpoint(block, x, use_reentrant=False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["Offloader"]


class _Group:
    """The tensors one block call saved, and the group saved just before it (the previous block)."""

    __slots__ = ("items", "prev")

    def __init__(self, prev: _Group | None) -> None:
        self.items: list[_Saved] = []
        self.prev = prev


class _Saved:
    """One saved tensor: its host copy, the event that says the copy is done, its way back."""

    __slots__ = ("device", "host", "copied", "source", "back", "arrived", "group", "used")

    def __init__(self, device: torch.device, group: _Group) -> None:
        self.device = device
        self.host: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None  # host copy complete
        self.source: torch.Tensor | None = None  # the device tensor, kept until copied
        self.back: torch.Tensor | None = None  # the prefetched device copy
        self.arrived: torch.cuda.Event | None = None
        self.group = group
        self.used = False  # unpacked once: no prefetch for it any more


class Offloader:
    """saved_tensors_hooks that keep saved tensors in (pinned) host memory and prefetch them back
    one block ahead of backward; one per model (the chain of blocks is per model)."""

    def __init__(self) -> None:
        self._last: _Group | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[_Saved] = []  # device tensors whose host copy may still be running

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Everything saved for backward inside is offloaded, as one block's group."""
        prev = self._last
        if prev is not None and all(s.used for s in prev.items):
            prev = None  # its backward ran (or it saved nothing): nothing to fetch ahead of
        group = _Group(prev)
        self._last = group
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            yield

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _release_copied(self) -> None:
        still = []
        for s in self._pending:
            if s.copied is not None and s.copied.query():
                s.source = None  # the host copy is complete: the device memory may go
            else:
                still.append(s)
        self._pending = still

    def _pack(self, t: torch.Tensor, group: _Group) -> _Saved:
        saved = _Saved(t.device, group)
        group.items.append(saved)
        if t.device.type != "cuda":
            saved.host = t.detach().clone()  # CPU ranks: same bookkeeping, a plain copy
            return saved
        self._release_copied()
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        with torch.cuda.stream(side):
            saved.host = torch.empty_like(t, device="cpu", pin_memory=True)
            saved.host.copy_(t, non_blocking=True)
            saved.copied = torch.cuda.Event()
            saved.copied.record(side)
        saved.source = t  # alive until the copy is done (the compute stream may free it)
        self._pending.append(saved)
        return saved

    def _fetch(self, saved: _Saved) -> None:
        """Start the copy back on the side stream (no-op if started or on CPU)."""
        if saved.used or saved.back is not None or saved.device.type != "cuda":
            return
        assert saved.host is not None
        side = self._stream(saved.device)
        with torch.cuda.stream(side):
            if saved.copied is not None:
                side.wait_event(saved.copied)
            saved.back = saved.host.to(saved.device, non_blocking=True)
            saved.arrived = torch.cuda.Event()
            saved.arrived.record(side)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        assert saved.host is not None
        prev, saved.group.prev = saved.group.prev, None  # the chain ends here: no leak over steps
        if saved.device.type != "cuda":
            saved.used = True
            return saved.host
        saved.used = False  # a second backward (retain_graph) copies it back again
        self._fetch(saved)  # not prefetched (the last block): now
        assert saved.back is not None and saved.arrived is not None
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(saved.arrived)
        t = saved.back
        t.record_stream(current)  # made on the side stream, used (and freed) on this one
        saved.back, saved.source, saved.used = None, None, True
        if prev is not None:  # one block ahead: its copy back runs under this block's backward
            for s in prev.items:
                self._fetch(s)
        return t
