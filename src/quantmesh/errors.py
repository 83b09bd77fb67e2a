"""`QuantmeshError`: the one base of every error quantmesh raises for a user's mistake.

A mistake is something the caller fixes by changing what they asked for (a mesh size, a plan rule,
a quant format, a data file, a run length); the message says what was found, what was expected and
the fix. Each error class keeps a built-in base as well (`MeshError(QuantmeshError, ValueError)`),
so `except ValueError` written before this base existed still catches it. Anything else that
escapes quantmesh is a bug or an environment failure, not a mistake in the request: the command
line reports a `QuantmeshError` as one line with exit code 2, everything else with its traceback.

Example:
    >>> import quantmesh as qm
    >>> try:
    ...     qm.QuantConfig(format="nf5")
    ... except qm.QuantmeshError as e:
    ...     print(type(e).__name__)
    QuantError
"""

from __future__ import annotations

__all__ = ["QuantmeshError", "said"]


class QuantmeshError(Exception):
    """Base of every error raised for a user's mistake; the message names the fix.

    Example:
        >>> class MyError(QuantmeshError, ValueError): ...
        >>> isinstance(MyError("bad"), ValueError)
        True
    """


def said(e: BaseException) -> str:
    """Another library's error (a compiler's, the CUDA runtime's) in one line, as quantmesh's
    warnings quote it: the backend's own exception where dynamo wrapped it, its first line (and
    the next where the first ends in a colon).

    Example:
        >>> said(ValueError("bad shape:\\n  (2, 3)"))
        'ValueError: bad shape: (2, 3)'
    """
    inner = getattr(e, "inner_exception", None) or e
    lines = [line.strip() for line in str(inner).strip().splitlines() if line.strip()] or [""]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # ("... Got graph break/error:": the reason next)
        first = f"{first} {lines[1]}"
    return f"{type(inner).__name__}: {first}"
