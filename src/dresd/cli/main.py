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
    parser.add_argument("--version", action=VersionAction,
                        help="print dresd's version, the PyTorch build and the forward this "
                             "machine runs, then exit")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    add_debug_option(commands)
    return parser



class VersionAction(argparse.Action):
    """`dresd --version`: like argparse's "version" action, but the text is found only when
    asked (it compiles the kernels the first time), not every time the parser is built."""

    def __init__(self, option_strings: list[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(version_text())
        parser.exit(0)


def version_text() -> str:
    """dresd's version, the PyTorch build, and which forward a bf16 model runs on this machine:
    the C decoder (dresd's kernels), or PyTorch's forward and why."""
    import torch

    from dresd import __version__, kernels
    from dresd.host import cpu_model, native_bf16_flags
    from dresd.kernels import decoder

    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
            if torch.cuda.is_available() else "no CUDA device")
    flags = native_bf16_flags()
    try:
        tier, refused = kernels.tier(), None
    except DresdError as error:  # a DRESD_ISA this CPU cannot run: every run is refused
        tier, refused = None, str(error)
    if refused:
        forward = f"none, every run refused: {refused}"
    elif decoder.kernel() is not None:
        forward = (f"C decoder (dresd/kernels/decoder.c, {tier.name} kernels: {tier.summary}; "
                   "DRESD_ISA picks another) for bf16 Llama-shaped models and GGUF files; "
                   "PyTorch's forward for the rest")
    elif tier is None:
        forward = ("PyTorch's forward (oneDNN linears): dresd's C kernels need AVX2, FMA and "
                   "F16C at least (aarch64: NEON with the dot product), which this CPU lacks")
    else:
        forward = ("PyTorch's forward (oneDNN linears): dresd's C kernels did not compile "
                   "(no C compiler, a failed compile, or DRESD_CPU_* = 0)")
    return "\n".join([
        f"dresd {__version__}",
        f"torch {torch.__version__} ({cuda}; {torch.get_num_threads()} threads)",
        f"cpu: {cpu_model()} (native bf16: {', '.join(flags) or 'none'})",
        f"forward: {forward}",
    ])


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
