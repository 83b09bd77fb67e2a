"""Launch N worker processes through torch.distributed.run (torchrun), from inside our CLI.

A failing worker ends all workers (torchrun's agent, no restarts); we print one short line naming the
failed rank and exit non-zero. The worker's own traceback has already gone to stderr.

A target is a script or module run by a fresh interpreter per worker, or a function (`fn`) run
by forked workers: on Linux hosts without CUDA only (`forked_workers_apply`), where it saves every
rank its imports. Workers are forked from a process that holds what they import
(`quantmesh.cli.preload`: torch, transformers, bitsandbytes, quantmesh's layers): this process
when it has imported `quantmesh.cli.preload` itself (a launcher started from a process that
did, as the test suite starts its commands), else a fork server that imports it once for all of
them (a command started from a shell). Both are torchrun start methods (`fork`, `forkserver`).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["forked_workers_apply", "ignore_timer_self_join", "launch"]


def forked_workers_apply() -> bool:
    """Whether workers start as forks of a fork server holding their imports: on Linux hosts
    without CUDA (a process that has imported bitsandbytes has initialized CUDA where there is
    one, and cannot hand it to its forks; elsewhere the libraries' device back-ends are not known
    to survive a fork), unless QUANTMESH_FORK_WORKERS=0 asks for fresh interpreters.

    Example:
        >>> isinstance(forked_workers_apply(), bool)
        True
    """
    import multiprocessing as mp

    from ..config import env_switch

    if not env_switch("QUANTMESH_FORK_WORKERS", default=True):
        return False
    import torch

    return (
        sys.platform == "linux"
        and "forkserver" in mp.get_all_start_methods()
        and not torch.cuda.is_available()
    )


def ignore_timer_self_join() -> None:
    """Keep one harmless torch message off the user's terminal. torch's rendezvous runs a timer
    on a daemon thread and stops it from a finalizer; when the garbage collector frees the timer
    on that same thread, the finalizer tries to join the thread it runs on, and Python prints
    "Exception ignored in: <finalize object ...>" with a traceback ending in "RuntimeError:
    cannot join current thread" (it has been seen after a finetune stopped by Ctrl-C). That one
    is dropped; every other unraisable exception still goes to the hook that was there.
    Installed once per process.

    Example:
        >>> ignore_timer_self_join()
    """
    previous = sys.unraisablehook
    if getattr(previous, "quantmesh_timer_self_join", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_timer_self_join(unraisable):
            previous(unraisable)

    hook.quantmesh_timer_self_join = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _is_timer_self_join(unraisable: Any) -> bool:
    err = unraisable.exc_value
    if not isinstance(err, RuntimeError) or str(err) != "cannot join current thread":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:  # raised under torch's rendezvous timer's `_stop_thread`
        code = tb.tb_frame.f_code
        if code.co_name == "_stop_thread" and code.co_filename.replace("\\", "/").endswith(
            "elastic/rendezvous/utils.py"
        ):
            return True
        tb = tb.tb_next
    return False


def launch(
    nproc: int,
    target: list[str],
    *,
    module: bool = False,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    fn: Callable[..., Any] | None = None,
    fn_args: tuple = (),
) -> int:
    """Run `target` (a script and its args, or a module with `module=True`) on `nproc` workers,
    or with `fn`, `fn(*fn_args)` on `nproc` workers forked from a fork server that has imported
    `quantmesh.cli.preload` (check `forked_workers_apply` first; `target` is then unused).

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
    elif fn is not None:  # what --standalone means to torchrun's run(): a store on a free port
        argv += ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}"]
    else:
        argv += ["--standalone"]
    if fn is not None:
        argv += [f"--start-method={_start_method()}"]
    elif module:
        argv += ["-m"]
    # torchrun's parser asks for a script; a function's workers run none ("-" stands in for it)
    args = get_args_parser().parse_args(argv + (target if fn is None else ["-"]))
    ignore_timer_self_join()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", "")
    try:
        if fn is None:
            run(args)
        else:
            _run_forked(args, fn, fn_args)
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


def _start_method() -> str:
    """torchrun's start method for forked workers: `fork` when this process has imported
    `quantmesh.cli.preload` (and so the workers' libraries, under the workers' environment), else
    `forkserver` (a server that imports it, once for all workers)."""
    return "fork" if "quantmesh.cli.preload" in sys.modules else "forkserver"


def _run_forked(args: Any, fn: Callable[..., Any], fn_args: tuple) -> None:
    """torchrun's agent with a function for its workers, forked from this process or started by
    the fork server (`_start_method`; its environment and stdio are this process's when the first
    worker starts it)."""
    import multiprocessing as mp

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.start_method == "forkserver":
        mp.set_forkserver_preload(["quantmesh.cli.preload"])
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=fn)(*fn_args)
