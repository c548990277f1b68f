"""`dresd`'s entry point: the parser of every subcommand, and how a failure is reported.

Every failure the user can cause (unknown model, empty or too long prompt, bad sampling values,
a missing file, a full disk) ends with a one-line `dresd: error: ...` and exit status 2, never
a traceback: such failures are raised as a `DresdError` (errors.py) or are the operating
system's `OSError`. Anything else is a bug in dresd: one line `dresd: internal error: ...` and
exit status 1, and with `--debug` the whole traceback, to report.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

from dresd.cli import bench, build, calibrate, corpus, fetch_model, generate, inspect, serve
from dresd.datastore.format import partial_dir
from dresd.errors import DresdError

# The subcommands in the order `dresd --help` lists them.
COMMANDS = [generate, bench, serve, calibrate, fetch_model, build, corpus, inspect]
DEBUG_HELP = "on an internal error, print the whole traceback"


class Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one `dresd: error:` line (exit 2) like every other."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dresd: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dresd", description="Lossless speculative decoding by dense retrieval (DReSD)."
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    add_debug_option(commands)
    return parser



def add_debug_option(commands: argparse._SubParsersAction) -> None:
    """--debug after the subcommand too (`dresd generate ... --debug`), where it is easy to
    add to a command line that failed. SUPPRESS: a subcommand that is not given it leaves
    the top-level value alone."""
    for subparser in commands.choices.values():
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                               help=DEBUG_HELP)
        for action in subparser._actions:  # `dresd corpus regenerate`: one level down
            if isinstance(action, argparse._SubParsersAction):
                add_debug_option(action)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DresdError as err:
        if args.debug:
            traceback.print_exc()
        print(f"dresd: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a missing file, a full disk, a file-size limit, no permission
        if args.debug:
            traceback.print_exc()
        print(f"dresd: error: {os_error_message(err, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dresd: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: say so, and how to get what a bug report needs
        if args.debug:
            traceback.print_exc()
            return 1
        message = str(err).splitlines()[0] if str(err) else ""
        print(f"dresd: internal error: {type(err).__name__}: {message} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


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
