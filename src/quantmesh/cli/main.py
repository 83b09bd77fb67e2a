"""`quantmesh` console script: subcommands dispatch to small modules, imported only when used."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["main", "run"]


def _run(args: argparse.Namespace) -> int:
    from .launch import launch

    if not args.target:
        print("quantmesh run: name a script (or -m module) to launch", file=sys.stderr)
        return 2
    return launch(
        args.nproc,
        args.target,
        module=args.module,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        node_rank=args.node_rank,
    )


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(
        prog="quantmesh",
        description="Quantized + LoRA training and serving of any PyTorch model over dp x tp meshes.",
    )
    p.add_argument("--version", action="version", version=f"quantmesh {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="launch N worker processes running a script (torchrun inside)")
    r.add_argument("--nproc", type=int, default=1, help="worker processes on this node")
    r.add_argument("--nnodes", default="1", help="nodes, as torchrun takes it (e.g. 2 or 1:4)")
    r.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    r.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    r.add_argument("-m", "--module", action="store_true", help="target is a module, as python -m")
    r.add_argument("target", nargs=argparse.REMAINDER, help="script and its arguments")
    r.set_defaults(func=_run)

    from . import commands

    commands.add_subcommands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `quantmesh` command. Returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


def run() -> NoReturn:
    """The `quantmesh` console script (and `python -m quantmesh`): `main()`, then the process ends
    at once (runner.exit_fast) instead of tearing down torch's modules for seconds.

    Example:
        $ quantmesh plan --model ./m --nproc 4
    """
    from .runner import exit_fast

    exit_fast(main)


if __name__ == "__main__":
    run()
