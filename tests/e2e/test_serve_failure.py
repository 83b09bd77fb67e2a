"""A `quantmesh serve` whose worker rank dies ends with an error instead of hanging its clients."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import pytest

from .test_cli_common import make_tiny_llama
from .test_serve import Server

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")


@pytest.mark.slow
def test_a_dead_rank_ends_the_server(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    server = Server([str(model), "--tp", "2"])
    try:
        ranks = {}  # every worker names its process after its rank (cli/worker.setup_worker)
        deadline = time.monotonic() + 30
        while sorted(ranks) != [0, 1] and time.monotonic() < deadline:
            for child in psutil.Process(server.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.name().startswith("qm-rank"):
                        ranks[int(child.name().removeprefix("qm-rank"))] = child
            if sorted(ranks) != [0, 1]:
                time.sleep(0.1)  # a rank not yet named: look again shortly, not in a busy loop
        assert sorted(ranks) == [0, 1], ranks
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
        err = server.proc.stderr.read()
        assert "the decoding loop failed" in err or "worker rank 1 failed" in err, err
    finally:
        server.stop()
