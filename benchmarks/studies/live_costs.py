"""What a verify step costs as the live loop pays it, by tree size, against the calibrated curve.

    .venv/bin/python benchmarks/studies/live_costs.py --dataset mt_bench --limit 24 \
        --datastore ~/.cache/dresd/datastores/all --name mt-bench

`dresd calibrate` times bare forwards over random trees on a 256-token random context. In a
generation, a step's verify (`StepRecord.verify_seconds`: the mask, the forward, acceptance and
trimming the cache) runs over the real, longer context, right after drafting. This script
generates with `none` (plain decoding through the speculative loop: the one-token step), AR
(transformers' `generate`, for tokens/s), `suffix` and `hybrid`, interleaved prompt by prompt,
and prints for every (method, tree size, linear or branching) seen at least 15 times

    live cost(t) = median verify seconds of its steps / median verify seconds of the same
                   method's one-token steps (steps it drafted nothing; `none`'s for `none`)

beside the calibrated cost(t) that replays and hybrid's budget use. The unit is the method's
own one-token step, taken in the same stretch of the run, so that drift and other jobs on the
machine shift both alike. Results: results/live_costs/NAME.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from draft_shapes import print_table

from dresd.calibrate import cost_at, load_or_measure
from dresd.datasets import load_prompts
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

RESULTS = Path(__file__).parents[1] / "results" / "live_costs"
MIN_STEPS = 15  # steps of one (method, size, shape) before its median is printed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="as bench --dataset")
    parser.add_argument("--datastore", default=None, help="hybrid's store (dense and/or sparse)")
    parser.add_argument("--limit", type=int, default=24, help="first N prompts")
    parser.add_argument("--name", default=None, help="write results/live_costs/NAME.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    target = load_target("default", dtype="auto")
    curve = load_or_measure(target)
    settings = GenerationSettings(max_new_tokens=128)
    runners = {"ar": MethodRunner(target, "ar", settings),
               "none": MethodRunner(target, "none", settings),
               "suffix": MethodRunner(target, "suffix", settings),
               "hybrid": MethodRunner(target, "hybrid", settings, datastore=args.datastore)}
    verify, draft = defaultdict(list), defaultdict(list)
    seconds, tokens = defaultdict(float), defaultdict(int)
    for prompt in load_prompts(args.dataset)[: args.limit]:
        ids = encode_prompt(target.tokenizer, prompt.text)
        for method, runner in runners.items():
            result = runner.generate(ids)
            seconds[method] += result.total_seconds
            tokens[method] += len(result.token_ids)
            for step in result.steps:
                shape = "linear" if step.draft_depth == step.num_drafted else "branching"
                verify[method, step.num_drafted + 1, shape].append(step.verify_seconds)
                draft[method].append(step.draft_seconds)

    one_token = {m: statistics.median(verify[m, 1, "linear"] or verify["none", 1, "linear"])
                 for m in runners if m != "ar"}
    ar_speed = tokens["ar"] / seconds["ar"]
    lines = [f"# Live verify cost by tree size ({args.dataset}, {args.limit} prompts, "
             f"{target.dtype}, 1 thread)", "",
             "One-token step, median ms: " + ", ".join(f"{m} {1e3 * t:.1f}"
                                                      for m, t in one_token.items())
             + ". Tokens/s over AR's, same run: " + ", ".join(
                 f"{m} {tokens[m] / seconds[m] / ar_speed:.2f}x" for m in one_token) + ".", "",
             "| method | tree tokens | shape | steps | live cost | calibrated cost |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for method, size, shape in sorted(verify, key=lambda k: (k[1], k[0], k[2])):
        times = verify[method, size, shape]
        if len(times) >= MIN_STEPS:
            lines.append(f"| {method} | {size} | {shape} | {len(times)} | "
                         f"{statistics.median(times) / one_token[method]:.2f} | "
                         f"{cost_at(curve, size):.2f} |")
    lines += ["", "| method | draft ms, median | draft ms, mean |", "| --- | ---: | ---: |"]
    lines += [f"| {m} | {1e3 * statistics.median(d):.2f} | {1e3 * np.mean(d):.2f} |"
              for m, d in draft.items()]
    print_table(lines, RESULTS, args.name)


if __name__ == "__main__":
    main()
