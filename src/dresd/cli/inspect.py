"""`dresd inspect`: what a datastore holds (entries, dims, bytes per token, model, sources), or
what a GGUF model file holds (architecture, tensor types, size, whether dresd runs it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dresd.datastore.inspect import describe, format_description
from dresd.models.gguf import refusal
from dresd.models.gguf_file import describe as describe_gguf
from dresd.models.gguf_file import is_gguf, open_gguf


def add_parser(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="what a datastore or a GGUF file holds")
    inspect.add_argument("datastore", type=Path, help="a datastore folder or a FILE.gguf")
    inspect.add_argument("--verify", action="store_true",
                         help="hash every file, also the large ones the open-time check leaves "
                              "to sizes and headers")
    inspect.add_argument("--json", action="store_true", help="print the figures as JSON")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if is_gguf(str(args.datastore)):
        reader = open_gguf(args.datastore)  # a damaged file is an error
        figures = describe_gguf(reader)
        refused = refusal(reader, args.datastore) if figures["forward"] else None
        if refused:  # what loading it would say (the metadata and every tensor, checked)
            figures.update(dresd_runs_it_natively=f"no ({refused})", forward=None)
        print(json.dumps(figures, indent=2) if args.json else
              "\n".join(f"{key}: {value}" for key, value in figures.items()))
        return 0
    figures = describe(args.datastore, verify=args.verify)  # a damaged store is an error
    print(json.dumps(figures, indent=2) if args.json else format_description(figures))
    return 0
