"""Device-dependent CLI defaults: compiled blocks and the fast decode loop on GPUs, off on CPU,
and the flags that turn each one on or off whatever the device."""

from __future__ import annotations

import os

import pytest

from quantmesh.cli.finetune import FinetuneConfig
from quantmesh.cli.generate import GenerateConfig
from quantmesh.cli.main import build_parser


def _flag(argv: list[str], name: str) -> bool | None:
    return getattr(build_parser().parse_args(argv), name)


@pytest.mark.parametrize(
    ("extra", "want"), [([], None), (["--compile"], True), (["--no-compile"], False)]
)
def test_finetune_compile_flags(extra: list[str], want: bool | None) -> None:
    assert _flag(["finetune", "--model", "m", *extra], "compile") is want


def test_finetune_compiles_on_gpus_unless_told() -> None:
    def cfg(**kw) -> FinetuneConfig:
        c = FinetuneConfig.from_settings({"model": "m", "data": ["d.txt"], **kw})
        return FinetuneConfig.from_json(c.to_json())  # as the workers receive it

    def on(c: FinetuneConfig, cuda: bool) -> bool:
        return c.activations.compile_on(cuda)

    assert on(cfg(), cuda=True) and not on(cfg(), cuda=False)
    assert not on(cfg(compile=False), cuda=True)
    assert on(cfg(compile=True), cuda=False)
    # with MLP tiles too (each tile compiled on its own: less memory than eager on one H200)
    tiled = {"checkpointing": True, "tile_tokens": 8192}
    assert on(cfg(**tiled), cuda=True)
    assert not on(cfg(compile=False, **tiled), cuda=True)


@pytest.mark.parametrize(
    ("extra", "want"), [([], None), (["--fast"], True), (["--no-fast"], False)]
)
def test_generate_fast_flags(extra: list[str], want: bool | None) -> None:
    assert _flag(["generate", "m", "--prompt", "hi", *extra], "fast") is want


def test_generate_decodes_fast_on_gpus_unless_a_setting_needs_generate() -> None:
    def cfg(**kw) -> GenerateConfig:
        return GenerateConfig(model="m", prompts=["hi"], **kw)

    assert cfg().use_fast(cuda=True) and not cfg().use_fast(cuda=False)
    assert cfg(temperature=0.7, top_p=0.9).use_fast(cuda=True)  # sampling runs in the fast loop
    assert not cfg(repetition_penalty=1.2).use_fast(cuda=True)  # only generate() has it
    assert not cfg(kv_cache=False).use_fast(cuda=True)
    assert not cfg(fast=False).use_fast(cuda=True)
    assert cfg(fast=True).use_fast(cuda=False)


def test_workers_let_cuda_memory_grow_in_place_unless_told(monkeypatch) -> None:
    """Expandable segments by default (fragmentation ran a near-limit run out of memory on one
    H200); a user's PYTORCH_CUDA_ALLOC_CONF is kept as it is."""
    from transformers.utils import logging as hf_logging

    from quantmesh.cli import worker

    level = hf_logging.get_verbosity()
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # setup_worker's other default, restored after
    try:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        worker.setup_worker()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
        worker.setup_worker()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    finally:
        hf_logging.set_verbosity(level)
