"""A drafting change measured paired: two drafters fed the same contexts, every call cold.

A drafter's step costs 0.1-0.5 ms between forwards that take 4-9 ms and change with the load of
this shared 2-core machine, so two runs' drafting times differ by more than most changes to it.
This records the contexts a method's drafter sees in a live run (the default model, GSM8K), then
replays them into two fresh drafters, A as the code is and B with one attribute replaced, call
by call in alternating order, each call after a 64 MB read (what a forward does to the caches).
Both drafters see the same contexts in the same order, so they learn the same; with the ledger's
clock held still, they skip the same sources. The paired differences cancel the machine's drift.

    PYTHONPATH=src:benchmarks/micro .venv/bin/python benchmarks/micro/drafting_ab.py \\
        --method hybrid --datastore runs/demo-gsm8k-id-store \\
        --replace dresd.drafters.hybrid:HybridDrafter._follows_last_step \\
        --with my_variants:old_follows_last_step

Replacing an attribute by itself (`--with` the same object) measures the method's noise floor.
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np
import torch

from dresd.bench.methods import parse_methods
from dresd.datasets import load_prompts
from dresd.decoding.drafter import DraftContext
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner


def resolve(spec: str) -> tuple[object, str]:
    """'module:Name' or 'module:Class.name' -> (the owner, the attribute's name)."""
    module_name, path = spec.split(":")
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


def record_contexts(runner: MethodRunner, prompts: list[list[int]]) -> list[DraftContext]:
    """Every context the runner's drafter is asked to draft for, copied."""
    recorded = []
    drafter_class = type(runner.drafter)
    propose = drafter_class.propose

    def recording(self, context: DraftContext):
        recorded.append(DraftContext(context.token_ids.copy(), context.hidden_state.clone(),
                                     context.max_draft_len, context.batch_size,
                                     context.batch_tokens, context.batch_seconds))
        return propose(self, context)

    drafter_class.propose = recording
    try:
        for prompt in prompts:
            runner.generate(prompt)
    finally:
        drafter_class.propose = propose
    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--model", default="default")
    parser.add_argument("--datastore", default=None)
    parser.add_argument("--limit", type=int, default=4, help="GSM8K questions recorded")
    parser.add_argument("--replace", required=True, help="module:attribute (B replaces it)")
    parser.add_argument("--with", dest="variant", required=True, help="module:attribute")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_target(args.model, dtype="auto")
    prompts = [encode_prompt(target.tokenizer, p.text) for p in load_prompts("gsm8k", args.limit)]
    [(label, method, options)] = parse_methods(args.method)  # e.g. rest[max_tree_nodes=4]
    if args.datastore:
        options = {"datastore": args.datastore, **options}

    def runner() -> MethodRunner:
        return MethodRunner(target, method, GenerationSettings(max_new_tokens=128),
                            label=label, **options)

    contexts = record_contexts(runner(), prompts)
    owner, name = resolve(args.replace)
    variant_owner, variant_name = resolve(args.variant)
    values = (getattr(owner, name), getattr(variant_owner, variant_name))
    drafters = (runner().drafter, runner().drafter)
    for drafter in drafters:
        if hasattr(drafter, "clock"):  # hybrid: its ledger's verdicts must not hang on timings
            drafter.clock = lambda: 0.0
    evict = np.ones(64_000_000 // 8)
    seconds = ([], [])
    for number, context in enumerate(contexts):
        for which in (0, 1) if number % 2 else (1, 0):
            setattr(owner, name, values[which])
            evict.sum()
            began = time.perf_counter()
            drafters[which].propose(context)
            seconds[which].append(time.perf_counter() - began)
    setattr(owner, name, values[0])
    a, b = (np.array(s) * 1e6 for s in seconds)
    print(f"{args.method}: {len(contexts)} calls, each cold. A (as it is): mean {a.mean():.1f} us, "
          f"median {np.median(a):.1f}; B: mean {b.mean():.1f}, median {np.median(b):.1f}; "
          f"B - A paired: mean {(b - a).mean():+.1f} us, median {np.median(b - a):+.1f}")


if __name__ == "__main__":
    main()
