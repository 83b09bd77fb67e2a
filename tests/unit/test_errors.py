"""QuantmeshError: every error class raised for a user's mistake derives from it, keeps its built-in
base, and the command line reports every one of them the same way (one line, exit code 2), in the
launching process (`user_errors`) and in a worker (`worker_main`).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import quantmesh as qm
from quantmesh.cli import errors as cli_errors
from quantmesh.cli.runner import worker_main
from quantmesh.errors import QuantmeshError

SRC = Path(__file__).resolve().parents[2] / "src" / "quantmesh"

# Error classes that are not a user's mistake, and why. Every other class named *Error (or
# deriving from an exception) under src/quantmesh must derive from QuantmeshError.
NOT_MISTAKES = {
    "testing.RanksFailed": "the test harness: ranks of the code under test failed or hung",
    "serve.protocol.ApiError": "an HTTP reply in OpenAI's shape, turned into a response by the app",
    "serve.scheduler.AdapterSlotsFull": "the server is full (an HTTP 409), not a wrong request",
    "pipeline.stage._StageEnd": "control flow: a stage's last block ends the model's forward",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined at module level under src/quantmesh, by dotted name."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if not names:
            continue
        mod = importlib.import_module(f"quantmesh.{rel}")
        for name in names:
            cls = getattr(mod, name)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found[f"{rel}.{name}"] = cls
    return found


CLASSES = _exception_classes()


def test_every_error_for_a_mistake_derives_from_quantmesh_error() -> None:
    assert len(CLASSES) >= 17  # the scan found them (a broken scan would pass vacuously)
    assert set(NOT_MISTAKES) <= set(CLASSES)
    loose = sorted(
        name
        for name, cls in CLASSES.items()
        if name not in NOT_MISTAKES and not issubclass(cls, QuantmeshError)
    )
    assert loose == [], f"derive these from QuantmeshError (or list why not): {loose}"
    for name in NOT_MISTAKES:
        assert not issubclass(CLASSES[name], QuantmeshError), name


@pytest.mark.parametrize(
    ("name", "base"),
    [
        ("parallel.mesh.MeshError", ValueError),
        ("plan.plan.PlanError", ValueError),
        ("config.PipelineError", ValueError),
        ("config.QuantError", ValueError),
        ("config.LoraError", ValueError),
        ("config.FsdpError", ValueError),
        ("io.load.LoadError", ValueError),
        ("train.formats.DataError", ValueError),
        ("config.TrainError", ValueError),
        ("config.ConfigError", ValueError),
        ("io.reader.CheckpointKeyError", KeyError),
        ("parallel.state.NotParallelizedError", RuntimeError),
    ],
)
def test_the_built_in_base_stays(name: str, base: type[BaseException]) -> None:
    """`except ValueError` (or KeyError, RuntimeError) written before the common base still works."""
    cls = CLASSES[name]
    assert issubclass(cls, base) and issubclass(cls, QuantmeshError)
    with pytest.raises(base):
        raise cls("a mistake")


def test_the_base_is_public() -> None:
    assert qm.QuantmeshError is QuantmeshError and "QuantmeshError" in qm.__all__


def _fsdp_error() -> BaseException:
    from quantmesh.parallel.fsdp import FsdpError

    return FsdpError("fsdp=True with pp=2: not implemented; use pp=1 with fsdp\nmore detail")


def _load_error() -> BaseException:
    from quantmesh.io.load import LoadError

    return LoadError("checkpoint holds model.x of shape (4, 8), the model (4, 9); fix the folder")


@pytest.mark.parametrize("make", [_fsdp_error, _load_error])
def test_the_launching_command_reports_a_user_error_in_one_line_with_exit_code_2(
    make, capsys
) -> None:
    """FsdpError and LoadError were missing from the CLI's former hand list (exit code 1)."""
    exc = make()
    with pytest.raises(SystemExit) as e, cli_errors.user_errors():
        raise exc
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"quantmesh: error: {str(exc.args[0])}")
    assert "Traceback" not in err


@pytest.mark.parametrize("make", [_fsdp_error, _load_error])
def test_a_worker_reports_a_user_error_in_one_line_with_exit_code_2(
    make, tmp_path: Path, monkeypatch
) -> None:
    exc = make()
    monkeypatch.setenv(cli_errors.ERROR_DIR_ENV, str(tmp_path / "err"))
    monkeypatch.setenv("RANK", "1")
    (tmp_path / "err").mkdir()

    def body() -> int:
        raise exc

    assert worker_main(body, log_dir=tmp_path / "logs") == 2
    line = (tmp_path / "err" / "rank-1.txt").read_text().strip()
    assert line == str(exc.args[0]).splitlines()[0]  # the first line, no type name, no traceback
    assert not (tmp_path / "logs").exists()  # a user error leaves no traceback log


def test_a_worker_reports_other_errors_as_internal_with_exit_code_1(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(cli_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")

    def body() -> int:
        raise ValueError("an unexpected value deep inside")

    assert worker_main(body, log_dir=tmp_path / "logs") == 1
    line = (tmp_path / "rank-0.txt").read_text().strip()
    assert line.startswith("ValueError: an unexpected value deep inside (traceback: ")
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_a_run_that_does_not_fit_the_data_is_a_user_error() -> None:
    """What the finetune worker once converted by hand (plain ValueErrors of build_dataset and
    train) now raises a QuantmeshError at the source."""
    from quantmesh.train.data import build_dataset, iterate_batches
    from quantmesh.train.loop import TrainConfig, total_steps

    for call in (
        lambda: build_dataset([], None, 16),
        lambda: iterate_batches([], 2, dp_rank=0, dp_size=1, seed=0, epoch=0),
        lambda: TrainConfig(lr=0),
        lambda: total_steps(3, TrainConfig(micro_batch=2, grad_accum=2), dp=1),
    ):
        with pytest.raises(QuantmeshError) as e:
            list(call())  # iterate_batches is a generator
        assert cli_errors.is_user_error(e.value)
