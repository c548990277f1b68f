"""Any methods replayed on a recorded bench run's AR outputs: a quick, load-proof estimate.

    python benchmarks/studies/replay_methods.py --run benchmarks/results/hybrid/humaneval-stdlib \
        --methods 'suffix,hybrid,hybrid[draft_len=16]' [--limit N] [--name NAME]

The run's report gives the prompts, the datastore, the dtype, the verify-cost curve and AR's
time per token (also hybrid's one-token step, against which it weighs each source's drafting
time); every method is replayed on AR's outputs (`dresd.bench.replay`), drafting timed in CPU
time, and priced with that curve. Where the run measured a method of the same label, its
measured speedup is printed beside the estimate, to read the estimate against. With
--name, the table is written to results/replay/NAME.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from draft_shapes import print_table, recorded_run

from dresd.bench.methods import parse_methods
from dresd.bench.replay import drafter_proposer, replay, summarise
from dresd.drafters import make_drafter

RESULTS = Path(__file__).parents[1] / "results" / "replay"
COMBINED = ("hybrid",)  # methods that combine the others: not "single methods"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a bench --out folder")
    parser.add_argument("--methods", required=True, help="as bench --methods")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of the run")
    parser.add_argument("--name", default=None, help="write results/replay/NAME.md")
    parser.add_argument("--evict-mb", type=float, default=0.0,
                        help="read this many MB before every drafting call, as a verify "
                             "forward streams the weights (bf16 default model: ~270); 0: warm")
    args = parser.parse_args()
    torch.set_num_threads(1)

    report, curve, ar_rows, refs = recorded_run(args.run, args.limit)
    meta = report["meta"]
    step_seconds = 1.0 / report["methods"]["ar"]["tokens_per_s"]
    tokens = sum(len(r["token_ids"]) for r in ar_rows)

    table = {}
    for label, method, options in parse_methods(args.methods):
        if method == "ar":  # the baseline: est. speedup 1 by definition
            continue
        drafter = make_drafter(method, datastore=meta.get("datastore"), cost=curve,
                               step_seconds=step_seconds, **options)
        steps, seconds = replay(refs, drafter_proposer(drafter, refs), drafter,
                                evict_bytes=int(args.evict_mb * 2**20))
        table[label] = summarise(steps, seconds, tokens, curve, step_seconds)
    singles = [m for m in table if m.split("[")[0] not in COMBINED]
    best = max(singles, key=lambda m: table[m]["est_speedup"]) if singles else None
    caches = f", {args.evict_mb:g} MB read between calls" if args.evict_mb else ", warm caches"
    lines = [f"# Replayed on `{args.run}` ({len(refs)} prompts, {tokens} tokens, {meta['dtype']}, "
             f"{meta['threads']} thread{caches})", "",
             "| method | mean accepted length | drafted/step | draft ms/step | draft share | "
             "est. speedup | est. / best single | measured speedup (recorded run) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, t in table.items():
        measured = report["methods"].get(label, {}).get("speedup")
        ratio = t["est_speedup"] / max(1.0, table[best]["est_speedup"]) if best else float("nan")
        lines.append(f"| {label} | {t['mean_accepted_length']:.2f} | {t['drafted_per_step']:.1f} "
                     f"| {t['draft_ms_per_step']:.2f} | {t['draft_share']:.1%} "
                     f"| {t['est_speedup']:.2f}x | {ratio:.2f} "
                     f"| {f'{measured:.2f}x' if measured else '-'} |")
    print_table(lines, RESULTS, args.name)


if __name__ == "__main__":
    main()
