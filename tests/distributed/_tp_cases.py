"""The one spawn per tp size shared by test_tp_exact.py (plain PyTorch models) and
test_tp_models.py (transformers models): spawning dominates their cost, so each tp size is launched
once per pytest session and runs both modules' rank functions; each module reads its own part."""

from __future__ import annotations

import functools


def _both(rank: int, tp: int) -> dict:
    from . import test_tp_exact, test_tp_models

    return {"exact": test_tp_exact._rank(rank, tp), "models": test_tp_models._rank(rank, tp)}


@functools.cache
def _spawn(tp: int) -> list[dict]:
    from quantmesh.testing import run_ranks

    return run_ranks(_both, tp, tp, timeout=600)


def facts(tp: int, part: str) -> list[dict]:
    """Per-rank results of `part` ("exact" or "models") at `tp`."""
    return [r[part] for r in _spawn(tp)]
