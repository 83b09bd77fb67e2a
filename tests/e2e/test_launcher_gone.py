"""Workers whose launcher was killed outright (SIGKILL: nothing forwards a stop) end: one that had
not joined the others, instead of retrying its connection to the launcher's rendezvous for the
whole timeout; one that had, once it has finished, instead of waiting forever for the launcher to
collect its result (a forked worker returns it through torch's `_wrap`, which waits until the
launcher has read it). Which of the two a rank is depends on how far it got when the launcher
died; the unit tests (tests/unit/test_launcher_watch.py) take each apart."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

from .test_cli_common import CLI, REPO, make_tiny_llama
from .test_serve_failure import rank_processes

psutil = pytest.importorskip("psutil")


@pytest.mark.slow
def test_workers_whose_launcher_was_killed_end(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.Popen(
        [*CLI, "generate", str(model), "--tp", "2", "--prompt", "To be, or not to be",
         "--max-new-tokens", "64"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        ranks = rank_processes(proc.pid, suspend=True)  # caught early: most often not joined
        os.kill(proc.pid, signal.SIGKILL)
        for rank in ranks.values():
            rank.resume()
        _, alive = psutil.wait_procs(list(ranks.values()), timeout=60)
        assert not alive, f"ranks still running 60 s after their launcher died: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
