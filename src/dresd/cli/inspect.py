"""`dresd inspect`: what a datastore holds (entries, dims, bytes per token, model, sources)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dresd.datastore.inspect import describe, format_description


def add_parser(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="what a datastore holds")
    inspect.add_argument("datastore", type=Path)
    inspect.add_argument("--verify", action="store_true",
                         help="hash every file, also the large ones the open-time check leaves "
                              "to sizes and headers")
    inspect.add_argument("--json", action="store_true", help="print the figures as JSON")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    figures = describe(args.datastore, verify=args.verify)  # a damaged store is an error
    print(json.dumps(figures, indent=2) if args.json else format_description(figures))
    return 0
