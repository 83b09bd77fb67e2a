"""One clear line for a user's mistake, one line per failed worker; never a wall of tracebacks.

The parent process validates what it can (files, formats, mesh sizes, adapters, memory) before any
worker starts, and turns a user error into `quantmesh: error: ...` with exit code 2. A worker that
fails writes the first line of its error to a per-rank file; the parent prints that line, naming the
rank, instead of the launcher's report. Unexpected errors keep their full traceback in the worker's
log file (and on screen with QUANTMESH_DEBUG=1).

Example:
    >>> raise CliError("--tp 3 does not divide --nproc 4; use --tp 1, 2 or 4")  # doctest: +SKIP
    quantmesh: error: --tp 3 does not divide --nproc 4; use --tp 1, 2 or 4
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "CliError",
    "is_user_error",
    "one_line",
    "quiet_libraries",
    "report",
    "run_workers",
    "worker_main",
]

EXIT_USAGE = 2  # argparse's code for a bad command line; ours for any user mistake
ERROR_DIR_ENV = "QUANTMESH_ERROR_DIR"
DEBUG_ENV = "QUANTMESH_DEBUG"


class CliError(Exception):
    """A mistake in what the user asked for; printed as one line, exit code 2."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the request is wrong", not "quantmesh is broken". Imported lazily."""
    from ..checkpoint import CheckpointKeyError
    from ..data import DataError
    from ..lora import LoraError
    from ..mesh import MeshError
    from ..plan import PlanError
    from ..quant.base import QuantError

    return (
        CliError,
        MeshError,
        PlanError,
        QuantError,
        LoraError,
        DataError,
        CheckpointKeyError,
        FileNotFoundError,
        IsADirectoryError,
        NotADirectoryError,
    )


def is_user_error(exc: BaseException) -> bool:
    """True for the errors a user fixes by changing the command (see `_user_error_types`).

    Example:
        >>> is_user_error(CliError("x")), is_user_error(ZeroDivisionError())
        (True, False)
    """
    return isinstance(exc, _user_error_types())


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message; its type name when it is not a user error.

    Example:
        >>> one_line(ValueError("bad value\\nmore detail"))
        'ValueError: bad value'
    """
    text = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
    first = next((ln for ln in text.splitlines() if ln.strip()), "").strip()
    if is_user_error(exc):
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def report(exc: BaseException, *, rank: int | None = None) -> int:
    """Print `quantmesh: error: ...` (the whole message for user errors) and return the exit code.

    Example:
        >>> report(CliError("model folder 'x' does not exist"))  # doctest: +SKIP
        2
    """
    where = f"rank {rank}: " if rank is not None else ""
    msg = str(exc.args[0]) if is_user_error(exc) and len(exc.args) == 1 else one_line(exc)
    print(f"quantmesh: error: {where}{msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE if is_user_error(exc) else 1


def quiet_libraries() -> None:
    """Silence import-time chatter of optional libraries (torchao's missing GPU kernels on a CPU
    machine, torch's pytree deprecations): warnings about nothing the user asked for, printed once
    per process, so once per rank.

    Example:
        >>> quiet_libraries()
    """
    for name in ("torchao", "bitsandbytes", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn user errors raised inside into `quantmesh: error: ...` and SystemExit(2).

    Example:
        >>> with user_errors():                          # doctest: +SKIP
        ...     validate(args)
    """
    quiet_libraries()
    try:
        yield
    except BaseException as e:  # noqa: B036 - SystemExit/KeyboardInterrupt pass through below
        if isinstance(e, (SystemExit, KeyboardInterrupt)) or not is_user_error(e):
            raise
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        raise SystemExit(report(e)) from None


def worker_main(fn: Callable[[], int | None], *, log_dir: Path | None = None) -> int:
    """Run a worker's body; on failure print one line naming the rank and leave the details behind.

    User errors: the message, exit code 2. Other errors: the first line, the full traceback in
    `log_dir/rank-R.log` (printed too with QUANTMESH_DEBUG=1), exit code 1. The first line also goes
    to $QUANTMESH_ERROR_DIR/rank-R.txt for the launching process.

    Example:
        >>> sys.exit(worker_main(lambda: train(cfg), log_dir=Path("out/logs")))  # doctest: +SKIP
    """
    rank = int(os.environ.get("RANK", "0"))
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


def run_workers(nproc: int, module_args: list[str], **launch_kw) -> int:
    """Launch `python -m <module_args>` on `nproc` workers; on failure print one line per cause.

    The first worker to fail names itself and the first line of its error; the launcher's own
    report (and torch's agent logging) is replaced by that line.

    Example:
        >>> run_workers(2, ["quantmesh.cli.worker", "finetune", "run.json"])  # doctest: +SKIP
        0
    """
    import tempfile

    from .launch import launch

    with tempfile.TemporaryDirectory(prefix="quantmesh-errors-") as err_dir:
        os.environ[ERROR_DIR_ENV] = err_dir
        elastic = logging.getLogger("torch.distributed.elastic")
        old_level = elastic.level
        captured = io.StringIO()
        try:
            # torch's agent logs every SIGTERM it sends to the other workers; our line says it all.
            elastic.setLevel(logging.CRITICAL)
            with contextlib.redirect_stderr(captured):
                rc = launch(nproc, module_args, module=True, **launch_kw)
        finally:
            elastic.setLevel(old_level)
            os.environ.pop(ERROR_DIR_ENV, None)
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
