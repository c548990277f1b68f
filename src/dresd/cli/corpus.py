"""`dresd corpus regenerate`: the target's own responses to a corpus's prompts (an ID corpus),
resumable: the responses done so far stay in OUT.partial."""

from __future__ import annotations

import argparse
from pathlib import Path

from dresd.cli.options import (
    add_device_option,
    add_dtype_option,
    add_prefix_cache_options,
    add_ray_options,
    add_threads_option,
    check_limit,
    finite_float,
    load_target_from_args,
    prefix_cache_mb,
    ray_pool,
    seed_int,
    set_threads,
)
from dresd.corpus import FORMATS
from dresd.errors import UserError
from dresd.models.target import DEFAULT_MODEL
from dresd.regenerate import RegenerateConfig, read_prompt_rows, regenerate


def add_parser(commands: argparse._SubParsersAction) -> None:
    corpus = commands.add_parser("corpus", help="corpus tools")
    corpus_commands = corpus.add_subparsers(dest="corpus_command", required=True)
    regen = corpus_commands.add_parser(
        "regenerate", help="the target's own responses to a corpus's prompts (an ID corpus)")
    regen.add_argument("--model", default=DEFAULT_MODEL, help="the target that responds")
    regen.add_argument("--corpus", type=Path, required=True, help="a .jsonl file of prompts")
    regen.add_argument("--out", type=Path, required=True,
                       help="the .jsonl file written (appended to, and resumed, if it exists)")
    regen.add_argument("--prompt-field", default="prompt")
    regen.add_argument("--response-field", default="response", help="the field written")
    regen.add_argument("--format", choices=FORMATS, default="chat")
    regen.add_argument("--max-new-tokens", type=int, default=256)
    regen.add_argument("--batch-size", type=int, default=8,
                       help="prompts generated together, in one batch of the batched loop "
                            "(default 8)")
    regen.add_argument("--method", choices=("none", "pld", "suffix"), default="suffix",
                       help="what drafts the responses (default suffix: it learns from the "
                            "responses already written); every method writes the model's own "
                            "responses")
    regen.add_argument("--temperature", type=finite_float, default=0.0,
                       help="0: greedy (default)")
    regen.add_argument("--seed", type=seed_int, default=0)
    regen.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    add_threads_option(regen)
    add_prefix_cache_options(regen, "the batches share")
    add_ray_options(regen, "generate the batches")
    add_dtype_option(regen)
    add_device_option(regen)
    regen.add_argument("--quiet", action="store_true", help="no progress bar")
    regen.set_defaults(func=run_regenerate)


def run_regenerate(args: argparse.Namespace) -> int:
    set_threads(args)
    if args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0:
        raise UserError("--max-new-tokens and --batch-size must be >= 1, --temperature >= 0")
    check_limit(args)
    if not args.corpus.is_file():
        raise UserError(f"corpus file {args.corpus} does not exist")
    config = RegenerateConfig(prompt_field=args.prompt_field, response_field=args.response_field,
                              format=args.format, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, temperature=args.temperature,
                              seed=args.seed, limit=args.limit, method=args.method,
                              prefix_cache_mb=prefix_cache_mb(args))
    read_prompt_rows(args.corpus, config)  # bad input fails before the model loads
    target = load_target_from_args(args)
    ray = ray_pool(args, target) if args.ray is not None else None
    rows = regenerate(target, args.corpus, args.out, config, progress=not args.quiet, ray=ray)
    print(f"{args.out}: {rows} responses")
    return 0
