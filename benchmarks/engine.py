"""Engine benchmark: what a token tree costs to verify, and PLD against AR on copy-heavy prompts.

1. Verify cost: one target forward over a token tree of 1, 2, 4, ..., 64 nodes on top of a
   warm KV cache, relative to a one-token decode step (tree size 1). Sizes are interleaved
   within each repetition so that machine drift hits all of them alike; medians are reported.
2. PLD vs AR: tokens/s and mean accepted length on "add type hints" requests over HumanEval
   solutions (the output mostly repeats the input), methods interleaved prompt by prompt.

Both on the default model, for 1 and 2 PyTorch threads. Results go to
benchmarks/results/engine.{json,md}.

    .venv/bin/python benchmarks/engine.py [--prompts 12] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from time import perf_counter

import numpy as np
import torch
import transformers
from transformers import DynamicCache

from dresd.datasets import type_hint_prompts
from dresd.decoding.generate import target_forward
from dresd.decoding.tree import DraftTree
from dresd.metrics import summarize
from dresd.models import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

TREE_SIZES = [1, 2, 4, 8, 16, 32, 64]
RESULTS = Path(__file__).parent / "results"


def random_tree(size: int, vocab: int, rng: np.random.Generator) -> DraftTree:
    """A bushy tree of exactly `size` nodes (root included), like merged retrieval drafts."""
    tree = DraftTree.from_drafts(int(rng.integers(vocab)), [])
    while len(tree) < size:
        parent = int(rng.integers(len(tree)))
        extended = [tree.tokens[i] for i in tree.path_to(parent)[1:]] + [int(rng.integers(vocab))]
        tree = DraftTree.from_drafts(tree.tokens[0], _drafts_of(tree) + [extended])
    return tree


def _drafts_of(tree: DraftTree) -> list[list[int]]:
    leaves = [i for i in range(1, len(tree)) if not tree.children[i]]
    return [[tree.tokens[i] for i in tree.path_to(leaf)[1:]] for leaf in leaves]


@torch.inference_mode()
def verify_cost(target, context_len: int, repeats: int) -> dict:
    model = target.model
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = torch.tensor([rng.integers(vocab, size=context_len).tolist()])
    cache = DynamicCache(config=model.config)
    target_forward(model, prompt, cache)
    dtype = next(model.parameters()).dtype
    times: dict[int, list[float]] = {size: [] for size in TREE_SIZES}
    for repeat in range(repeats + 1):
        for size in TREE_SIZES:
            tree = random_tree(size, vocab, rng)
            mask = None if tree.is_linear() else tree.attention_mask(context_len, dtype)
            started = perf_counter()
            target_forward(model, tree.input_ids(), cache, tree.position_ids(context_len), mask)
            elapsed = perf_counter() - started
            cache.crop(-size)
            if repeat > 0:  # the first round is a warm-up
                times[size].append(elapsed)
    base = statistics.median(times[1])
    return {str(size): statistics.median(t) / base for size, t in times.items()}


def pld_vs_ar(target, prompts: list[list[int]], max_new_tokens: int) -> dict:
    settings = GenerationSettings(max_new_tokens)
    runners = {
        "ar": MethodRunner(target, AR, settings),
        "pld-1": MethodRunner(target, "pld", settings, num_drafts=1),
        "pld-3": MethodRunner(target, "pld", settings, num_drafts=3),
    }
    for runner in runners.values():
        runner.generate(prompts[0][:32])  # warm-up, untimed
    results = {name: [] for name in runners}
    for ids in prompts:
        for name, runner in runners.items():  # interleaved: A B C, A B C, ...
            results[name].append(runner.generate(ids))
    ar_speed = summarize(results["ar"])["tokens_per_s"]
    table = {}
    for name, runs in results.items():
        figures = summarize(runs)
        identical = sum(r.token_ids == a.token_ids for r, a in zip(runs, results["ar"],
                                                                    strict=True))
        table[name] = {
            "tokens_per_s": figures["tokens_per_s"],
            "speedup": figures["tokens_per_s"] / ar_speed,
            "mean_accepted_length": figures["mean_accepted_length"],
            "acceptance_rate": figures["acceptance_rate"],
            "drafted_tokens_per_step": figures["drafted_tokens_per_step"],
            "draft_time_share": figures["draft_time_share"],
            "identical_fraction": identical / len(runs),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", default="1,2", help="thread counts to measure, in turn")
    args = parser.parse_args()

    target = load_target("default")
    prompts = [encode_prompt(target.tokenizer, p) for p in type_hint_prompts(args.prompts)]
    report = {
        "model": target.name,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "context_len": args.context_len,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "by_threads": {},
    }
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"threads={threads}: verify cost ...", flush=True)
        cost = verify_cost(target, args.context_len, args.repeats)
        print(f"threads={threads}: PLD vs AR ...", flush=True)
        table = pld_vs_ar(target, prompts, args.max_new_tokens)
        report["by_threads"][str(threads)] = {"verify_cost": cost, "methods": table}
        print(json.dumps(report["by_threads"][str(threads)], indent=1), flush=True)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "engine.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# Engine benchmark (recorded by benchmarks/engine.py)",
        "",
        f"Model {report['model']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, CPU {report['cpu']}.",
        "",
        f"## Verify cost: one forward over a tree of N tokens / one-token decode step "
        f"(context {report['context_len']} tokens, medians)",
        "",
        "| threads | " + " | ".join(f"N={n}" for n in TREE_SIZES) + " |",
        "| --- |" + " --- |" * len(TREE_SIZES),
    ]
    for threads, part in report["by_threads"].items():
        costs = part["verify_cost"]
        lines.append(f"| {threads} | " + " | ".join(f"{costs[str(n)]:.2f}" for n in TREE_SIZES)
                     + " |")
    lines += [
        "",
        f"## PLD vs AR on {report['prompts']} HumanEval 'add type hints' prompts "
        f"(greedy, up to {report['max_new_tokens']} new tokens, interleaved)",
        "",
        "| threads | method | tokens/s | speedup | mean accepted length | acceptance rate "
        "| drafted/step | draft time | identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for threads, part in report["by_threads"].items():
        for name, row in part["methods"].items():
            rate = row["acceptance_rate"]
            share = row["draft_time_share"]
            lines.append(
                f"| {threads} | {name} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                f"{row['mean_accepted_length']:.2f} | {'-' if rate is None else f'{rate:.1%}'} | "
                f"{row['drafted_tokens_per_step']:.1f} | "
                f"{'-' if share is None else f'{share:.1%}'} | {row['identical_fraction']:.0%} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
