"""Option groups that several commands share, and what those options turn into.

    add_model_options       the model and how it generates: generate, bench, serve
    add_dtype_option, add_device_option, add_threads_option
    add_ray_options         build, corpus regenerate
    add_save_outputs_option generate, bench, serve
    add_prefix_cache_options serve, bench (--concurrency), corpus regenerate

Every check of a value raises `UserError` before the model loads, so a bad value costs
nothing and reads as one line.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

from dresd.datastore.format import open_manifest
from dresd.decoding.prefix_cache import DEFAULT_MB
from dresd.decoding.sampling import GREEDY_BELOW, sampling_or_greedy
from dresd.device import DEVICE_HELP, device_name
from dresd.errors import UserError
from dresd.fingerprint import tokenizer_fingerprint
from dresd.host import native_bf16_flags
from dresd.models.fastpath import DTYPES, dtype_name
from dresd.models.target import DEFAULT_MODEL, Target, load_target
from dresd.raypool import RayPool
from dresd.runner import GenerationSettings


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


MAX_THREADS = 4096  # beyond any CPU's cores; torch takes a C int


def thread_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_THREADS}], got {text}")
    return value


def add_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="the model's dtype; auto (default): bfloat16 where the hardware "
                        "multiplies it natively (CPU amx_bf16 or avx512_bf16, CUDA), else "
                        "float32. Output is token-identical to plain decoding in the same "
                        "dtype (elsewhere than a CPU, reduced precision may differ at "
                        "near-ties: see README)")


def add_device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def add_threads_option(p: argparse.ArgumentParser, help: str = "PyTorch threads") -> None:
    p.add_argument("--threads", type=thread_count, default=None, help=help)


def add_save_outputs_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-outputs", type=Path, default=None, metavar="FILE.jsonl",
                   help="append each prompt and output (text and exact token ids) to this "
                        "file: a corpus for `dresd build`, and what `dresd build --append` adds "
                        "to an existing datastore (so that what --learn learns lasts)")


def add_ray_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"{what} on Ray actors, each holding the model once; ADDRESS: a "
                        "cluster's (none: $RAY_ADDRESS or a local Ray). Needs "
                        "pip install 'dresd[ray]'")
    p.add_argument("--ray-actors", type=int, default=None,
                   help="with --ray: how many actors (default: the cluster's CPUs / threads)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The target, how it generates, and every drafter's options (each drafter takes those it
    knows): `generate`, `bench` and `serve` share them."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a Hugging Face id, a local folder, a GGUF file (FILE.gguf: its quantized "
                        "weights run as they are), 'default' (SmolLM2-135M-Instruct) or "
                        "'default-gguf' (its own Q4_1 GGUF file)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize prompts as raw text instead of a chat turn")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    p.add_argument("--seed", type=seed_int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_threads_option(p)
    add_dtype_option(p)
    add_device_option(p)
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
    p.add_argument("--no-budget", action="store_true",
                   help="verify every draft as the drafter shaped it (DReSD: the paper's "
                        "--num-drafts x --draft-len); by default each step keeps only the "
                        "draft tokens that pay for their rows in the step's forward, priced "
                        "by this machine's verify-cost curve (see `dresd calibrate`); "
                        "--max-tree-nodes also fixes the shape")
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


def add_prefix_cache_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--prefix-cache-mb", type=finite_float, default=DEFAULT_MB, metavar="MB",
                   help=f"{what}: keys and values of prompts and answers kept for requests "
                        f"that start the same way, at most this many MB (default {DEFAULT_MB}; "
                        "outputs are the same with or without it)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="read every prompt afresh (no prefix cache)")


def prefix_cache_mb(args: argparse.Namespace) -> float | None:
    """The prefix cache's size in MB from --prefix-cache-mb, or None with --no-prefix-cache."""
    if args.prefix_cache_mb < 0:
        raise UserError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    return None if args.no_prefix_cache else args.prefix_cache_mb


def set_threads(args: argparse.Namespace) -> None:
    """Apply --threads (every command that runs the model has it)."""
    if args.threads is not None:  # in range: `thread_count` parsed it
        torch.set_num_threads(args.threads)


def check_limit(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")


def settings_from_args(args: argparse.Namespace) -> GenerationSettings:
    """--max-new-tokens, the sampling options and --stop, checked; also applies --threads."""
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    sampling = sampling_or_greedy(args.temperature, args.top_k, args.top_p, args.seed)
    if sampling is None and (args.top_p != 1.0 or args.top_k != 0):
        raise UserError(f"--top-p and --top-k apply to sampling: also give --temperature >= "
                        f"{GREEDY_BELOW} (below it decoding is greedy)")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    set_threads(args)
    return GenerationSettings(args.max_new_tokens, sampling, list(args.stop))


def check_datastore_arg(args: argparse.Namespace) -> None:
    """A missing or damaged --datastore is refused before the model loads (`verify_store`)."""
    if args.datastore is None:
        return
    if not args.datastore.is_dir():
        raise UserError(f"datastore folder {args.datastore} does not exist")
    open_manifest(args.datastore)


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


def load_tokenizer_target(model: str) -> Target:
    """--model for work that runs no forward (a sparse store needs the tokenizer only): on the
    CPU, in its own dtype, unpacked."""
    return load_target(model, device="cpu", prepack=False)


def drafter_options(args: argparse.Namespace, target: Target, methods: list[str]) -> dict:
    """Every drafter option given on the command line; each drafter takes those it knows."""
    options = dict(max_ngram=args.max_ngram, min_ngram=args.min_ngram, draft_len=args.draft_len,
                   num_drafts=args.num_drafts, k=args.k,
                   datastore=str(args.datastore) if args.datastore else None,
                   max_suffix=args.max_suffix, min_suffix=args.min_suffix,
                   max_matches=args.max_matches, max_tree_nodes=args.max_tree_nodes,
                   learn=args.learn, max_depth=args.max_depth,
                   max_spec_factor=args.max_spec_factor, max_spec_offset=args.max_spec_offset,
                   min_token_prob=args.min_token_prob,
                   max_cached_requests=args.max_cached_requests,
                   max_cached_tokens=args.max_cached_tokens,
                   budget=False if args.no_budget else None)
    if "draft" in methods:
        if args.draft_model is None:
            raise UserError("--method draft needs --draft-model")
        draft = load_target(args.draft_model, dtype=target.dtype, device=target.device)
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise UserError(f"the draft model {args.draft_model!r} does not share the "
                            f"tokenizer of the target {args.model!r}")
        options["model"] = draft.model
    return options


def output_origin(target: Target) -> dict:
    """Who makes the outputs: saved with them, checked when they are built into a store."""
    return {"model": target.name, "model_fingerprint": target.fingerprint,
            "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer)}


def ray_pool(args: argparse.Namespace, target: Target) -> RayPool:
    """`--ray`: actors that load --model in the dtype the driver's target has (so that their
    forwards are the driver's), on --device of their own node."""
    load = partial(load_target, args.model, dtype=dtype_name(target.dtype), device=args.device)
    return RayPool(load, address=args.ray or None, actors=args.ray_actors,
                   threads=args.threads or 1)
