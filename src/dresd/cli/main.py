"""`dresd`'s entry point: the parser of every subcommand, and how a failure is reported.

Every failure the user can cause (unknown model, empty or too long prompt, bad sampling values)
ends with a one-line `dresd: error: ...` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from dresd.cli import bench, build, calibrate, corpus, fetch_model, generate, inspect, serve
from dresd.corpus import CorpusError
from dresd.datastore.format import DatastoreError, partial_dir
from dresd.errors import UserError
from dresd.models import ModelError

# The subcommands in the order `dresd --help` lists them.
COMMANDS = [generate, bench, serve, calibrate, fetch_model, build, corpus, inspect]


class Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one `dresd: error:` line (exit 2) like every other."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dresd: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dresd", description="Lossless speculative decoding by dense retrieval (DReSD)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UserError, ModelError, CorpusError, DatastoreError, ValueError, ImportError) as err:
        print(f"dresd: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a missing file, a full disk, a file-size limit, no permission
        print(f"dresd: error: {os_error_message(err, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dresd: interrupted", file=sys.stderr)
        return 130


def os_error_message(err: OSError, args: argparse.Namespace) -> str:
    """One line for an operating-system error, with what to do about an unfinished output."""
    message = f"{err.strerror or err}: {err.filename}" if err.filename else str(err)
    if err.errno is None and " requested and " in message:  # numpy's words for a short write
        message = f"File too large or disk full: a write stopped short ({message})"
    out = getattr(args, "out", None)
    if args.command == "build" and out is not None:
        message += (f" (nothing was written to {out}; the finished part of the build stays in "
                    f"{partial_dir(out)}: fix the cause and run the same build to resume)")
    elif getattr(args, "corpus_command", None) == "regenerate" and out is not None:
        message += (f" (the responses done so far stay in {out}.partial: fix the cause and run "
                    "the same command to resume)")
    return message


if __name__ == "__main__":
    sys.exit(main())
