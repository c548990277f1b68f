"""`dresd bench`: every method side by side on the same prompts; report.json/.md and plots."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dresd.bench.concurrency import concurrency_table, run_concurrency, write_concurrency
from dresd.bench.meta import bench_metadata
from dresd.bench.methods import METHODS, parse_methods
from dresd.bench.report import build_report, markdown_table, write_report
from dresd.bench.runner import run_bench
from dresd.cli.options import (
    add_model_options,
    add_prefix_cache_options,
    add_save_outputs_option,
    check_datastore_arg,
    check_limit,
    drafter_options,
    load_target_from_args,
    output_origin,
    prefix_cache_mb,
    settings_from_args,
)
from dresd.corpus import output_row, save_output
from dresd.datasets import load_prompts
from dresd.errors import UserError
from dresd.prompts import encode_prompt
from dresd.runner import AR, MethodRunner


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="every method side by side on real prompts")
    add_model_options(bench)
    bench.add_argument("--methods", default="ar,pld",
                       help=f"comma-separated, from {', '.join(METHODS)} (ar is always run: "
                            "it is the reference); a method may carry its own drafter options, "
                            "'dresd[max_tree_nodes=2]', to compare shapes in one run")
    bench.add_argument("--dataset", action="append", required=True,
                       help="humaneval, humaneval-typehints, gsm8k, mt_bench or a .jsonl file "
                            "(repeatable)")
    bench.add_argument("--prompt-field", default="prompt", help="field of a .jsonl dataset")
    bench.add_argument("--category-field", default="category",
                       help="optional category field of a .jsonl dataset")
    bench.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    bench.add_argument("--out", type=Path, required=True, help="folder for report.json/.md, plots")
    bench.add_argument("--concurrency", default=None, metavar="C[,C...]",
                       help="instead of one prompt at a time: each method runs all prompts "
                            "through one batch, C at once, for each C (e.g. 1,4,16,32): "
                            "aggregate tokens/s, TTFT and latency percentiles "
                            "(concurrency.json/.md/.png in --out)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="with --concurrency: run every method this many times per level, "
                            "in turn, and report the sum with the per-round spread of its "
                            "ratio to AR (default 1)")
    add_save_outputs_option(bench)  # AR's output per prompt: every method's, when greedy
    add_prefix_cache_options(bench, "with --concurrency, each method's run at each level "
                             "(from empty)")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    specs = parse_methods(args.methods)
    specs = [(AR, AR, {})] + [spec for spec in specs if spec[0] != AR]
    methods = [label for label, _, _ in specs]
    check_limit(args)
    levels = parse_levels(args.concurrency)
    if args.rounds < 1 or (args.rounds > 1 and not levels):
        raise UserError(f"--rounds takes a whole number >= 1, with --concurrency; got "
                        f"{args.rounds}{'' if levels else ' without --concurrency'}")
    prompts = [p for name in args.dataset
               for p in load_prompts(name, args.limit, args.prompt_field, args.category_field)]
    check_datastore_arg(args)
    target = load_target_from_args(args)
    options = drafter_options(args, target, [method for _, method, _ in specs])
    cache_mb = prefix_cache_mb(args) if levels else None  # one prompt at a time: none
    runners = [MethodRunner(target, method, settings, label, prefix_cache_mb=cache_mb,
                            **{**options, **overrides})
               for label, method, overrides in specs]
    prompt_ids = [encode_prompt(target.tokenizer, p.text, not args.no_chat_template)
                  for p in prompts]
    for ids in prompt_ids:  # before any method runs: a run does not end halfway on one
        runners[0].check_fits(ids)
    meta = bench_metadata(target, runners, settings, args.dataset, len(prompts), args.datastore)
    # Ctrl-C or `kill -INT` ends the run with a partial report, also where the shell that
    # started us in the background made it ignore SIGINT (Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if levels:
        rows = run_concurrency(runners, prompt_ids, levels, args.rounds)
        write_concurrency(rows, meta, args.out)
        print("\n".join(concurrency_table(rows)))
        print(f"\nreport: {args.out / 'concurrency.md'}")
        return 0
    records, interrupted = run_bench(runners, prompts, prompt_ids)
    if args.save_outputs is not None:
        made_by = output_origin(target)
        for record in records:
            if record.method == AR:
                save_output(args.save_outputs, output_row(
                    record.prompt.text,
                    target.tokenizer.decode(record.result.token_ids, skip_special_tokens=True),
                    prompt_ids[record.prompt_index], record.result.token_ids, made_by))
    meta["interrupted"] = interrupted
    report = build_report(records, methods, meta)
    write_report(report, records, args.out)
    print("\n".join(markdown_table(report["methods"])))
    print(f"\nreport: {args.out / 'report.md'}")
    if interrupted:
        print("dresd: interrupted; the report covers the prompts that finished", file=sys.stderr)
        return 130
    return 0


def parse_levels(text: str | None) -> list[int]:
    """--concurrency 1,4,16 -> [1, 4, 16]; None -> [] (one prompt at a time)."""
    if text is None:
        return []
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--concurrency takes whole numbers separated by commas, got {text!r}"
                        ) from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels
