"""Registry of the CLI's subcommands beyond `run`: plan, finetune, generate, demo, verify, serve.

Each lives in its own module with an `add_parser(sub)` that registers its flags and handler; the
heavy imports (torch, transformers) happen inside the handlers, so `quantmesh --help` stays fast.
"""

from __future__ import annotations

import argparse

from . import demo, finetune, generate, plan_cmd, serve, verify_cmd


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add the parsers of plan, finetune, generate, demo, verify and serve to the `quantmesh` command.

    Example:
        >>> p = argparse.ArgumentParser(); add_subcommands(p.add_subparsers())  # doctest: +SKIP
    """
    plan_cmd.add_parser(sub)
    finetune.add_parser(sub)
    generate.add_parser(sub)
    demo.add_parser(sub)
    verify_cmd.add_parser(sub)
    serve.add_parser(sub)
