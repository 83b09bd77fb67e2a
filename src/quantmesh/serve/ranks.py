"""How rank 0 drives the other tp ranks: one broadcast of the step's Plan, then the same work.

Rank 0 decides every step (serve/scheduler.py) and broadcasts its `Plan` to the tp group's ranks
over a host (gloo) group of their own, so that sending a plan never waits for rank 0's device
(a step may still be running there: the step is asynchronous); the other ranks only follow:
receive, execute, repeat, until a plan says stop. The model's own tp
collectives then run in the same order on every rank. While idle, rank 0 sends an empty plan every
few seconds, so that a follower never sits in one broadcast for longer than the group's timeout,
and a dead rank is noticed.

Example:
    >>> if mesh.tp_rank == 0: scheduler.run()          # doctest: +SKIP
    >>> else: follow(batch, mesh.tp_group, src=0)       # doctest: +SKIP
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .engine import Batch, Plan

__all__ = ["Lockstep", "control_group", "follow"]

CONTROL_TIMEOUT = timedelta(minutes=10)
"""The plan group's timeout (init_mesh's default for the world's): rank 0's heartbeat plans
every two seconds keep a follower well within it."""


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group of `group`'s ranks for the plans (None when there is one rank). Every rank of
    the world calls it at the same point, with the same group (creation is collective; a
    server's world is its one tp group).

    Example:
        >>> control_group(None) is None
        True
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)


class Lockstep:
    """The tp group seen from the serving loop: plan broadcast and agreement on load results.

    `control`: the group plans travel over (a gloo group of the same ranks: `control_group`);
    None: `group` itself, the plan staged on `device`.

    Example:
        >>> ls = Lockstep(mesh.tp_group, mesh.device, control_group(mesh.tp_group))  # doctest: +SKIP
        >>> plan = ls.broadcast(plan)                   # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.device = device
        self.control = control

    def broadcast(self, plan: Plan | None) -> Plan:
        """Rank 0 passes its plan; the others pass None and get it."""
        if self.size == 1:
            assert plan is not None
            return plan
        box: list[Plan | None] = [plan]
        if self.control is not None:  # on the host: no wait for the device's queued work
            dist.broadcast_object_list(box, src=self.src, group=self.control)
        else:
            dev = self.device if self.device.type == "cuda" else None
            dist.broadcast_object_list(box, src=self.src, group=self.group, device=dev)
        out = box[0]
        assert out is not None
        return out

    def share(self, t: torch.Tensor) -> None:
        """Rank 0's `t` to every rank, in place (on the device: no host waits for it)."""
        if self.size > 1:
            dist.broadcast(t, src=self.src, group=self.group)

    def agree(self, ok: list[bool]) -> list[bool]:
        """Element-wise AND of `ok` over the ranks."""
        if self.size == 1 or not ok:
            return ok
        t = torch.tensor([int(k) for k in ok], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(k) for k in t.tolist()]


def follow(batch: Batch, lockstep: Lockstep) -> None:
    """A follower rank's loop: execute rank 0's plans until one says stop.

    Example:
        >>> follow(batch, Lockstep(mesh.tp_group, mesh.device))  # doctest: +SKIP
    """
    while True:
        plan = lockstep.broadcast(None)
        if plan.stop:
            return
        batch.execute(plan)
