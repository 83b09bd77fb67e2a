"""Running workers: the launching side (`run_workers`: start N ranks, print one line per failure),
the worker side (`worker_main`: run a rank's body, leave its error where the launcher finds it) and
the way both processes end (`exit_fast`).

Example:
    >>> run_workers(2, ["quantmesh.cli.worker", "finetune", "run.json"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from .errors import DEBUG_ENV, ERROR_DIR_ENV, EXIT_USAGE, is_user_error, one_line

__all__ = ["LauncherWatch", "exit_fast", "launcher_gone", "run_workers", "worker_main"]

LAUNCHER_ENV = "QUANTMESH_LAUNCHER_PID"
"""The launching process's pid, for its workers (`launcher_gone`): a forked worker's parent is
the fork server, which outlives a launcher killed outright."""


def exit_fast(fn: Callable[[], int | None]) -> NoReturn:
    """Run `fn` (a process's main function) and end the process with its exit code, doing what the
    interpreter does at exit (wait for the other non-daemon threads, run the `atexit` handlers,
    flush stdout and stderr) but without its teardown of every module: with torch, transformers,
    bitsandbytes and peft loaded, that teardown frees nothing the OS would not, and took seconds of
    CPU at the end of every worker and of the launching process, after the run's last line.

    A `SystemExit` from `fn` (argparse's usage errors) ends the process with its code; any other
    exception propagates, and the interpreter exits as usual.

    Example:
        >>> if __name__ == "__main__":  # doctest: +SKIP
        ...     exit_fast(main)
    """
    import atexit

    code: int | str | None
    try:
        code = fn()
    except SystemExit as e:
        code = e.code  # an int, None or a message, as for sys.exit
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # What Py_Finalize does first: join the non-daemon threads (and run what threading registered to
    # run then), then the atexit handlers; stdio buffers last, since os._exit skips their flush.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - every CPython has it
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(int(code or 0))


def _interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT in a worker: a KeyboardInterrupt once. A terminal's Ctrl-C reaches a worker twice
    (from the terminal, and forwarded by the launcher): a second one would interrupt the first's
    clean-up (a checkpoint's temporary folder being removed) with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def worker_main(fn: Callable[[], int | None], *, log_dir: Path | None = None) -> int:
    """Run a worker's body; on failure print one line naming the rank and leave the details behind.

    User errors: the message, exit code 2. Other errors: the first line, the full traceback in
    `log_dir/rank-R.log` (printed too with QUANTMESH_DEBUG=1), exit code 1. The first line also goes
    to $QUANTMESH_ERROR_DIR/rank-R.txt for the launching process.

    Example:
        >>> sys.exit(worker_main(lambda: train(cfg), log_dir=Path("out/logs")))  # doctest: +SKIP
    """
    rank = int(os.environ.get("RANK", "0"))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        return 130
    except BaseException as e:  # noqa: B036 - a worker must never exit without saying why
        if isinstance(e, SystemExit):
            return int(e.code or 0) if not isinstance(e.code, str) else 1
        tb = traceback.format_exc()
        log = None
        if log_dir is not None and not is_user_error(e):
            with contextlib.suppress(OSError):
                log_dir.mkdir(parents=True, exist_ok=True)
                log = log_dir / f"rank-{rank}.log"
                log.write_text(tb)
        if os.environ.get(DEBUG_ENV) or (log is None and not is_user_error(e)):
            sys.stderr.write(tb)
        line = one_line(e) + (f" (traceback: {log})" if log is not None else "")
        err_dir = os.environ.get(ERROR_DIR_ENV)
        if err_dir:
            with contextlib.suppress(OSError):
                Path(err_dir, f"rank-{rank}.txt").write_text(line + "\n")
        else:  # run in place (under torchrun): say it here
            print(f"quantmesh: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        return EXIT_USAGE if is_user_error(e) else 1


def launcher_gone(parent: int) -> bool:
    """Whether this worker's launcher has ended: `parent` (the parent pid the worker started
    with) is no longer its parent, or the launcher named by `LAUNCHER_ENV` has exited (a forked
    worker's parent is the fork server, which stays). A launcher that has exited but was not yet
    reaped (a zombie) counts as gone.

    Example:
        >>> launcher_gone(os.getppid())
        False
    """
    if os.getppid() != parent:
        return True
    pid = os.environ.get(LAUNCHER_ENV)
    if not pid or not pid.isdigit():
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # "pid (name) state ...": the state after the name
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc here: whether the pid still exists
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # it exists (another user's: not ours to signal)
            return False
        return False


class LauncherWatch:
    """A worker's watch on its launcher, from a daemon thread: it ends the worker once the launcher
    is gone (`launcher_gone`, e.g. killed outright: nothing forwards a stop) while the worker can
    do nothing more of use:

    - before it has joined its peers (its process group not yet up): the rendezvous store it
      connects to is the launcher's, and a connection would be retried for the whole timeout
      (ten minutes). It says so on stderr and ends with exit code 1.
    - after it has finished (`finished`): a forked worker returns its result through torch's
      `_wrap`, which waits for the launcher to collect it. It ends with exit code 0 (its output
      has been written) once what its queues hold is sent; with `after_s`, also that many
      seconds after finishing, however the launcher fares (one that is shutting down collects no
      result), as soon as the result is queued (or `RESULT_WAIT_S` later if it never is).

    A worker that has joined and not finished goes on (it may still save its work; its peers'
    failures end it through the collectives' timeouts).

    Example:
        >>> watch = LauncherWatch.start()  # doctest: +SKIP
        >>> watch.finished(after_s=None)  # doctest: +SKIP
    """

    POLL_S = 0.2

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.joined = False
        self.deadline: float | None = None
        self.done = threading.Event()

    @classmethod
    def start(cls) -> LauncherWatch:
        """Watch this process's launcher (its parent now, or the pid in `LAUNCHER_ENV`)."""
        watch = cls(os.getppid())
        threading.Thread(target=watch._run, name="quantmesh-launcher-watch", daemon=True).start()
        return watch

    def finished(self, after_s: float | None) -> None:
        """This worker has finished: end once the launcher is gone, or `after_s` from now."""
        import time

        self.deadline = None if after_s is None else time.monotonic() + after_s
        self.done.set()

    def _has_joined(self) -> bool:
        # never imports: the worker's main thread may be importing torch right now
        dist = sys.modules.get("torch.distributed")
        with contextlib.suppress(Exception):
            self.joined = self.joined or bool(
                dist and dist.is_available() and dist.is_initialized()
            )
        return self.joined

    def _run(self) -> None:
        import time

        while True:
            joined = self._has_joined()  # before `gone`: a group torn down at the end was joined
            if self.done.is_set():
                now, deadline = time.monotonic(), self.deadline
                # past the grace: once the result is queued (a watching launcher reads it), or
                # RESULT_WAIT_S later if it never is (one shutting down reads none)
                past = (
                    deadline is not None
                    and now >= deadline
                    and (_result_queued() or now >= deadline + RESULT_WAIT_S)
                )
                if past or launcher_gone(self.parent):
                    _send_queued()  # the result this worker returned, on its way to the launcher
                    _flush_and_exit(0)
            elif not joined and launcher_gone(self.parent):
                rank = os.environ.get("RANK", "0")
                print(
                    f"quantmesh: error: rank {rank}: the launching process ended before this rank "
                    "joined the others; stopping (nothing is left to join: the launcher held the "
                    "rendezvous)",
                    file=sys.stderr,
                )
                _flush_and_exit(1)
            time.sleep(self.POLL_S)


RESULT_WAIT_S = 5.0
"""How long past its grace a finished worker waits for its result to be queued (`_wrap` puts it
as `forked` returns: microseconds, unless the host is starved)."""


def _result_queued() -> bool:
    """Whether something was put on a multiprocessing queue in this process: its feeder thread
    starts with the first `put` (in a forked worker, torch's `_wrap` putting the result)."""
    return any(t.name == "QueueFeederThread" for t in threading.enumerate())


def _send_queued(timeout_s: float = 10.0) -> None:
    """What multiprocessing does for its queues when a process exits normally, which a process
    ended by `os._exit` skips: each queue's feeder thread sends what it still holds and stops.
    A forked worker's result goes to the launcher through such a queue (torch's `_wrap`); ended
    with the result still in the feeder's hands, the launcher, still watching, would wait for it
    forever. Bounded: a launcher that reads nothing cannot hold the worker more than
    `timeout_s`."""
    from multiprocessing import util

    def run() -> None:
        with contextlib.suppress(Exception):
            util._run_finalizers(0)  # type: ignore[attr-defined]  # queues closed: feeders finish
            util._run_finalizers()  # type: ignore[attr-defined]  # ... and are joined

    t = threading.Thread(target=run, name="quantmesh-send-queued", daemon=True)
    t.start()
    t.join(timeout_s)


def _flush_and_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_workers(
    nproc: int,
    module_args: list[str],
    *,
    on_signal: Callable[[str], None] | None = None,
    **launch_kw: Any,
) -> int:
    """Launch `python -m <module_args>` on `nproc` workers; on failure print one line per cause.

    The first worker to fail names itself and the first line of its error; the launcher's own
    report (and torch's agent logging) is replaced by that line. With `on_signal`, a SIGINT or
    SIGTERM to the launcher (Ctrl-C), which stops the workers, calls it with the signal's name
    and returns 128 + its number instead of raising torch's SignalException.

    Example:
        >>> run_workers(2, ["quantmesh.cli.worker", "finetune", "run.json"])  # doctest: +SKIP
        0
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return _run_workers(nproc, module_args, **launch_kw)
    except SignalException as e:
        if on_signal is None:
            raise
        on_signal(e.sigval.name)
        return 128 + int(e.sigval)


def _quiet_elastic() -> contextlib.AbstractContextManager:
    """torch's elastic loggers at CRITICAL (each has a level of its own: the agent's "Received 2
    death signal, shutting down workers" came through the parent's)."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401 - its loggers made now

    from ..config import quiet_loggers

    return quiet_loggers("torch.distributed.elastic", level=logging.CRITICAL, children=True)


def _run_workers(nproc: int, module_args: list[str], **launch_kw: Any) -> int:
    import tempfile

    from .launch import forked_workers_apply, launch
    from .worker import FORKABLE, forked

    if module_args[0] == "quantmesh.cli.worker" and module_args[1] in FORKABLE:
        if forked_workers_apply():  # on a Linux host without CUDA: forks of one fork server
            launch_kw.update(fn=forked, fn_args=tuple(module_args[1:]))

    with tempfile.TemporaryDirectory(prefix="quantmesh-errors-") as err_dir:
        os.environ[ERROR_DIR_ENV] = err_dir
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        captured = io.StringIO()
        try:
            # torch's agent logs every signal it sends to the workers; our line says it all
            with _quiet_elastic(), contextlib.redirect_stderr(captured):
                rc = launch(nproc, module_args, module=True, **launch_kw)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
            os.environ.pop(LAUNCHER_ENV, None)
        if rc == 0:
            return 0
        files = sorted(Path(err_dir).glob("rank-*.txt"), key=lambda p: (p.stat().st_mtime, p.name))
        if not files:  # killed (e.g. out of memory) or crashed before it could say anything
            sys.stderr.write(captured.getvalue())
            return rc
        first = files[0]
        rank = first.stem.split("-", 1)[1]
        line = first.read_text().strip()
        print(f"quantmesh: error: rank {rank}: {line}", file=sys.stderr, flush=True)
        return rc
