"""The `dresd` command: generate, build, inspect, bench, corpus, fetch-model, serve.

Every failure the user can cause (unknown model, empty or too long prompt, bad sampling values)
ends with a one-line `dresd: error: ...` and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
from pathlib import Path
from typing import NoReturn

import torch

from dresd.corpus import (
    FORMATS,
    KEY_POSITIONS,
    CorpusError,
    CorpusSpec,
    iter_jsonl,
    output_row,
    read_documents,
    save_output,
)
from dresd.datastore.format import DatastoreError
from dresd.decoding import SamplingConfig
from dresd.device import DEVICE_HELP, device_name
from dresd.drafters import DRAFTERS
from dresd.fastpath import DTYPES, attention_name, dtype_name
from dresd.host import cpu_model, native_bf16_flags
from dresd.metrics import GenerationResult, summarize
from dresd.models import DEFAULT_MODEL, ModelError, Target, ensure_default_model, load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

METHODS = [AR, *DRAFTERS]
BUILD_KINDS = ["dense", "sparse", "dense,sparse"]


class UserError(Exception):
    """Bad input: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one `dresd: error:` line (exit 2) like every other."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dresd: error: {message} (see `{self.prog} --help`)\n")


def finite_float(text: str) -> float:
    """An option's float; NaN and infinities are refused (they slip past every range check)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def seed_int(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {text}")
    return value


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
        from dresd.datastore.format import partial_dir

        message += (f" (nothing was written to {out}; the finished part of the build stays in "
                    f"{partial_dir(out)}: fix the cause and run the same build to resume)")
    elif getattr(args, "corpus_command", None) == "regenerate" and out is not None:
        message += (f" (the responses done so far stay in {out}.partial: fix the cause and run "
                    "the same command to resume)")
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dresd", description="Lossless speculative decoding by dense retrieval (DReSD)."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text with one method")
    _add_model_options(gen)
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
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser("bench", help="every method side by side on real prompts")
    _add_model_options(bench)
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
    add_save_outputs_option(bench)  # AR's output per prompt: every method's, when greedy
    bench.set_defaults(func=cmd_bench)

    from dresd.serve.cli import add_serve_command  # the server's options and handler
    add_serve_command(commands)

    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's verify-cost curve (what `hybrid` budgets by)")
    calibrate.add_argument("--model", default=DEFAULT_MODEL)
    calibrate.add_argument("--threads", type=int, default=None, help="PyTorch threads")
    _add_dtype_option(calibrate)
    _add_device_option(calibrate)
    calibrate.add_argument("--force", action="store_true", help="measure again, even if cached")
    calibrate.set_defaults(func=cmd_calibrate)

    fetch = commands.add_parser("fetch-model", help="provision and cache the default model")
    fetch.set_defaults(func=cmd_fetch_model)

    build = commands.add_parser("build", help="build a datastore from a corpus")
    build.add_argument("--kind", choices=BUILD_KINDS, default=None,
                       help="dense (default): DReSD (hidden-state keys); sparse: REST (suffix "
                            "array of the token ids); dense,sparse: both from one pass, in one "
                            "folder")
    build.add_argument("--model", default=DEFAULT_MODEL, help="the target the datastore is for")
    build.add_argument("--out", type=Path, required=True,
                       help="the datastore folder to create (with --append: to grow)")
    build.add_argument("--append", action="store_true",
                       help="add the corpus to the existing datastore --out, atomically: its "
                            "transform, format and settings are kept (saved outputs from "
                            "`dresd generate --save-outputs` keep their token ids)")
    _add_corpus_options(build)
    build.add_argument("--pca-dim", type=int, default=64, help="key dimensions (default 64)")
    build.add_argument("--value-len", type=int, default=20,
                       help="tokens stored after each position (default 20)")
    build.add_argument("--index", choices=["auto", "exact", "ivf", "ivfpq", "scann"],
                       default="auto", help="auto: exact search for small stores, FAISS IVF "
                       "above; ivfpq: PQ codes + exact re-ranking on memory-mapped keys, for "
                       "stores past RAM")
    build.add_argument("--recall-target", type=finite_float, default=0.9,
                       help="ivf, ivfpq: nprobe is raised until recall@10 reaches this "
                       "(default 0.9)")
    build.add_argument("--chunk-tokens", type=int, default=65_536,
                       help="corpus tokens per resumable chunk")
    build.add_argument("--batch-tokens", type=int, default=8_192,
                       help="padded tokens per forward (lower it if memory is short)")
    build.add_argument("--keep-states", action="store_true",
                       help="dense: also keep the raw fp16 hidden states (states.npy, "
                            "hidden size x 2 bytes per entry) for studies that refit the keys")
    build.add_argument("--threads", type=int, default=None,
                       help="PyTorch threads (with --ray: per actor, default 1)")
    _add_ray_options(build, "dense: forward the chunks")
    _add_dtype_option(build)
    _add_device_option(build)
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=cmd_build)

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
    regen.add_argument("--batch-size", type=int, default=8)
    regen.add_argument("--temperature", type=finite_float, default=0.0,
                       help="0: greedy (default)")
    regen.add_argument("--seed", type=seed_int, default=0)
    regen.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    regen.add_argument("--threads", type=int, default=None, help="PyTorch threads")
    _add_ray_options(regen, "generate the batches")
    _add_dtype_option(regen)
    _add_device_option(regen)
    regen.add_argument("--quiet", action="store_true", help="no progress bar")
    regen.set_defaults(func=cmd_regenerate)

    inspect = commands.add_parser("inspect", help="what a datastore holds")
    inspect.add_argument("datastore", type=Path)
    inspect.add_argument("--verify", action="store_true",
                         help="hash every file, also the large ones the open-time check leaves "
                              "to sizes and headers")
    inspect.add_argument("--json", action="store_true", help="print the figures as JSON")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def _add_corpus_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", required=True,
                   help="a .jsonl file, a text file, a folder (source tree) or 'stdlib' "
                        "(repeatable)")
    p.add_argument("--prompt-field", default="prompt",
                   help="JSON Lines prompt field ('' for none: the response field is plain text)")
    p.add_argument("--response-field", default="response", help="JSON Lines response field")
    p.add_argument("--format", choices=FORMATS, default="chat",
                   help="chat: the tokenizer's chat template (default); qa: the paper's "
                        "'Question: ...\\nAnswer:\\n'")
    p.add_argument("--keys", choices=KEY_POSITIONS, default="all",
                   help="key positions: all (default, as the authors) or response only")
    p.add_argument("--glob", default="*.py", help="files read from a folder (default *.py)")
    p.add_argument("--max-doc-tokens", type=int, default=1024,
                   help="longer documents are cut into pieces of this many tokens")
    p.add_argument("--limit", type=int, default=None, help="read at most this many documents")


def add_save_outputs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-outputs", type=Path, default=None, metavar="FILE.jsonl",
                   help="append each prompt and output (text and exact token ids) to this "
                        "file: a corpus for `dresd build`, and what `dresd build --append` adds "
                        "to an existing datastore (so that what --learn learns lasts)")


def _add_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="the model's dtype; auto (default): bfloat16 where the hardware "
                        "multiplies it natively (CPU amx_bf16 or avx512_bf16, CUDA), else "
                        "float32. Output is token-identical to plain decoding in the same "
                        "dtype (elsewhere than a CPU, reduced precision may differ at "
                        "near-ties: see README)")


def _add_device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def load_target_from_args(args: argparse.Namespace) -> Target:
    """The target of --model in --dtype on --device; says what `auto` chose, on stderr."""
    target = load_target(args.model, dtype=args.dtype, device=args.device)
    device = target.device
    if args.device == "auto" and device.type != "cpu":
        print(f"dresd: device {device_name(device)} (auto)", file=sys.stderr)
    if args.dtype == "auto":
        why = device_name(device)
        if device.type == "cpu":
            why = ", ".join(native_bf16_flags()) or "no native bf16"
        print(f"dresd: dtype {dtype_name(target.dtype)} (auto; {why})", file=sys.stderr)
    return target


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face id, local folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize prompts as raw text instead of a chat turn")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    p.add_argument("--seed", type=seed_int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="PyTorch threads")
    _add_dtype_option(p)
    _add_device_option(p)
    p.add_argument("--pld-max-ngram", type=int, default=None, dest="max_ngram")
    p.add_argument("--pld-min-ngram", type=int, default=None, dest="min_ngram")
    p.add_argument("--draft-len", type=int, default=None, help="tokens per draft")
    p.add_argument("--num-drafts", type=int, default=None, help="drafts per step")
    p.add_argument("--draft-model", default=None,
                   help="small model for --method draft (must share the target's tokenizer)")
    p.add_argument("--datastore", type=Path, default=None,
                   help="dresd, rest: the datastore folder (built with `dresd build`)")
    p.add_argument("--k", type=int, default=None, help="dresd: neighbours searched (default 200)")
    p.add_argument("--rest-max-suffix", type=int, default=None, dest="max_suffix",
                   help="rest: longest context suffix looked up (default 16)")
    p.add_argument("--rest-min-suffix", type=int, default=None, dest="min_suffix",
                   help="rest: shortest context suffix looked up (default 2)")
    p.add_argument("--rest-matches", type=int, default=None, dest="max_matches",
                   help="rest: matches whose continuations are counted (default 5000)")
    p.add_argument("--max-tree-nodes", type=int, default=None,
                   help="rest, dresd: draft-tree nodes kept, the most frequent prefixes of the "
                        "retrieved continuations (rest default 64; dresd default: none, the "
                        "paper's --num-drafts x --draft-len shape; suffix: tokens per "
                        "speculation tree, default 32)")
    p.add_argument("--learn", action=argparse.BooleanOptionalAction, default=None,
                   help="suffix, rest, dresd, hybrid: keep each finished output in an "
                        "in-memory store searched with the others (suffix default: on, its "
                        "global tree; rest, dresd: off; hybrid: its suffix source only, "
                        "--learn adds REST's and DReSD's)")
    p.add_argument("--suffix-max-depth", type=int, default=None, dest="max_depth",
                   help="suffix: depth of the suffix tries, match + draft tokens (default 24)")
    p.add_argument("--suffix-spec-factor", type=finite_float, default=None, dest="max_spec_factor",
                   help="suffix: tokens drafted per matched token (default 1.0)")
    p.add_argument("--suffix-spec-offset", type=finite_float, default=None, dest="max_spec_offset",
                   help="suffix: tokens added to that budget (default 0)")
    p.add_argument("--suffix-min-prob", type=finite_float, default=None, dest="min_token_prob",
                   help="suffix: least empirical probability of a drafted token (default 0.1)")
    p.add_argument("--suffix-cache-requests", type=int, default=None, dest="max_cached_requests",
                   help="--learn: outputs kept, oldest evicted first (default 1000)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None, dest="max_cached_tokens",
                   help="--learn: tokens kept, oldest outputs evicted first (default 100000)")


def settings_from_args(args: argparse.Namespace) -> GenerationSettings:
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k != 0):
        raise UserError("--top-p and --top-k apply to sampling: also give --temperature > 0")
    sampling = None
    if args.temperature > 0:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    set_threads(args)
    return GenerationSettings(args.max_new_tokens, sampling, list(args.stop))


def set_threads(args: argparse.Namespace) -> None:
    """Apply --threads (every command that runs the model has it)."""
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)


def drafter_options(args: argparse.Namespace, target: Target, methods: list[str]) -> dict:
    """Every drafter option given on the command line; each drafter takes those it knows."""
    options = dict(max_ngram=args.max_ngram, min_ngram=args.min_ngram, draft_len=args.draft_len,
                   len_drafts=args.draft_len, num_drafts=args.num_drafts, k=args.k,
                   datastore=str(args.datastore) if args.datastore else None,
                   max_suffix=args.max_suffix, min_suffix=args.min_suffix,
                   max_matches=args.max_matches, max_tree_nodes=args.max_tree_nodes,
                   learn=args.learn, max_depth=args.max_depth,
                   max_spec_factor=args.max_spec_factor, max_spec_offset=args.max_spec_offset,
                   min_token_prob=args.min_token_prob,
                   max_cached_requests=args.max_cached_requests,
                   max_cached_tokens=args.max_cached_tokens)
    if "draft" in methods:
        if args.draft_model is None:
            raise UserError("--method draft needs --draft-model")
        draft = load_target(args.draft_model, dtype=target.dtype, device=target.device)
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise UserError(f"the draft model {args.draft_model!r} does not share the "
                            f"tokenizer of the target {args.model!r}")
        options["model"] = draft.model
    return options


def read_prompts(args: argparse.Namespace) -> list[str]:
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


def check_datastore_arg(args: argparse.Namespace) -> None:
    """A missing or damaged --datastore is refused before the model loads (`verify_store`)."""
    if args.datastore is None:
        return
    from dresd.datastore.format import open_manifest

    if not args.datastore.is_dir():
        raise UserError(f"datastore folder {args.datastore} does not exist")
    open_manifest(args.datastore)


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


def cmd_generate(args: argparse.Namespace) -> int:
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
    made_by = output_origin(target)
    for prompt in prompts:
        prompt_ids = encode_prompt(target.tokenizer, prompt, not args.no_chat_template)
        result = runner.generate(prompt_ids)
        record = result_record(runner, result)
        if args.save_outputs is not None:
            save_output(args.save_outputs, output_row(prompt, record["text"], prompt_ids,
                                                      result.token_ids, made_by))
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"])
            print(_figure_line(record), file=sys.stderr)
    return 0


def output_origin(target: Target) -> dict:
    """Who makes the outputs: saved with them, checked when they are built into a store."""
    from dresd.fingerprint import model_fingerprint, tokenizer_fingerprint

    return {"model": target.name, "model_fingerprint": model_fingerprint(target.model),
            "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer)}


def _figure_line(record: dict) -> str:
    line = (f"[{record['method']}] {record['num_new_tokens']} tokens, "
            f"{record['tokens_per_s']:.1f} tokens/s, {record['threads']} thread(s)")
    if record.get("mean_accepted_length") is not None:
        line += f", mean accepted length {record['mean_accepted_length']:.2f}"
    if record.get("acceptance_rate") is not None:
        line += f", acceptance rate {record['acceptance_rate']:.1%}"
    return line


def drafter_settings(drafter: object) -> dict:
    """A drafter's plain options (numbers, strings), for the record."""
    fields = getattr(drafter, "__dataclass_fields__", {})
    values = {name: getattr(drafter, name) for name, f in fields.items() if f.repr}
    return {k: v for k, v in values.items() if isinstance(v, int | float | str)}


# Drafter fields a --methods entry cannot set: they are objects, or shared by the whole run.
NOT_PER_METHOD = ("datastore", "name", "model", "cost")


def parse_methods(text: str) -> list[tuple[str, str, dict]]:
    """(label, method, options) for each entry of --methods: `pld`, or a method with its own
    drafter options, `dresd[max_tree_nodes=2,k=20]` (so one run can compare shapes)."""
    specs, seen = [], set()
    for label in re.findall(r"[^,\[\]]+(?:\[[^\]]*\])?", text.replace(" ", "")):
        method, _, inside = label.partition("[")
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        fields = getattr(DRAFTERS.get(method), "__dataclass_fields__", {})
        known = [k for k, f in fields.items() if f.init and k not in NOT_PER_METHOD]
        options = {}
        for item in filter(None, inside.rstrip("]").split(",")):
            key, equals, value = item.partition("=")
            if not equals or key not in known:
                raise UserError(f"--methods {label}: {item!r} is not OPTION=VALUE with an option "
                                f"of {method} ({', '.join(known) or 'none'})")
            options[key] = parse_number(value)
            if not isinstance(options[key], int | float) or not math.isfinite(options[key]):
                raise UserError(f"--methods {label}: {key} must be a number, got {value!r}")
        if label in seen:
            raise UserError(f"--methods lists {label} twice")
        seen.add(label)
        specs.append((label, method, options))
    if not specs:
        raise UserError("--methods lists no method")
    return specs


def parse_number(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    import datetime

    import transformers

    from dresd.bench.report import build_report, markdown_table, write_report
    from dresd.bench.runner import run_bench
    from dresd.datasets import load_prompts

    settings = settings_from_args(args)
    specs = parse_methods(args.methods)
    specs = [(AR, AR, {})] + [spec for spec in specs if spec[0] != AR]
    methods = [label for label, _, _ in specs]
    check_limit(args)
    prompts = [p for name in args.dataset
               for p in load_prompts(name, args.limit, args.prompt_field, args.category_field)]
    check_datastore_arg(args)
    target = load_target_from_args(args)
    options = drafter_options(args, target, [method for _, method, _ in specs])
    runners = [MethodRunner(target, method, settings, label, **{**options, **overrides})
               for label, method, overrides in specs]
    prompt_ids = [encode_prompt(target.tokenizer, p.text, not args.no_chat_template)
                  for p in prompts]
    meta = {
        "model": target.name,
        "methods": methods,
        "datasets": args.dataset,
        "prompts": len(prompts),
        "max_new_tokens": settings.max_new_tokens,
        "sampling": "greedy" if settings.sampling is None else vars(settings.sampling),
        "threads": torch.get_num_threads(),
        "dtype": dtype_name(target.dtype),
        "device": device_name(target.device),
        "prepacked": bool(getattr(target.model, "_dresd_prepacked", False)),
        "attention": attention_name(target.model),
        "cpu": cpu_model(),
        "cpu_native_bf16": native_bf16_flags(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "drafter_options": {r.label: drafter_settings(r.drafter) for r in runners if r.drafter},
    }
    curves = {r.label: r.drafter.cost for r in runners if getattr(r.drafter, "cost", None)}
    if curves:  # what `hybrid` budgeted by: the verify cost by tree tokens, in decode steps
        meta["verify_cost_curve"] = next(iter(curves.values()))
    if args.datastore and (args.datastore / "manifest.json").is_file():
        meta["datastore"] = str(args.datastore)
        meta["datastore_manifest"] = json.loads((args.datastore / "manifest.json").read_text())
    # Ctrl-C or `kill -INT` ends the run with a partial report, also where the shell that
    # started us in the background made it ignore SIGINT (Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dresd.calibrate import curve_path, load_or_measure

    set_threads(args)
    target = load_target_from_args(args)
    cost = load_or_measure(target, force=args.force)
    print(f"verify cost in decode steps ({dtype_name(target.dtype)}, {device_name(target.device)}, "
          f"{torch.get_num_threads()} thread(s)); cached in {curve_path(target)}")
    for size, value in cost.items():
        print(f"  {size:3d} tokens: {value:.2f}")
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    print(ensure_default_model())
    return 0


def check_limit(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")


def corpus_spec_from_args(args: argparse.Namespace) -> CorpusSpec:
    check_limit(args)
    return CorpusSpec(sources=args.corpus, prompt_field=args.prompt_field or None,
                      response_field=args.response_field, format=args.format, keys=args.keys,
                      tree_glob=args.glob, max_tokens=args.max_doc_tokens, limit=args.limit)


def cmd_build(args: argparse.Namespace) -> int:
    from dresd.datastore.dense import DenseBuildConfig, build_dense
    from dresd.datastore.sparse_store import build_sparse_datastore

    set_threads(args)
    spec = corpus_spec_from_args(args)
    if not 0 < args.recall_target <= 1:
        raise UserError(f"--recall-target must be in (0, 1], got {args.recall_target}")
    read_documents(spec)  # a malformed corpus fails before the model loads (text only: cheap)
    if args.append:
        return cmd_append(args, spec)
    args.kind = args.kind or "dense"
    if args.kind == "sparse":  # no forward pass: the dense options (and --device) do not apply
        out = build_sparse_datastore(load_target(args.model, device="cpu", prepack=False), spec,
                                     args.out, progress=not args.quiet)
        print(out)
        return 0
    config = DenseBuildConfig(pca_dim=args.pca_dim, value_len=args.value_len, index=args.index,
                              recall_target=args.recall_target, chunk_tokens=args.chunk_tokens,
                              batch_tokens=args.batch_tokens, keep_states=args.keep_states)
    target = load_target_from_args(args)
    ray = ray_pool(args, target) if args.ray is not None else None
    out = build_dense(target, spec, args.out, config, progress=not args.quiet,
                      with_sparse=args.kind == "dense,sparse", ray=ray)
    print(out)
    return 0


def _add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"{what} on Ray actors, each holding the model once; ADDRESS: a "
                        "cluster's (none: $RAY_ADDRESS or a local Ray). Needs "
                        "pip install 'dresd[ray]'")
    p.add_argument("--ray-actors", type=int, default=None,
                   help="with --ray: how many actors (default: the cluster's CPUs / threads)")


def ray_pool(args: argparse.Namespace, target: Target):
    """`--ray`: actors that load --model in the dtype the driver's target has (so that their
    forwards are the driver's), on --device of their own node."""
    from functools import partial

    from dresd.raypool import RayPool

    load = partial(load_target, args.model, dtype=dtype_name(target.dtype), device=args.device)
    return RayPool(load, address=args.ray or None, actors=args.ray_actors,
                   threads=args.threads or 1)


def cmd_append(args: argparse.Namespace, spec: CorpusSpec) -> int:
    """`dresd build --append`: grow the datastore --out by the corpus (datastore/append.py)."""
    from dresd.datastore.append import append_to_datastore
    from dresd.datastore.format import read_manifest

    manifest = read_manifest(args.out)
    if args.kind is not None and args.kind != manifest.kind:
        raise UserError(f"--append: {args.out} is a {manifest.kind} datastore, not {args.kind}")
    if "dense" not in manifest.kind:  # no forward pass: a sparse store needs the tokenizer only
        target = load_target(args.model, device="cpu", prepack=False)
    else:
        if args.dtype == "auto":  # keys from the dtype the stored ones came from
            args.dtype = manifest.settings.get("build_dtype", "float32")
        target = load_target_from_args(args)
    out = append_to_datastore(target, spec, args.out, batch_tokens=args.batch_tokens,
                              progress=not args.quiet)
    print(out)
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from dresd.regenerate import RegenerateConfig, read_prompt_rows, regenerate

    set_threads(args)
    if args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0:
        raise UserError("--max-new-tokens and --batch-size must be >= 1, --temperature >= 0")
    check_limit(args)
    if not args.corpus.is_file():
        raise UserError(f"corpus file {args.corpus} does not exist")
    config = RegenerateConfig(prompt_field=args.prompt_field, response_field=args.response_field,
                              format=args.format, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, temperature=args.temperature,
                              seed=args.seed, limit=args.limit)
    read_prompt_rows(args.corpus, config)  # bad input fails before the model loads
    target = load_target_from_args(args)
    ray = ray_pool(args, target) if args.ray is not None else None
    rows = regenerate(target, args.corpus, args.out, config, progress=not args.quiet, ray=ray)
    print(f"{args.out}: {rows} responses")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from dresd.datastore.inspect import describe, format_description

    figures = describe(args.datastore, verify=args.verify)  # a damaged store is an error
    print(json.dumps(figures, indent=2) if args.json else format_description(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
