"""A tiny multi-rank program: each rank builds the mesh and prints its coordinates."""

from __future__ import annotations

import sys


def main() -> None:
    import quantmesh as qm

    mesh = qm.init_mesh(tp=2 if _world() % 2 == 0 else 1)
    line = f"rank {mesh.rank}: dp={mesh.dp_rank}/{mesh.dp} tp={mesh.tp_rank}/{mesh.tp} {mesh}\n"
    sys.stdout.write(line)  # one write per line: ranks' lines never interleave
    sys.stdout.flush()


def _world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


if __name__ == "__main__":
    main()
