"""`dresd fetch-model`: provision and cache the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse

from dresd.models.target import ensure_default_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    fetch = commands.add_parser("fetch-model", help="provision and cache the default model")
    fetch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(ensure_default_model())
    return 0
