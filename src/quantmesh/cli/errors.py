"""One clear line for a user's mistake, one line per failed worker; never a wall of tracebacks.

The parent process validates what it can (files, formats, mesh sizes, adapters, memory) before any
worker starts, and turns a user error into `quantmesh: error: ...` with exit code 2. A worker that
fails writes the first line of its error to a per-rank file; the parent prints that line, naming the
rank, instead of the launcher's report (runner.py runs the workers). Unexpected errors keep their
full traceback in the worker's log file (and on screen with QUANTMESH_DEBUG=1).

Example:
    >>> raise CliError("--tp 3 does not divide --nproc 4; use --tp 1, 2 or 4")  # doctest: +SKIP
    quantmesh: error: --tp 3 does not divide --nproc 4; use --tp 1, 2 or 4
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator

from ..errors import QuantmeshError

__all__ = [
    "USER_ERRORS",
    "CliError",
    "is_user_error",
    "one_line",
    "quiet_libraries",
    "report",
]

EXIT_USAGE = 2  # argparse's code for a bad command line; ours for any user mistake
ERROR_DIR_ENV = "QUANTMESH_ERROR_DIR"
DEBUG_ENV = "QUANTMESH_DEBUG"


class CliError(QuantmeshError):
    """A mistake in what the user asked for; printed as one line, exit code 2."""


# What the user fixes by changing the command: every quantmesh error for a mistake derives from
# QuantmeshError (so a new error class needs no entry here), and Python's own errors for a path the
# user named that is missing or of the wrong kind (a file where a folder belongs, or the reverse).
USER_ERRORS: tuple[type[BaseException], ...] = (
    QuantmeshError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
)


def is_user_error(exc: BaseException) -> bool:
    """True for the errors a user fixes by changing the command: a `QuantmeshError` (any of
    quantmesh's errors for a mistake) or a path that is missing or of the wrong kind.

    Example:
        >>> is_user_error(CliError("x")), is_user_error(ZeroDivisionError())
        (True, False)
    """
    return isinstance(exc, USER_ERRORS)


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
