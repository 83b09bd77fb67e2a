"""`quantmesh verify MODEL --tp N`: prove the tp plan of a model exact, module group by group.

MODEL is a transformers folder (config.json alone is enough: no weights are read; the probe uses
random ones) or a Python factory `module:function` / `file.py:function` returning a model, or
(model, example inputs). N ranks start on this machine (CPU ranks when there is no GPU); rank 0
prints the verdict of every group of sharded modules and the plan `qm.parallelize` would use.
Exit code 0 when the plan is exact as planned or after the replications it lists, 1 when the model
could not be probed.

Example:
    $ quantmesh verify ~/models/my-llama --tp 2
    $ quantmesh verify my_models.py:build_net --tp 4
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from .errors import CliError, user_errors

__all__ = ["add_parser", "run", "verify_worker", "build_model"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `verify`."""
    p = sub.add_parser(
        "verify",
        help="check the tp plan of a model numerically (sharded vs whole), per module group",
    )
    p.add_argument("model", help="transformers model folder (config.json), or module:function")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.set_defaults(func=run)


def _factory(spec: str) -> Any:
    mod_name, _, fn_name = spec.rpartition(":")
    if mod_name.endswith(".py"):
        path = Path(mod_name).expanduser()
        if not path.is_file():
            raise CliError(f"factory file {mod_name!r} does not exist")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        if loaded is None or loaded.loader is None:
            raise CliError(f"cannot import {mod_name!r}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise CliError(f"cannot import {mod_name!r} ({e}); pass module:function") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise CliError(f"{mod_name} has no function {fn_name!r}")
    return fn


def build_model(spec: str) -> tuple[Any, Any]:
    """(model on meta or CPU, example inputs or None) from a folder or a `module:function`.

    Example:
        >>> model, inputs = build_model("my_models.py:build_net")  # doctest: +SKIP
    """
    path = Path(spec).expanduser()
    if ":" in spec and not path.exists():
        out = _factory(spec)()
        return out if isinstance(out, tuple) else (out, None)
    if not (path / "config.json").is_file():
        raise CliError(
            f"{spec!r} is neither a transformers model folder (with config.json) nor a "
            "module:function factory"
        )
    import transformers
    from transformers import AutoConfig

    from ..parallel.empty import empty_model

    config = AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with empty_model():
        if cls is not None:
            return cls(config), None
        for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
            try:
                return getattr(transformers, auto).from_config(config), None
            except ValueError:
                continue
    raise CliError(f"transformers cannot build a model from {path / 'config.json'}")


def run(args: argparse.Namespace) -> int:
    """The `verify` command: check the arguments, then launch --tp workers (or run in place)."""
    from . import worker
    from .runner import run_workers

    with user_errors():
        if args.tp < 2:
            raise CliError(f"--tp {args.tp}: verify compares a split with the whole; use --tp 2+")
        build_model(args.model)  # fail here, once, before any worker starts
    payload = json.dumps({"model": args.model, "tp": args.tp})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker.run_in_place("verify", payload)
    return run_workers(args.tp, ["quantmesh.cli.worker", "verify", payload])


def verify_worker(payload: str) -> int:
    """One rank of `quantmesh verify`: build the model, verify, print (rank 0)."""
    import quantmesh as qm
    from quantmesh.tp.experts import expert_rows

    cfg = json.loads(payload)
    mesh = qm.init_mesh(tp=cfg["tp"])
    model, inputs = build_model(cfg["model"])
    plan = qm.auto_plan(model, mesh.tp)
    report = qm.verify_plan(model, mesh, plan, inputs=inputs)
    if mesh.rank == 0:
        print(report.table(), flush=True)
        if report.verified:
            print(flush=True)
            extra = expert_rows(model, mesh.tp)
            print(report.apply(plan).table(model, mesh.tp, extra=extra), flush=True)
    return 0 if report.verified else 1
