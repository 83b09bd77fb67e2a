"""Run a benchmark script's `main(argv)` on CPU ranks, as `torchrun SCRIPT ARGV` runs it per rank.

The ranks come from `quantmesh.testing.run_ranks` (torchrun's environment variables, forked from
the suite's fork server, which holds torch, transformers and bitsandbytes): a benchmark smoke then
costs its work, not a fresh interpreter's imports per rank (most of its time when launched through
torchrun). The scripts' own `if __name__ == "__main__"` line only adds `exit_fast`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from quantmesh.testing import run_ranks

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_main(rank: int, script: str, argv: list[str]) -> int:
    """`script`'s main(argv) on this rank; its exit code."""
    import runpy

    sys.path.insert(0, str(BENCH))  # the scripts import their helpers (qmbench) by name
    mod = runpy.run_path(str(BENCH / script), run_name=Path(script).stem)
    return int(mod["main"](argv) or 0)


def bench_on_ranks(world: int, script: str, *argv: str, timeout: float = 150) -> None:
    """Run `script` ARGV on `world` CPU ranks; every rank must exit with code 0."""
    rcs = run_ranks(bench_main, world, script, list(argv), timeout=timeout,
                    env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert rcs == [0] * world, rcs
