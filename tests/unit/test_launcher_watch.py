"""A worker's watch on its launcher (cli/runner.LauncherWatch), in child processes whose
"launcher" is a process the test kills: a worker that has not joined its peers stops at once (the
rendezvous store was the launcher's: it would retry its connection for the whole timeout), one
that has joined goes on, and one that has finished ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(code: str, launcher: subprocess.Popen) -> subprocess.Popen:
    env = dict(os.environ, QUANTMESH_LAUNCHER_PID=str(launcher.pid), RANK="1")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@pytest.fixture
def launcher():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def _wait_for(proc: subprocess.Popen, line: str) -> None:
    got = proc.stdout.readline()
    assert got.strip() == line, (got, proc.stderr.read() if proc.poll() is not None else "")


def test_a_rank_waiting_to_join_stops_when_its_launcher_dies(launcher) -> None:
    # rank 1 of 2 connects to a rendezvous nobody serves (as after its launcher died): torch
    # retries the connection until the timeout, here two minutes
    child = _child(
        f"""
        from datetime import timedelta
        from quantmesh.cli.runner import LauncherWatch
        LauncherWatch.start()
        import torch.distributed as dist
        print("joining", flush=True)
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=1,
                                world_size=2, timeout=timedelta(seconds=120))
        print("joined", flush=True)
        """,
        launcher,
    )
    try:
        _wait_for(child, "joining")
        time.sleep(1.0)
        assert child.poll() is None  # its launcher is alive: it waits
        launcher.kill()  # not reaped: a zombie launcher counts as gone
        _, err = child.communicate(timeout=30)
        assert child.returncode == 1, err
        assert "rank 1: the launching process ended before this rank joined the others" in err
    finally:
        child.kill()
        child.wait()


def test_a_joined_rank_goes_on_and_a_finished_one_ends(launcher) -> None:
    child = _child(
        f"""
        import sys, time
        from quantmesh.cli.runner import LauncherWatch
        watch = LauncherWatch.start()
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1)
        time.sleep(0.5)  # the watch sees the group
        dist.destroy_process_group()  # as a worker's last step
        print("working", flush=True)
        sys.stdin.readline()  # the test's word, once it has killed the launcher
        print("finished", flush=True)
        watch.finished(after_s=None)
        time.sleep(300)  # as torch's _wrap waits for a launcher to collect the result
        """,
        launcher,
    )
    try:
        _wait_for(child, "working")
        launcher.kill()
        time.sleep(1.5)
        assert child.poll() is None  # joined and not finished: it goes on
        child.stdin.write("go\n")
        child.stdin.flush()
        _wait_for(child, "finished")
        _, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("queued", [True, False])
def test_a_finished_rank_ends_after_its_grace_with_its_launcher_alive(launcher, queued) -> None:
    # its result queued (as torch's `_wrap` puts it): the grace alone; never queued (a host too
    # starved to get there): RESULT_WAIT_S more, so that a result on its way is not lost
    child = _child(
        f"""
        import multiprocessing as mp, time
        from quantmesh.cli.runner import LauncherWatch
        watch = LauncherWatch.start()
        watch.finished(after_s=1.0)
        q = mp.get_context("fork").Queue()
        if {queued}:
            q.put(0)
        print("finished", flush=True)
        time.sleep(300)
        """,
        launcher,
    )
    try:
        _wait_for(child, "finished")
        start = time.monotonic()
        _, err = child.communicate(timeout=30)
        took = time.monotonic() - start
        assert child.returncode == 0, err
        assert (0.8 <= took < 4.0) if queued else (5.5 <= took < 20), took
        assert launcher.poll() is None
    finally:
        child.kill()
        child.wait()


QUEUED = """
import multiprocessing as mp, time
from quantmesh.cli.runner import LauncherWatch

def worker(q):  # as a forked worker returns its result through torch's `_wrap`: a queue
    watch = LauncherWatch.start()
    q.put(b"x" * (8 << 20))  # far more than a pipe holds: the feeder thread sends it in pieces
    watch.finished(after_s=0.0)  # ended at once by the watch, not by a normal exit
    time.sleep(300)

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,))
    p.start()
    time.sleep(1.5)  # nothing read meanwhile: the worker is past its end before its result is
    print(len(q.get(timeout=30)), flush=True)
    p.join(30)
    print(p.exitcode, flush=True)
"""


def test_a_finished_worker_ends_only_once_its_queued_result_is_sent(tmp_path) -> None:
    # ended with its result still in the queue's feeder thread, the reader (the launcher) got
    # part of it and waited for the rest forever
    script = tmp_path / "queued.py"
    script.write_text(QUEUED)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert r.stdout.split() == [str(8 << 20), "0"], (r.stdout, r.stderr[-2000:])
