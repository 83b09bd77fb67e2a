"""Dropout masks under tensor parallelism: the same on every rank for whole activations, per rank
for split ones.

Every rank starts from the same generator state (torch's default seed, or the same
torch.manual_seed), and whole activations draw the same amounts, so their masks agree. A split region
(between a colwise input and the rowwise output) draws per-rank amounts: uneven splits (2+2+1+1 heads)
would leave the ranks' generators apart, and every later mask on a whole activation (residual dropout,
LoRA dropout of a colwise layer) would differ per rank, so replicated parameters would get different
gradients and drift apart.

So the sharded layers mark the regions: the colwise writer enters, the rowwise reader (or the gather)
leaves. The two calls are in different modules, so the model's root forward hook `close_all` (set by
qm.parallelize, run also when the forward raises) restores the shared stream if a forward stopped
inside a region: no rank is ever left on its private stream. Each parallelized model has its own
RngRegions (held in its ParallelState); nothing here is global.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch

__all__ = ["RngRegions"]


class RngRegions:
    """The split regions of one model's tp layers, per device.

    `enter` saves the shared state and switches to a stream of this rank's own, seeded from the
    shared state and the rank (so activation checkpointing, which replays the shared state, replays
    these masks too); `exit` restores the shared state, untouched by the region's draws.
    `replicated()` draws from the shared stream inside a region; `close_all` leaves every region.

    Example:
        >>> rng = RngRegions()
        >>> rng.enter(torch.device("cpu"), rank=1); rng.exit(torch.device("cpu"))
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

    def close_all(self, *_: object) -> None:
        """Leave every open region (a forward hook: called after the model's forward, or when it
        raised)."""
        for device in list(self._shared):
            self.exit(device)
