"""Run a function on N spawned CPU ranks (gloo) with a hard timeout; every rank's traceback on failure.
(Also `cpu_peak_bytes`: the peak of live CPU memory in a profiled region, for memory tests.)

This is the one way quantmesh's multi-rank tests start processes. It never hangs: when any rank fails
or the deadline passes, the others are asked for their stacks (faulthandler) and killed. Ranks are
forked from a fork server that imported torch once (PRELOAD), so starting one costs milliseconds.

Example:
    >>> def show(rank):
    ...     import quantmesh as qm
    ...     return repr(qm.init_mesh(tp=2))
    >>> run_ranks(show, 2)  # doctest: +SKIP
    ['Mesh(rank 0/2: ...)', 'Mesh(rank 1/2: ...)']
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RanksFailed", "cpu_peak_bytes", "run_ranks"]


class RanksFailed(RuntimeError):
    """One or more ranks failed or timed out; the message holds every rank's traceback or stack."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Modules every rank needs, imported once by the fork server: a rank forked from it starts with
# them loaded, instead of importing torch again (seconds of CPU per rank on a small machine).
# Names that do not import here are skipped (transformers is optional).
PRELOAD = ["torch", "torch.distributed", "quantmesh", "transformers.modeling_utils"]


def _context() -> Any:
    """Fork server (torch preloaded) where the platform has one and no GPU is visible, else spawn.
    Both start each rank from a process that has initialized nothing (no threads, no process group,
    no CUDA). With a GPU, the preload itself initializes CUDA (bitsandbytes queries the device at
    import), and a rank forked from it cannot use CUDA at all, so GPU machines spawn."""
    import torch

    if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # used when the server starts (the first call)
        return ctx
    return mp.get_context("spawn")


def _child(rank, world, port, call, env, log_path, queue, parent_env):  # pragma: no cover
    import faulthandler
    import sys

    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    # The caller's environment now, as a spawned process would inherit it (the fork server's is
    # the one of its start), then torchrun's variables.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS") or "1",  # set but empty: 1 too
    )
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        fn, args, kwargs = pickle.loads(call)
        result = fn(rank, *args, **kwargs)
        # Pickle here, not in the queue's feeder thread: there an unpicklable result is only
        # printed and dropped, and the parent would wait for it until the timeout.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, *args, **kwargs)` on `world_size` spawned processes; return results by rank.

    `fn` must be importable (a module-level function). Each rank gets torchrun's environment
    variables, so `qm.init_mesh()` inside it just works (gloo on CPU). On any exception, or when
    `timeout` seconds pass, all ranks are stopped and `RanksFailed` lists every rank's traceback (a
    hanging rank's current stack is dumped with faulthandler first).
    """
    try:
        call = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_ranks could not pickle {fn!r} and its arguments ({e}); the spawned ranks import "
            f"it by name, so pass a module-level function and picklable arguments"
        ) from e
    for attempt in range(3):
        try:
            return _launch(call, world_size, timeout, env)
        except RanksFailed as e:
            # the free port we picked was taken by another process before rank 0 bound it (two
            # pytest workers launching at once): the harness's race, not the code under test
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch(call: bytes, world_size: int, timeout: float, env: dict[str, str] | None) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    logdir = tempfile.mkdtemp(prefix="qm-ranks-")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    for path in logs:
        # Created here, so that a rank dying in spawn's bootstrap (before it opens its log; the
        # bootstrap's traceback goes to this process's stderr) still has a log to report.
        open(path, "w").close()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, call, env or {}, logs[r], queue, dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    while len(results) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        try:
            rank, ok, payload = queue.get(timeout=min(left, 0.5))
        except Exception:
            dead = [
                r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
            ]
            for r in dead:
                if r not in results and r not in errors:
                    errors[r] = (
                        f"process exited with code {procs[r].exitcode} before reporting (a "
                        f"crash in spawn's start-up prints to the parent's stderr, not to this log)"
                    )
            if errors:
                break
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
        if errors:
            break
    if errors or timed_out:
        for r, p in enumerate(procs):
            if p.is_alive() and r not in errors and r not in results:
                assert p.pid is not None  # started
                # dump its stack into its log; a fork server's child may end and be reaped by
                # the server between is_alive() and the signal
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        parts = []
        why = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        for r in range(world_size):
            if r in errors:
                status = errors[r]
            elif r in results:
                status = "finished"
            else:
                status = "did not finish (stopped)"
            with open(logs[r], errors="replace") as f:
                log = f.read()[-6000:]
            parts.append(f"--- rank {r}: {status}\n{log}")
        shutil.rmtree(logdir, ignore_errors=True)
        raise RanksFailed(f"{world_size} ranks {why}:\n" + "\n".join(parts))
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    shutil.rmtree(logdir, ignore_errors=True)
    return [results[r] for r in range(world_size)]


def cpu_peak_bytes(prof: Any) -> int:
    """The highest sum of CPU allocations minus frees, in event order, over a region profiled with
    `torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)`.

    Example:
        >>> with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # doctest: +SKIP
        ...     model(ids).sum().backward()
        >>> cpu_peak_bytes(prof)                                                           # doctest: +SKIP
        6914048
    """
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak
