"""`dresd generate`: one method on one prompt or a file of prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dresd.bench.methods import METHODS
from dresd.cli.options import (
    add_model_options,
    add_save_outputs_option,
    check_datastore_arg,
    drafter_options,
    load_target_from_args,
    output_origin,
    settings_from_args,
)
from dresd.corpus import iter_jsonl, output_row, save_output
from dresd.drafters import DRAFTERS
from dresd.errors import UserError
from dresd.metrics import GenerationResult, summarize
from dresd.models.fastpath import dtype_name
from dresd.prompts import encode_prompt
from dresd.runner import AR, MethodRunner


def add_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="generate text with one method")
    add_model_options(gen)
    gen.add_argument("--method", choices=METHODS, default="pld",
                     help="ar: transformers generate; none: plain decoding in the speculative "
                          "loop; pld: prompt lookup (default); dresd: dense retrieval; "
                          "rest: REST's sparse retrieval (dresd and rest need --datastore); "
                          "suffix: SuffixDecoding; "
                          "hybrid: PLD, REST and DReSD candidates in one tree sized by this "
                          "machine's verify cost (REST and DReSD from --datastore if given)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", type=Path,
                        help="a text file (one prompt) or a .jsonl file (one prompt per line)")
    gen.add_argument("--prompt-field", default="prompt", help="field of a .jsonl prompt file")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_save_outputs_option(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.method in ("dresd", "rest") and args.datastore is None:
        raise UserError(f"--method {args.method} needs --datastore DIR "
                        "(build one with `dresd build`)")
    if args.learn is not None and "learn" not in getattr(DRAFTERS.get(args.method),
                                                         "__dataclass_fields__", {}):
        raise UserError(f"--learn applies to suffix, rest, dresd and hybrid, not {args.method}")
    prompts = read_prompts(args)  # before loading the model: bad input fails fast
    check_datastore_arg(args)
    for prompt in prompts:
        if not prompt.strip():
            raise UserError("the prompt is empty")
    target = load_target_from_args(args)
    options = drafter_options(args, target, [args.method])
    runner = MethodRunner(target, args.method, settings, **options)
    # the tokenizer's fingerprint parses its whole JSON (~60 MB at a peak for a 262k vocabulary)
    made_by = output_origin(target) if args.save_outputs is not None else None
    for prompt in prompts:
        prompt_ids = encode_prompt(target.tokenizer, prompt, not args.no_chat_template)
        runner.check_fits(prompt_ids)
        result = runner.generate(prompt_ids)
        record = result_record(runner, result)
        if args.save_outputs is not None:
            save_output(args.save_outputs, output_row(prompt, record["text"], prompt_ids,
                                                      result.token_ids, made_by))
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"])
            print(figure_line(record), file=sys.stderr)
    return 0


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt, or the prompts of --prompt-file (plain text: one; .jsonl: one a line)."""
    if args.prompt is not None:
        return [args.prompt]
    path: Path = args.prompt_file
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    if path.suffix != ".jsonl":
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as err:
            raise UserError(f"prompt file {path} is not UTF-8 text ({err})") from err
    prompts = []
    for number, row in iter_jsonl(path):
        if args.prompt_field not in row:
            raise UserError(f"{path}:{number}: no {args.prompt_field!r} field")
        if not isinstance(row[args.prompt_field], str):
            raise UserError(f"{path}:{number}: field {args.prompt_field!r} is not text")
        prompts.append(row[args.prompt_field])
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


def result_record(runner: MethodRunner, result: GenerationResult) -> dict:
    """The JSON object printed for one prompt."""
    figures = summarize([result])
    record = {
        "method": runner.method,
        "model": runner.target.name,
        "text": runner.target.tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "num_new_tokens": figures["num_new_tokens"],
        "tokens_per_s": figures["tokens_per_s"],
        "seconds": figures["seconds"],
        "threads": torch.get_num_threads(),
        "dtype": dtype_name(runner.target.dtype),
        "device": str(runner.target.device),
    }
    if runner.method != AR:
        keys = ["mean_accepted_length", "acceptance_rate", "num_target_forwards",
                "per_position_acceptance", "drafted_tokens_per_step", "draft_time_share",
                "verify_time_share"]
        record.update({key: figures[key] for key in keys}, stop_reason=result.stop_reason)
    return record


def figure_line(record: dict) -> str:
    """The one line of figures printed on stderr after each output."""
    line = (f"[{record['method']}] {record['num_new_tokens']} tokens, "
            f"{record['tokens_per_s']:.1f} tokens/s, {record['threads']} thread(s)")
    if record.get("mean_accepted_length") is not None:
        line += f", mean accepted length {record['mean_accepted_length']:.2f}"
    if record.get("acceptance_rate") is not None:
        line += f", acceptance rate {record['acceptance_rate']:.1%}"
    return line
