"""The device mesh: process group, named (dp, pp, tp) axes, and device ownership checks.

One process per GPU (or per CPU rank), launched by torchrun or `quantmesh run`. A rank may own several
devices (`devices_per_rank`), the seed layout where one data-parallel replica is split over its own
GPUs; the mesh then checks the one condition that matters for DDP over such replicas: no two ranks of a
host may resolve to the same device.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import QuantmeshError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh", "MeshError", "init_mesh", "resolve_sizes"]

AXES = ("dp", "pp", "tp")  # outermost to innermost: tp groups are consecutive ranks, so on one host


class MeshError(QuantmeshError, ValueError):
    """A mesh that cannot be built as asked; the message says what was found and a valid choice."""


@dataclass
class Mesh:
    """This rank's view of the (dp, pp, tp) mesh.

    Example:
        >>> mesh = qm.init_mesh(tp=2)          # doctest: +SKIP
        >>> mesh.tp, mesh.tp_rank, mesh.device  # doctest: +SKIP
        (2, 0, device(type='cpu'))
    """

    dp: int
    pp: int
    tp: int
    rank: int
    world_size: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    devices: list[torch.device]
    backend: str
    device_mesh: DeviceMesh = field(repr=False)
    side_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    """Process groups of this rank's tp ranks that a collective helper keeps between calls
    (the plan probe's: parallel/verify.py), made on first use by every rank alike; a helper
    whose collective raised destroys its group and takes it out."""

    @property
    def device(self) -> torch.device:
        """The first device this rank owns (the only one unless devices_per_rank > 1)."""
        return self.devices[0]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    def ranks_of(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis` ("dp", "pp" or "tp"), in group order."""
        grid = self.device_mesh.mesh  # (dp, pp, tp) tensor of global ranks
        idx = {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}
        sel = [idx[a] if a != axis else slice(None) for a in AXES]
        return [int(r) for r in grid[tuple(sel)].flatten().tolist()]

    def __repr__(self) -> str:
        devs = ",".join(str(d) for d in self.devices)
        return (
            f"Mesh(rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, "
            f"pp {self.pp_rank}/{self.pp}, tp {self.tp_rank}/{self.tp}, devices [{devs}], "
            f"backend {self.backend})"
        )


def resolve_sizes(world_size: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """Resolve one -1 axis to "the rest" and check that dp * pp * tp == world_size.

    Example:
        >>> resolve_sizes(8, dp=-1, tp=2, pp=1)
        (4, 1, 2)
    """
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    for name, v in sizes.items():
        if not isinstance(v, int) or (v < 1 and v != -1):
            raise MeshError(
                f"{name}={v!r} is not a valid mesh size; use a positive int, or -1 for the rest"
            )
    free = [n for n, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise MeshError(f"only one mesh axis may be -1, got {', '.join(f'{n}=-1' for n in free)}")
    fixed = 1
    for v in sizes.values():
        fixed *= v if v != -1 else 1
    if free:
        if world_size % fixed:
            raise MeshError(
                f"world size {world_size} is not divisible by "
                f"{' * '.join(f'{n}={v}' for n, v in sizes.items() if v != -1)} = {fixed}; "
                f"{free[0]}=-1 cannot fill the rest; {_valid_hint(world_size)}"
            )
        sizes[free[0]] = world_size // fixed
    prod = sizes["dp"] * sizes["pp"] * sizes["tp"]
    if prod != world_size:
        raise MeshError(
            f"dp={sizes['dp']} * pp={sizes['pp']} * tp={sizes['tp']} = {prod} does not equal the "
            f"world size {world_size}; {_valid_hint(world_size)}"
        )
    return sizes["dp"], sizes["pp"], sizes["tp"]


def _valid_hint(world_size: int) -> str:
    tps = [t for t in range(1, world_size + 1) if world_size % t == 0]
    return (
        "valid choices: " + ", ".join(f"tp={t}, dp={world_size // t}" for t in tps) + " (or dp=-1)"
    )


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return default if v in (None, "") else int(v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local_devices(
    backend_is_cuda: bool, local_rank: int, local_world: int, devices_per_rank: int
) -> list[torch.device]:
    """The devices this rank owns: a disjoint block of `devices_per_rank` per local rank."""
    if not backend_is_cuda:
        return [torch.device("cpu")] * devices_per_rank
    n = torch.cuda.device_count()
    need = local_world * devices_per_rank
    if need > n:
        # Offer only the fixes that fit on this host (n >= 1 here: CUDA is available).
        fixes = []
        if n // local_world >= 1:
            fixes.append(f"devices_per_rank={n // local_world}")
        if n // devices_per_rank >= 1:
            k = n // devices_per_rank
            fixes.append(f"{k} rank{'s' if k > 1 else ''} per host")
        if not fixes:
            fixes.append(f"devices_per_rank=1 with {n} rank{'s' if n > 1 else ''} per host")
        raise MeshError(
            f"{local_world} ranks on this host x devices_per_rank={devices_per_rank} = {need} GPUs "
            f"asked, but this host has {n}; use {' or '.join(fixes)}"
        )
    first = local_rank * devices_per_rank
    return [torch.device("cuda", first + i) for i in range(devices_per_rank)]


def _device_ids(devices: list[torch.device]) -> list[str]:
    """Stable identities of devices across processes (CUDA UUIDs survive CUDA_VISIBLE_DEVICES)."""
    out = []
    for d in devices:
        if d.type == "cuda":
            out.append(f"GPU {torch.cuda.get_device_properties(d).uuid}")
        else:
            out.append(f"{d.type}")
    return out


def _comm_thread_states() -> dict[str, tuple[str, int]] | None:
    """{thread id: (state, CPU ticks used)} of this process's gloo threads, from /proc; None where
    /proc is not there to tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "tid (comm) state ... utime stime ...": comm may hold spaces, so split at the last ")"
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if "gloo" not in name:
            continue
        rest = stat[stat.rfind(")") + 2 :].split()
        out[tid] = (rest[0], int(rest[11]) + int(rest[12]))  # fields 3, 14, 15 of proc(5)
    return out


def _quiesce_comm_threads(limit_s: float = 3.0, settle: int = 20, tick_s: float = 0.005) -> None:
    """Let gloo's worker threads finish before the interpreter finalizes.

    A worker that completed a collective drops its last reference to the work (and its tensors)
    a moment later; if such a tensor still has a Python object, dropping it takes the GIL. Once
    the interpreter is finalizing, taking the GIL ends the thread (pthread_exit) inside a C++
    destructor and the whole process aborts ("terminate called without an active exception",
    SIGABRT, exit code -6) after the script itself succeeded; the launcher then stops the other
    ranks. `destroy_process_group` does not join those threads while the model, DDP or the mesh
    still hold the group. So: sleep in short ticks, the GIL free, until no gloo thread has run or
    used CPU time for `settle` ticks in a row, at most `limit_s`. (Work queued with
    `async_op=True` and never waited may still be in flight after that: wait on it.)"""
    deadline = time.monotonic() + limit_s
    quiet = 0
    before = _comm_thread_states()
    if before is None:  # no /proc: one fixed pause instead
        time.sleep(0.05)
        return
    while quiet < settle and time.monotonic() < deadline:
        time.sleep(tick_s)
        now = _comm_thread_states() or {}
        busy = any(
            st == "R" or before.get(tid, (st, cpu))[1] != cpu for tid, (st, cpu) in now.items()
        )
        quiet = 0 if busy else quiet + 1
        before = now


def _destroy_at_exit() -> None:
    """Destroy the default process group while the interpreter is still whole, then let gloo's
    worker threads go idle (see `_quiesce_comm_threads`). A script that ends without
    `dist.destroy_process_group()`, or ends right after a collective, could otherwise abort at
    exit ("terminate called without an active exception", SIGABRT); the launcher then stops the
    other ranks, maybe mid-write. Runs also when the script destroyed the group itself."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _quiesce_comm_threads()


def init_mesh(
    dp: int = -1,
    tp: int = 1,
    pp: int = 1,
    *,
    backend: str | None = None,
    devices_per_rank: int = 1,
    timeout: timedelta | float = timedelta(minutes=10),
) -> Mesh:
    """Initialize torch.distributed (if needed) and return this rank's `Mesh`.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...); with none, runs as world size 1.
    The backend is nccl when CUDA is available, else gloo. Axes are ("dp", "pp", "tp"), tp innermost.

    Args:
        dp, tp, pp: axis sizes; one may be -1 for "the rest of the world size".
        backend: force "gloo" or "nccl".
        devices_per_rank: GPUs each rank owns (a replica split over its own GPUs); ranks of one host
            get disjoint blocks of devices.
        timeout: for the process group and every collective (seconds or a timedelta).

    Example:
        >>> mesh = qm.init_mesh(tp=2, dp=-1)  # doctest: +SKIP
        >>> print(mesh)                       # doctest: +SKIP
        Mesh(rank 0/4: dp 0/2, pp 0/1, tp 0/2, devices [cpu], backend gloo)
    """
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if not isinstance(devices_per_rank, int) or devices_per_rank < 1:
        raise MeshError(f"devices_per_rank={devices_per_rank!r}; use a positive int")

    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
    rank = dist.get_rank() if initialized else _env_int("RANK", 0)
    dp, pp, tp = resolve_sizes(world, dp, tp, pp)  # checked before any collective

    if backend is None:
        backend = (
            dist.get_backend() if initialized else ("nccl" if torch.cuda.is_available() else "gloo")
        )
    if backend not in ("gloo", "nccl"):
        raise MeshError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (CUDA)")
    is_cuda = backend == "nccl"
    if is_cuda and not torch.cuda.is_available():
        raise MeshError(
            "backend='nccl' needs CUDA, but torch.cuda.is_available() is False; use 'gloo'"
        )
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    devices = _local_devices(is_cuda, local_rank, local_world, devices_per_rank)
    if is_cuda:
        torch.cuda.set_device(devices[0])

    if initialized:  # the caller's group: only wait for its threads (once, however many calls)
        atexit.unregister(_quiesce_comm_threads)
        atexit.register(_quiesce_comm_threads)
    else:
        atexit.register(_destroy_at_exit)  # registered first: runs after the group exists
        if "MASTER_ADDR" not in os.environ and world == 1:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=devices[0] if is_cuda else None,
            )

    # The first collective: who owns what, and where.
    host = socket.gethostname()
    mine = (rank, host, _device_ids(devices) if is_cuda else [])
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    _check_device_ownership(everyone)

    grid = torch.arange(world).reshape(dp, pp, tp)
    coords = (grid == rank).nonzero()[0].tolist()
    from torch.distributed.device_mesh import DeviceMesh

    device_mesh = DeviceMesh("cuda" if is_cuda else "cpu", grid, mesh_dim_names=AXES)
    mesh = Mesh(
        dp=dp,
        pp=pp,
        tp=tp,
        rank=rank,
        world_size=world,
        dp_rank=coords[0],
        pp_rank=coords[1],
        tp_rank=coords[2],
        devices=devices,
        backend=backend,
        device_mesh=device_mesh,
    )
    hosts = {everyone[r][1] for r in mesh.ranks_of("tp")}
    if len(hosts) > 1:
        warnings.warn(
            f"the tp group of rank {rank} spans hosts {sorted(hosts)}: it works, but every layer's "
            f"all-reduce crosses the network; make tp at most the GPUs per host",
            stacklevel=2,
        )
    return mesh


def _check_device_ownership(everyone: list) -> None:
    """Raise if two ranks of one host resolve to the same CUDA device."""
    owner: dict[tuple[str, str], int] = {}
    for rank, host, ids in everyone:
        for dev in ids:
            key = (host, dev)
            if key in owner:
                raise MeshError(
                    f"ranks {owner[key]} and {rank} on host {host} both resolve to {dev}; each rank "
                    f"must own its own devices (set CUDA_VISIBLE_DEVICES per rank consistently, or "
                    f"lower devices_per_rank / processes per host)"
                )
            owner[key] = rank
