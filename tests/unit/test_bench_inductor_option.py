"""The benchmarks' `--inductor KEY=VALUE` (benchmarks/qmbench.py `inductor_config`): an option of
torch._inductor.config set for the run, nested ones by a dotted name, and every mistake refused
with its reason before anything runs (a typo must not time the defaults under another name)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch._inductor.config as config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import qmbench  # noqa: E402


@pytest.fixture(autouse=True)
def _restored():
    with config.patch(combo_kernels=config.combo_kernels, max_autotune=config.max_autotune,
                      combo_kernel_max_num_args=config.combo_kernel_max_num_args,
                      combo_kernel_peak_memory_pct_threshold=config.combo_kernel_peak_memory_pct_threshold):  # fmt: skip
        yield


def test_options_are_set_top_level_and_nested() -> None:
    want = not config.combo_kernels
    nested = config.triton.cudagraph_trees
    try:
        done = qmbench.inductor_config(
            [f"combo_kernels={want}", "combo_kernel_max_num_args=17",
             f"triton.cudagraph_trees={not nested}", "combo_kernel_peak_memory_pct_threshold=1"]
        )  # fmt: skip
        assert config.combo_kernels is want and config.combo_kernel_max_num_args == 17
        assert config.triton.cudagraph_trees is (not nested)
        assert config.combo_kernel_peak_memory_pct_threshold == 1.0  # an int for a float option
        assert done["combo_kernel_max_num_args"] == 17
    finally:
        config.triton.cudagraph_trees = nested


@pytest.mark.parametrize(
    ("pair", "said"),
    [
        ("combo_kernels", "expected KEY=VALUE"),
        ("no_such_option=1", "has no option 'no_such_option'"),
        ("triton.no_such_option=1", "has no option 'triton.no_such_option'"),
        ("combo_kernels=yes", "is not a Python literal"),
        ("combo_kernels=1", "holds a bool"),
    ],
)
def test_mistakes_are_refused_with_the_reason(pair: str, said: str) -> None:
    before = config.combo_kernels
    with pytest.raises(SystemExit, match=said):
        qmbench.inductor_config([pair])
    assert config.combo_kernels is before


def test_the_flag_reaches_the_config_through_the_parser() -> None:
    import argparse

    p = argparse.ArgumentParser()
    qmbench.shape_args(p)
    a = qmbench.finish_args(p.parse_args(["--inductor", "max_autotune=True"]))
    assert a.inductor == ["max_autotune=True"] and config.max_autotune is True


@pytest.mark.parametrize(
    ("variants", "said"),
    [
        ("default,inductor:no_such_option=1", "has no option 'no_such_option'"),
        ("inductor:combo_kernels=yes", "is not a Python literal"),
        ("default,no_such_variant", "unknown variant 'no_such_variant'"),
        ("inductor", "unknown variant 'inductor'"),
        ("fused_adamw+fused_adamw", "names 'fused_adamw' twice"),
    ],
)
def test_bench_train_refuses_a_bad_variant_before_it_runs(variants: str, said: str, capsys) -> None:
    """bench_train.py checks every variant as it parses its flags, so a typo in the last one
    does not surface after the main run's minutes (inductor:KEY=VALUE's options included)."""
    import bench_train

    with pytest.raises(SystemExit) as e:
        bench_train.parse(["--smoke", "--variants", variants])
    assert said in str(e.value) + capsys.readouterr().err


def test_bench_train_splits_inductor_options_from_the_other_parts() -> None:
    import bench_train

    parts, pairs = bench_train.split_variant(
        "keep_dequantized:3+inductor:combo_kernels=True+inductor:max_autotune=False"
    )
    assert parts == {"keep_dequantized": "3"}
    assert pairs == ["combo_kernels=True", "max_autotune=False"]


def test_a_patch_lasts_while_its_context_does_and_an_error_leaves_nothing() -> None:
    before, nested = config.combo_kernels, config.triton.cudagraph_trees
    with qmbench.inductor_patched([f"combo_kernels={not before}",
                                   f"triton.cudagraph_trees={not nested}"]):  # fmt: skip
        assert config.combo_kernels is (not before)
        assert config.triton.cudagraph_trees is (not nested)
    assert (config.combo_kernels, config.triton.cudagraph_trees) == (before, nested)
    with pytest.raises(RuntimeError), qmbench.inductor_patched([f"combo_kernels={not before}"]):
        raise RuntimeError("a variant failed")
    assert config.combo_kernels is before
    with pytest.raises(SystemExit):  # a bad pair among good ones: none is set
        with qmbench.inductor_patched([f"combo_kernels={not before}", "no_such_option=1"]):
            pass
    assert config.combo_kernels is before
