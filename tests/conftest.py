"""Suite-wide pytest hooks.

Tests marked `cuda` need a real GPU. `make test` deselects them (`-m "not cuda"`); a plain `pytest`
on a machine without CUDA skips them here with a reason instead of failing on the missing device.
"""

from __future__ import annotations

import pytest


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
