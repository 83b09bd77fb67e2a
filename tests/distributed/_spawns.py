"""Batched rank jobs: every job of one world size runs in one launch, once per pytest session.

Spawning ranks costs seconds (imports, a process group), so a case module lists its jobs by world
size (`JOBS`: {world: [(function name, *arguments), ...]}), defines a module-level `run_jobs(rank,
jobs)` that calls them in order (spawned ranks import it by name), and reads results through
`JobSpawns.result(job)`, which launches that world size the first time any of its jobs is asked for.

Example:
    >>> spawns = JobSpawns(JOBS, run_jobs)         # doctest: +SKIP
    >>> rank0, rank1 = spawns.result(("train", 2))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any


class JobSpawns:
    """The per-rank results of `jobs`, one `run_ranks` launch per world size, cached.

    `tmp_env`: the name of an environment variable that holds a temporary folder for the launch
    (the ranks inherit the caller's environment), removed after it.
    """

    def __init__(
        self,
        jobs: dict[int, list[tuple]],
        run_jobs: Callable[[int, list[tuple]], list],
        *,
        timeout: float = 400,
        tmp_env: str | None = None,
    ) -> None:
        self.jobs, self.run_jobs, self.timeout, self.tmp_env = jobs, run_jobs, timeout, tmp_env
        self._done: dict[int, dict[tuple, list]] = {}

    def spawned(self, world: int) -> dict[tuple, list]:
        """{job: [result of rank 0, rank 1, ...]} for every job of `world` ranks."""
        if world not in self._done:
            self._done[world] = self._launch(world)
        return self._done[world]

    def _launch(self, world: int) -> dict[tuple, list]:
        from quantmesh.testing import run_ranks

        def launch() -> list[Any]:
            return run_ranks(self.run_jobs, world, self.jobs[world], timeout=self.timeout)

        if self.tmp_env is None:
            res = launch()
        else:
            with tempfile.TemporaryDirectory() as tmp:
                os.environ[self.tmp_env] = tmp
                try:
                    res = launch()
                finally:
                    del os.environ[self.tmp_env]
        return {job: [r[i] for r in res] for i, job in enumerate(self.jobs[world])}

    def result(self, job: tuple) -> list:
        """The per-rank results of `job`, from the launch of its world size."""
        for world, jobs in self.jobs.items():
            if job in jobs:
                return self.spawned(world)[job]
        raise KeyError(f"{job} is in no spawn; add it to JOBS")
