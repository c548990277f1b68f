"""A drafter's step replayed cold on recorded contexts, for A/B runs of two source trees.

`drafting_ab.py` compares two versions of one attribute in one process. A change that spans C
and several modules (a kernel's signature, a store's arrays) needs two processes instead: this
records the contexts a method's drafter sees in a live run once (the default model, GSM8K,
pickled to `--contexts`), then replays them into a fresh drafter, each call after a 64 MB read
(what a forward does to the caches), and prints the mean and median microseconds a call. Run it
under the two trees alternately, the same contexts file for both:

    git worktree add /tmp/before <commit>
    for round in 1 2 3 4 5; do
        PYTHONPATH=/tmp/before/src:benchmarks/micro \\
            .venv/bin/python benchmarks/micro/drafting_replay.py
        PYTHONPATH=src:benchmarks/micro .venv/bin/python benchmarks/micro/drafting_replay.py
    done

With the ledger's clock held still (as in `drafting_ab.py`) hybrid consults every source at
every step, so a call here costs more than the live loop's average step. `--drop pld,rest`
takes sources out of hybrid: what a source costs it, as an upper bound on what making that
source cheaper could save. A hybrid with a source taken out drafts a source at a time (its
one-call step is planned for the sources it was built with), so `--drop` measures that path.
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import numpy as np
import torch
from drafting_ab import record_contexts

from dresd.bench.methods import parse_methods
from dresd.datasets import load_prompts
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--datastore", default="runs/demo-gsm8k-id-store")
    parser.add_argument("--limit", type=int, default=4, help="GSM8K questions recorded")
    parser.add_argument("--contexts", type=Path, default=None,
                        help="the recorded contexts (default: /tmp/dresd-contexts-METHOD.pkl); "
                             "recorded there when missing")
    parser.add_argument("--rounds", type=int, default=1, help="replays, each a fresh drafter")
    parser.add_argument("--drop", default="", help="hybrid's sources to leave out, e.g. pld,rest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_target("default", dtype="auto")
    [(label, method, options)] = parse_methods(args.method)
    options = {"datastore": args.datastore, **options} if args.datastore else options

    def runner() -> MethodRunner:
        return MethodRunner(target, method, GenerationSettings(max_new_tokens=128),
                            label=label, **options)

    path = args.contexts or Path(f"/tmp/dresd-contexts-{label}.pkl")
    if path.exists():
        contexts = pickle.loads(path.read_bytes())
    else:
        prompts = [encode_prompt(target.tokenizer, p.text)
                   for p in load_prompts("gsm8k", args.limit)]
        contexts = record_contexts(runner(), prompts)
        path.write_bytes(pickle.dumps(contexts))
    evict = np.ones(64_000_000 // 8)
    for round_number in range(args.rounds):
        fresh = runner().drafter
        for name in filter(None, args.drop.split(",")):
            fresh.sources.pop(name)
        if hasattr(fresh, "clock"):  # hybrid: its ledger's verdicts must not hang on timings
            fresh.clock = lambda: 0.0
        seconds = []
        for context in contexts:
            evict.sum()
            began = time.perf_counter()
            fresh.propose(context)
            seconds.append(time.perf_counter() - began)
        us = np.array(seconds) * 1e6
        print(f"{args.method} round {round_number}: {len(us)} calls, each cold: mean "
              f"{us.mean():.1f} us, median {np.median(us):.1f}", flush=True)


if __name__ == "__main__":
    main()
