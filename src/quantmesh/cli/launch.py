"""Launch N worker processes through torch.distributed.run (torchrun), from inside our CLI.

A failing worker ends all workers (torchrun's agent, no restarts); we print one short line naming the
failed rank and exit non-zero. The worker's own traceback has already gone to stderr.
"""

from __future__ import annotations

import os
import sys

__all__ = ["launch"]


def launch(
    nproc: int,
    target: list[str],
    *,
    module: bool = False,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
) -> int:
    """Run `target` (a script and its args, or a module with `module=True`) on `nproc` workers.

    Returns the exit code (0 when every worker succeeded).

    Example:
        >>> launch(4, ["examples/mesh_coords.py"])  # doctest: +SKIP
        0
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", "--max-restarts=0"]
    if rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            argv += [f"--node-rank={node_rank}"]
    else:
        argv += ["--standalone"]
    if module:
        argv += ["-m"]
    argv += target
    args = get_args_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", "")
    try:
        run(args)
    except ChildFailedError as e:
        # {global rank: ProcessFailure}. The agent SIGTERMs the survivors after the first failure,
        # so they show up here too, with negative exit codes and often the same (whole-second)
        # timestamp: the rank that really failed is the one with a positive exit code.
        rank, first = min(
            e.failures.items(), key=lambda kv: (kv[1].exitcode <= 0, kv[1].timestamp, kv[0])
        )
        print(
            f"quantmesh: worker rank {rank} failed (exit code {first.exitcode}); "
            f"all {nproc} workers were stopped. Its traceback is above.",
            file=sys.stderr,
        )
        return first.exitcode if first.exitcode > 0 else 1
    return 0
