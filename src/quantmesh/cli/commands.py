"""Registry of the CLI's subcommands beyond `run` (plan, finetune, generate, demo)."""

from __future__ import annotations

import argparse


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add each subcommand's parser; each module registers itself here as it lands."""
    d = sub.add_parser("demo", help="the embedded default: a small real model fine-tuned on CPU ranks")
    d.set_defaults(func=_demo_placeholder)


def _demo_placeholder(args: argparse.Namespace) -> int:
    from .launch import launch

    return launch(2, ["quantmesh.cli.hello"], module=True)
