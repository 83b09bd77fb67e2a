"""A `quantmesh serve` whose worker rank dies ends with an error instead of hanging its clients;
signals to a rank that is stopping do not break the others."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import pytest

from .test_cli_common import make_tiny_llama
from .test_serve import Server

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")


def rank_processes(pid: int, *, suspend: bool = False) -> dict[int, psutil.Process]:
    """The two rank processes under the launcher `pid`, by rank (every worker names its process
    after its rank, before it joins the others: cli/worker.setup_worker). With `suspend`, each is
    stopped (SIGSTOP) as soon as it is found, to be resumed by the caller."""
    ranks: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 30
    while sorted(ranks) != [0, 1] and time.monotonic() < deadline:
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.name().startswith("qm-rank") and child not in ranks.values():
                    if suspend:
                        child.suspend()
                    ranks[int(child.name().removeprefix("qm-rank"))] = child
        if sorted(ranks) != [0, 1]:
            # a rank not yet named: look again shortly, not in a busy loop (at once if suspending)
            time.sleep(0.005 if suspend else 0.1)
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def _exit_code(server: Server, timeout: float) -> int:
    """The server's exit code within `timeout` seconds; else a failure naming what still runs
    and what the server said."""
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        alive: object = "unknown"
        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(server.proc.pid)
            alive = [(p.pid, p.name(), p.status())
                     for p in [launcher, *launcher.children(recursive=True)]]  # fmt: skip
        pytest.fail(f"the server had not exited {timeout:.0f} s later; still running: {alive}\n"
                    f"stdout: {server.out()[-1500:]}\nstderr: {server.err()[-3000:]}")  # fmt: skip


@pytest.mark.slow
def test_a_dead_rank_ends_the_server(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    server = Server([str(model), "--tp", "2"])
    try:
        ranks = rank_processes(server.proc.pid)
        box: dict = {}

        def request() -> None:
            try:
                box["r"] = server.client.completions.create(
                    model="tiny", prompt="To be, or not to be", max_tokens=200, temperature=0
                )
            except openai.APIError as e:  # an error, or the connection closed: not a hang
                box["e"] = e

        t = threading.Thread(target=request)
        t.start()
        ranks[1].send_signal(signal.SIGKILL)
        rc = server.proc.wait(90)
        t.join(60)
        assert not t.is_alive()
        assert rc != 0
        # whichever notices first says it: rank 0's decoding loop (its collective raised), or the
        # launcher, which stops the survivors as soon as it sees rank 1's exit (a race on a busy
        # host: both are the error a user needs, neither a hang)
        err = server.err()
        assert "the decoding loop failed" in err or "worker rank 1 failed" in err, err
    finally:
        server.stop()


@pytest.mark.slow
def test_signals_while_rank_0_stops_leave_the_other_ranks_a_clean_stop(tmp_path) -> None:
    """SIGTERMs reaching rank 0 all through its stop: the launcher sends one to every rank as it
    shuts down (after a second Ctrl-C, say), a supervisor may send more. Before, one that came
    after the HTTP server had returned (uvicorn then puts back the default handler, which ends
    the process) killed rank 0 before it told the other ranks to stop, and rank 1 failed with
    the transport's traceback. Now rank 0, once stopping, only finishes its stop. The signals go
    to rank 0 alone, so the launcher is not shutting down and waits for the ranks' results: a
    forked serve worker used to end without one (a clean stop's exit), and the launcher then
    waited forever for a server whose ranks were gone."""
    model = make_tiny_llama(tmp_path / "tiny")
    server = Server([str(model), "--tp", "2"])
    try:
        pid = rank_processes(server.proc.pid)[0].pid
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:  # every half millisecond: the window once open was about a millisecond wide
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        assert _exit_code(server, 60) == 0, server.err()[-3000:]
        err = server.err()
        assert "Traceback" not in err and "error" not in err, err[-3000:]
    finally:
        server.stop()


@pytest.mark.slow
def test_ranks_stop_when_the_launcher_is_killed_outright(tmp_path) -> None:
    """SIGKILL to the launcher (nothing forwards a stop then): the ranks notice and stop, and the
    port is free again. A forked rank's parent is the fork server, which outlives the launcher:
    rank 0 used to watch only its parent, and the ranks served on forever."""
    model = make_tiny_llama(tmp_path / "tiny")
    server = Server([str(model), "--tp", "2"])
    try:
        ranks = rank_processes(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(list(ranks.values()), timeout=30)
        assert not alive, f"ranks still running 30 s after the launcher died: {alive}"
        assert "the launcher is gone; stopping" in server.out()
        err = server.err()
        assert "Traceback" not in err, err[-3000:]
    finally:
        server.stop()
