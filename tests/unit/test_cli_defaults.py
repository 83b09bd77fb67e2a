"""Device-dependent CLI defaults: compiled blocks and the fast decode loop on GPUs, off on CPU,
and the flags that turn each one on or off whatever the device."""

from __future__ import annotations

import os
import sys
import types

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
    assert cfg(repetition_penalty=1.2).use_fast(cuda=True)  # the fast loop has it too
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


def test_our_workers_fork_on_a_host_without_cuda(monkeypatch) -> None:
    """run_workers starts every kind of worker (finetune, generate, demo, verify, serve) forked
    (launch(fn=worker.forked)) on a host without CUDA; a user's script and any worker with
    QUANTMESH_FORK_WORKERS=0 run in fresh interpreters (launch's module path). They fork from the
    launcher itself when it holds the workers' imports (cli/preload.py), else from a fork server."""
    import torch

    from quantmesh.cli import launch, runner, worker

    seen: list[dict] = []

    def fake_launch(nproc, target, **kw):
        seen.append(dict(kw, target=target))
        return 0

    monkeypatch.setattr(launch, "launch", fake_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("QUANTMESH_FORK_WORKERS", raising=False)
    for kind in worker.KINDS:
        assert runner.run_workers(2, ["quantmesh.cli.worker", kind, "{}"]) == 0
        forked = seen[-1].get("fn") is worker.forked
        assert forked, kind
        if forked:
            assert seen[-1]["fn_args"] == (kind, "{}")
    monkeypatch.setenv("QUANTMESH_FORK_WORKERS", "0")
    runner.run_workers(2, ["quantmesh.cli.worker", "finetune", "{}"])
    assert "fn" not in seen[-1] and seen[-1]["module"] is True
    monkeypatch.delenv("QUANTMESH_FORK_WORKERS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runner.run_workers(2, ["quantmesh.cli.worker", "finetune", "{}"])
    assert "fn" not in seen[-1]
    monkeypatch.delitem(sys.modules, "quantmesh.cli.preload", raising=False)
    assert launch._start_method() == "forkserver"  # a command started from a shell
    monkeypatch.setitem(sys.modules, "quantmesh.cli.preload", types.ModuleType("preload"))
    assert launch._start_method() == "fork"  # its imports held here: the workers fork from here
