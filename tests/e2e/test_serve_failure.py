"""A `quantmesh serve` whose worker rank dies ends with an error instead of hanging its clients."""

from __future__ import annotations

import signal
import threading

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
        ranks = {}
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None and "quantmesh.cli.worker" in " ".join(child.cmdline()):
                ranks[int(rank)] = child
        assert sorted(ranks) == [0, 1]
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
        assert "the decoding loop failed" in server.proc.stderr.read()
    finally:
        server.stop()
