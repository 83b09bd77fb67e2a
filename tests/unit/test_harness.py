"""The multi-rank harness itself: results in rank order, a failing rank, a hanging rank.

Every other multi-rank test relies on `run_ranks` never hanging and always showing each rank's
traceback, so these tests pin exactly that. The rank functions live at module level because the
spawned ranks import them by name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from quantmesh.testing import RanksFailed, run_ranks


def _report(rank: int, tag: str, *, scale: int) -> tuple[int, str, int, str]:
    # Later ranks finish first (rank 0 sleeps longest), so arrival order is the reverse of rank
    # order and only the harness's sorting can put them back.
    time.sleep(0.4 * (1 - rank))
    return rank, tag, rank * scale, os.environ["WORLD_SIZE"]


def test_results_come_back_in_rank_order_with_args_and_kwargs() -> None:
    out = run_ranks(_report, 2, "hello", scale=10, timeout=60)
    assert out == [(0, "hello", 0, "2"), (1, "hello", 10, "2")]


def _threads(rank: int) -> int:
    import torch

    return torch.get_num_threads()


def test_ranks_take_one_thread_when_omp_num_threads_is_set_but_empty(monkeypatch) -> None:
    """OMP_NUM_THREADS="" in the environment (set, no value) gives each rank one thread, as when
    it is unset, instead of every rank failing on int("")."""
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert run_ranks(_threads, 1, timeout=60) == [1]


def _raise_on_rank_1(rank: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("rank 1 exploded on purpose")
    time.sleep(300)  # rank 0 would sit here far past the test's bounds unless the harness kills it


def test_a_failing_rank_stops_the_others_quickly_and_shows_its_traceback(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_1, 2, str(tmp_path), timeout=100)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    # Well below the 100 s timeout: the failure, not the deadline, ended the run. Spawning two
    # ranks on a busy 2-core machine takes a few seconds, hence the margin.
    assert elapsed < 40, f"took {elapsed:.1f} s; the harness should stop at the first failure"
    assert "2 ranks failed" in msg
    assert "--- rank 1: Traceback (most recent call last)" in msg
    assert "in _raise_on_rank_1" in msg
    assert "ValueError: rank 1 exploded on purpose" in msg
    assert "--- rank 0: did not finish (stopped)" in msg
    # The sleeping rank is gone, not left behind as an orphan.
    pid0 = int((tmp_path / "rank0.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


def _hang_on_rank_1(rank: int) -> str:
    if rank == 1:
        _stuck_here_forever()
    return "rank 0 done"


def _stuck_here_forever() -> None:
    while True:
        time.sleep(1)


def test_a_hanging_rank_times_out_with_its_stack() -> None:
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:  # the deadline counts from the ranks' start
        run_ranks(_hang_on_rank_1, 2, timeout=5)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    # 5 s deadline + 0.5 s for the stack dump + joins; generous for a loaded machine.
    assert 5 <= elapsed < 25, f"took {elapsed:.1f} s with timeout=5"
    assert "2 ranks timed out after 5 s" in msg
    assert "--- rank 0: finished" in msg
    assert "--- rank 1: did not finish (stopped)" in msg
    # faulthandler's dump of the hanging rank: the frame it was stuck in, and its caller.
    rank1 = msg.split("--- rank 1:", 1)[1]
    assert "(most recent call first)" in rank1
    assert "in _stuck_here_forever" in rank1
    assert "in _hang_on_rank_1" in rank1


def _return_unpicklable(rank: int) -> object:
    return lambda: rank  # a lambda cannot be pickled back to the parent


def test_an_unpicklable_result_fails_fast_instead_of_waiting_for_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_return_unpicklable, 1, timeout=100)
    assert time.monotonic() - t0 < 40
    assert "pickle" in str(info.value).lower()


def test_an_unpicklable_function_is_refused_before_spawning() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda rank: rank, 2, timeout=10)


def _join(rank: int) -> int:
    import quantmesh as qm

    qm.init_mesh()  # rank 0 binds the group's store at MASTER_PORT
    return rank


def test_a_port_taken_between_picking_and_binding_is_picked_again(monkeypatch) -> None:
    """run_ranks picks a free port, then rank 0 binds it: another process (a second pytest
    worker) can take it in between. The launch then fails with EADDRINUSE and is retried on a
    new port; any other failure is reported at once."""
    import socket

    import quantmesh.testing as testing

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    free = testing._free_port
    monkeypatch.setattr(testing, "_free_port", lambda: ports.pop() if ports else free())
    try:
        assert run_ranks(_join, 2, timeout=120) == [0, 1]
    finally:
        taken.close()
    assert ports == []  # the taken port was tried first
