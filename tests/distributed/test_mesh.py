"""init_mesh on real gloo ranks: coordinates, groups, reuse, and every error it can raise.

Spawning ranks dominates the cost (8 ranks take several seconds on 2 cores), so each world size is
spawned once and its rank function builds every mesh shape for that size; the tests below read the
cached facts. The expected coordinates are computed here independently of quantmesh.parallel.mesh: the axes
are (dp, pp, tp) with tp innermost, so a tp group is a block of consecutive ranks.

There is no GPU on CI: the CUDA device checks run either as plain functions on fabricated inputs, or
inside init_mesh with torch.cuda monkeypatched; each test says which.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from quantmesh.parallel.mesh import (
    MeshError,
    _check_device_ownership,
    _local_devices,
    resolve_sizes,
)
from quantmesh.testing import run_ranks

# (dp, tp, pp) per world size; covers the shapes (4,1) (2,2) (1,4) (2,4) (-1,2), plus pp.
SHAPES: dict[int, list[tuple[int, int, int]]] = {
    1: [(1, 1, 1), (-1, 1, 1)],
    2: [(2, 1, 1), (1, 2, 1), (-1, 2, 1)],
    4: [(4, 1, 1), (2, 2, 1), (1, 4, 1), (-1, 2, 1), (1, 2, 2)],
    8: [(2, 4, 1), (-1, 2, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2)],
}


# --------------------------------------------------------------------------- rank-side code


def _mesh_facts(rank: int, dp: int, tp: int, pp: int) -> dict[str, Any]:
    """Build one mesh and report what it says about this rank, and what the groups really do."""
    import torch.distributed as dist

    import quantmesh as qm

    world_before = dist.group.WORLD if dist.is_initialized() else None
    mesh = qm.init_mesh(dp=dp, tp=tp, pp=pp)
    facts: dict[str, Any] = {
        "rank": mesh.rank,
        "dist_rank": dist.get_rank(),
        "world_size": mesh.world_size,
        "sizes": (mesh.dp, mesh.pp, mesh.tp),
        "coords": (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank),
        "device": str(mesh.device),
        "backend": mesh.backend,
        "dim_names": tuple(mesh.device_mesh.mesh_dim_names),
        "repr": repr(mesh),
        # Only meaningful from the second init_mesh on: the default group must be reused.
        "reused_world": world_before is None or dist.group.WORLD is world_before,
    }
    for axis, group in (("dp", mesh.dp_group), ("pp", mesh.pp_group), ("tp", mesh.tp_group)):
        facts[f"ranks_of_{axis}"] = mesh.ranks_of(axis)
        facts[f"group_ranks_{axis}"] = dist.get_process_group_ranks(group)
        # A real collective proves membership: 2**rank summed over the group is unique per set.
        t = torch.tensor([float(2**rank)])
        dist.all_reduce(t, group=group)
        facts[f"sum_{axis}"] = int(t.item())
    return facts


def _size_errors() -> dict[str, str]:
    """Sizes that cannot tile the world; checked before any collective, so no rank can hang."""
    import quantmesh as qm

    out = {}
    for key, kw in {
        "3x2": {"dp": 3, "tp": 2},
        "tp3": {"tp": 3},
        "two_free": {"dp": -1, "pp": -1},
    }.items():
        with pytest.raises(qm.MeshError) as info:
            qm.init_mesh(**kw)
        out[key] = str(info.value)
    return out


def _tp_across_hosts(rank: int) -> dict[str, list[str]]:
    """Pretend ranks 0-1 run on host nodeA and ranks 2-3 on nodeB (socket.gethostname is
    monkeypatched per rank, inside this rank's process), then collect init_mesh's warnings."""
    import quantmesh as qm

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "gethostname", lambda: "nodeA" if rank < 2 else "nodeB")
        for key, kw in {"tp4": {"tp": 4}, "tp2": {"tp": 2}, "dp4": {"dp": 4, "tp": 1}}.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                qm.init_mesh(**kw)
            out[key] = [str(w.message) for w in caught]
    return out


def _fake_cuda(mp: pytest.MonkeyPatch, uuids: list[str]) -> None:
    """Monkeypatch torch.cuda to look like a host whose visible GPUs have these UUIDs, in order."""
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: len(uuids))
    mp.setattr(torch.cuda, "set_device", lambda device: None)
    mp.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(uuid=uuids[device.index]),
    )


def _cuda_errors(rank: int) -> dict[str, str]:
    """init_mesh's device checks with torch.cuda monkeypatched (no GPU here).

    The default process group already exists (gloo, from the meshes built before), so init_mesh
    skips init_process_group and runs its ownership exchange over gloo, as it would over NCCL.
    """
    import quantmesh as qm

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        # CUDA_VISIBLE_DEVICES set inconsistently: rank 0 sees "0,1", rank 1 sees "1,0". Local
        # rank 1 takes its cuda:1, which is physical GPU 0: the one rank 0 took as its cuda:0.
        _fake_cuda(mp, ["uuid-of-gpu0", "uuid-of-gpu1"][:: 1 if rank == 0 else -1])
        with pytest.raises(qm.MeshError) as info:
            qm.init_mesh(tp=2, backend="nccl")
        out["duplicate"] = str(info.value)
    with pytest.MonkeyPatch.context() as mp:
        _fake_cuda(mp, ["uuid-of-gpu0"])  # one GPU for two ranks
        with pytest.raises(qm.MeshError) as info:
            qm.init_mesh(tp=2, backend="nccl")
        out["too_few"] = str(info.value)
    return out


def _rank_main(rank: int, shapes: list[tuple[int, int, int]], extras: list[str]) -> dict[str, Any]:
    """The one rank function per spawn: error cases first (before the group exists), then meshes."""
    out: dict[str, Any] = {}
    if "size_errors" in extras:
        out["size_errors"] = _size_errors()
    out["shapes"] = [_mesh_facts(rank, dp, tp, pp) for dp, tp, pp in shapes]
    if "tp_across_hosts" in extras:
        out["tp_across_hosts"] = _tp_across_hosts(rank)
    if "cuda_errors" in extras:
        out["cuda_errors"] = _cuda_errors(rank)
    return out


@functools.cache
def _spawn(world: int) -> list[dict[str, Any]]:
    """Run every check of one world size in a single spawn; cached for the tests of this module."""
    extras = {4: ["size_errors", "tp_across_hosts"], 2: ["cuda_errors"]}.get(world, [])
    return run_ranks(_rank_main, world, SHAPES[world], extras, timeout=120)


# --------------------------------------------------------------------------- expectations


def _expected(world: int, rank: int, dp: int, tp: int, pp: int) -> dict[str, Any]:
    """Coordinates and groups of `rank`, from the layout rule alone: ranks fill (dp, pp, tp)."""
    if dp == -1:
        dp = world // (tp * pp)
    tp_rank, pp_rank, dp_rank = rank % tp, (rank // tp) % pp, rank // (tp * pp)
    groups = {
        "tp": [dp_rank * pp * tp + pp_rank * tp + i for i in range(tp)],
        "pp": [dp_rank * pp * tp + i * tp + tp_rank for i in range(pp)],
        "dp": [i * pp * tp + pp_rank * tp + tp_rank for i in range(dp)],
    }
    return {"sizes": (dp, pp, tp), "coords": (dp_rank, pp_rank, tp_rank), "groups": groups}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_coordinates_and_groups_of_every_shape(world: int) -> None:
    results = _spawn(world)
    assert len(results) == world
    for rank, out in enumerate(results):
        for (dp, tp, pp), got in zip(SHAPES[world], out["shapes"], strict=True):
            want = _expected(world, rank, dp, tp, pp)
            where = f"world {world}, rank {rank}, dp={dp} tp={tp} pp={pp}"
            assert (got["rank"], got["dist_rank"], got["world_size"]) == (rank, rank, world), where
            assert got["sizes"] == want["sizes"], where
            assert got["coords"] == want["coords"], where
            assert (got["device"], got["backend"]) == ("cpu", "gloo"), where
            assert got["dim_names"] == ("dp", "pp", "tp"), where
            assert got["repr"].startswith(f"Mesh(rank {rank}/{world}: dp {want['coords'][0]}/")
            for axis, members in want["groups"].items():
                assert got[f"ranks_of_{axis}"] == members, f"{where}: ranks_of({axis!r})"
                assert got[f"group_ranks_{axis}"] == members, f"{where}: {axis}_group ranks"
                assert got[f"sum_{axis}"] == sum(2**r for r in members), f"{where}: all_reduce"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_second_init_mesh_reuses_the_process_group(world: int) -> None:
    for rank, out in enumerate(_spawn(world)):
        assert [f["reused_world"] for f in out["shapes"]] == [True] * len(SHAPES[world]), rank


def test_sizes_that_do_not_tile_the_world_are_refused_with_valid_choices() -> None:
    for out in _spawn(4):
        errs = out["size_errors"]
        assert errs["3x2"] == (
            "dp=3 * pp=1 * tp=2 = 6 does not equal the world size 4; valid choices: "
            "tp=1, dp=4, tp=2, dp=2, tp=4, dp=1 (or dp=-1)"
        )
        assert errs["tp3"].startswith(
            "world size 4 is not divisible by pp=1 * tp=3 = 3; dp=-1 cannot fill the rest; "
        )
        assert "tp=2, dp=2" in errs["tp3"]
        assert errs["two_free"] == "only one mesh axis may be -1, got dp=-1, pp=-1"


def test_a_tp_group_spanning_hosts_warns_and_names_them() -> None:
    for rank, out in enumerate(_spawn(4)):
        hosts = out["tp_across_hosts"]
        assert len(hosts["tp4"]) == 1, (rank, hosts["tp4"])
        assert hosts["tp4"][0].startswith(
            f"the tp group of rank {rank} spans hosts ['nodeA', 'nodeB']"
        )
        # tp=2 keeps each tp group on one host, and dp may span hosts freely: no warning.
        assert hosts["tp2"] == [], rank
        assert hosts["dp4"] == [], rank


def test_init_mesh_refuses_two_ranks_on_one_cuda_device() -> None:
    # torch.cuda monkeypatched inside the ranks (see _cuda_errors).
    host = socket.gethostname()
    for rank, out in enumerate(_spawn(2)):
        msg = out["cuda_errors"]["duplicate"]
        assert msg.startswith(f"ranks 0 and 1 on host {host} both resolve to GPU uuid-of-gpu0; "), (
            rank,
            msg,
        )
        assert "CUDA_VISIBLE_DEVICES" in msg


def test_init_mesh_refuses_more_gpus_than_the_host_has() -> None:
    # torch.cuda monkeypatched inside the ranks: one GPU, two ranks.
    for out in _spawn(2):
        assert out["cuda_errors"]["too_few"] == (
            "2 ranks on this host x devices_per_rank=1 = 2 GPUs asked, but this host has 1; "
            "use 1 rank per host"
        )


def test_device_ownership_on_fabricated_inputs() -> None:
    # Fabricated (rank, host, device ids) lists, as init_mesh gathers them from every rank.
    ok = [(0, "a", ["GPU u0", "GPU u1"]), (1, "a", ["GPU u2", "GPU u3"]), (2, "b", ["GPU u0"])]
    _check_device_ownership(ok)  # the same UUID on another host is another device
    _check_device_ownership([(0, "a", []), (1, "a", [])])  # CPU ranks own no CUDA device
    overlap = [(0, "a", ["GPU u0", "GPU u1"]), (1, "a", ["GPU u1", "GPU u2"])]
    with pytest.raises(MeshError, match=r"^ranks 0 and 1 on host a both resolve to GPU u1; "):
        _check_device_ownership(overlap)
    later = [(0, "a", ["GPU u0"]), (1, "b", ["GPU u0"]), (5, "b", ["GPU u0"])]
    with pytest.raises(MeshError, match=r"^ranks 1 and 5 on host b both resolve to GPU u0; "):
        _check_device_ownership(later)


def test_local_devices_give_disjoint_blocks_and_refuse_too_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.cuda.device_count monkeypatched: a host with 4 GPUs.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    blocks = [_local_devices(True, r, 2, 2) for r in range(2)]
    assert blocks == [
        [torch.device("cuda", 0), torch.device("cuda", 1)],
        [torch.device("cuda", 2), torch.device("cuda", 3)],
    ]
    assert _local_devices(False, 3, 4, 2) == [torch.device("cpu")] * 2
    with pytest.raises(MeshError) as info:
        _local_devices(True, 0, 4, 2)
    assert str(info.value) == (
        "4 ranks on this host x devices_per_rank=2 = 8 GPUs asked, but this host has 4; "
        "use devices_per_rank=1 or 2 ranks per host"
    )
    with pytest.raises(
        MeshError, match=r"= 15 GPUs asked, but this host has 4; use 1 rank per host$"
    ):
        _local_devices(True, 0, 5, 3)
    # Neither knob alone fits: the hint changes both.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MeshError, match=r"has 1; use devices_per_rank=1 with 1 rank per host$"):
        _local_devices(True, 0, 2, 2)


@pytest.mark.parametrize(
    ("world", "dp", "tp", "pp", "want"),
    [
        (8, -1, 2, 1, (4, 1, 2)),
        (8, 2, -1, 2, (2, 2, 2)),
        (8, 1, 1, -1, (1, 8, 1)),
        (6, -1, 3, 1, (2, 1, 3)),
        (1, -1, 1, 1, (1, 1, 1)),
    ],
)
def test_resolve_sizes(world: int, dp: int, tp: int, pp: int, want: tuple[int, int, int]) -> None:
    assert resolve_sizes(world, dp=dp, tp=tp, pp=pp) == want


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dp": 0, "tp": 1, "pp": 1}, "dp=0 is not a valid mesh size; use a positive int"),
        ({"dp": -1, "tp": 2.0, "pp": 1}, "tp=2.0 is not a valid mesh size"),
        ({"dp": -1, "tp": -1, "pp": 1}, "only one mesh axis may be -1, got dp=-1, tp=-1"),
        ({"dp": 2, "tp": 2, "pp": 1}, "dp=2 * pp=1 * tp=2 = 4 does not equal the world size 8"),
    ],
)
def test_resolve_sizes_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(MeshError) as info:
        resolve_sizes(8, **kw)
    assert str(info.value).startswith(message)


_WORLD1_SCRIPT = """
import json, os
import torch, torch.distributed as dist
import quantmesh as qm

launcher = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
            if k in os.environ]
assert not dist.is_initialized()
m = qm.init_mesh()
world = dist.group.WORLD
m2 = qm.init_mesh(dp=-1, tp=1)
t = torch.ones(1)
dist.all_reduce(t, group=m2.tp_group)
try:
    qm.init_mesh(tp=2)
    err = None
except qm.MeshError as e:
    err = str(e)
print(json.dumps({
    "launcher_env": launcher,
    "mesh": [m.dp, m.pp, m.tp, m.rank, m.world_size, m.tp_rank, m.dp_rank, str(m.device)],
    "backend": m.backend,
    "reused": dist.group.WORLD is world,
    "ranks_of": [m2.ranks_of("dp"), m2.ranks_of("tp")],
    "sum": t.item(),
    "error": err,
}))
"""


def test_world_size_one_without_any_launcher_environment() -> None:
    # A clean environment: nothing from torchrun (or from this process) can leak in.
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "PYTHONPATH") if k in os.environ}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _WORLD1_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["launcher_env"] == []
    assert out["mesh"] == [1, 1, 1, 0, 1, 0, 0, "cpu"]
    assert out["backend"] == "gloo"
    assert out["reused"] is True
    assert out["ranks_of"] == [[0], [0]]
    assert out["sum"] == 1.0
    assert out["error"].startswith("world size 1 is not divisible by pp=1 * tp=2 = 2; ")
