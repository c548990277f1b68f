"""Where each drafter's time goes in a live run: a table per method of the calls inside a step.

A live profile, not a replay: the drafter runs between verify forwards, as in `dresd bench`, so
its caches are as cold as they are there (a forward streams the model's weights through them).
Each function listed in `PROBES` is wrapped by a timer that adds its wall time (inclusive of what
it calls) and counts its calls; the table divides both by the method's decode steps. The row
`drafting (loop)` is the batched loop's whole `_draft` (the drafter's `propose` and the merge
into the step's token tree): what `dresd bench` reports as drafting. `observe` runs once per
finished generation; its per-step figure is its total over the steps.

    PYTHONPATH=src .venv/bin/python benchmarks/micro/drafter_profile.py \\
        --datastore runs/demo-gsm8k-id-store --limit 6 --threads 1 \\
        --out benchmarks/results/drafter_profile
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from dresd.bench.methods import parse_methods
from dresd.datasets import load_prompts
from dresd.host import cpu_model, native_bf16_flags
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

# "module:Class.attribute" -> the row's name. Inclusive times: a row's time holds its callees'.
PROBES = {
    "dresd.decoding.batch:BatchEngine.step": "step (loop: drafting, forward, acceptance)",
    "dresd.decoding.batch:BatchEngine._draft": "drafting (loop)",
    "dresd.decoding.tree:DraftTree.from_drafts": "  token tree (loop)",
    "dresd.drafters.lookup:PromptLookupDrafter.propose": "  pld.propose",
    "dresd.drafters.suffix:SuffixDrafter.speculation_tree": "  suffix.speculation_tree",
    "dresd.drafters.suffix:SuffixDrafter._update_request": "    suffix: extend request trie",
    "dresd.drafters.suffix:SuffixDrafter.best_tree": "    suffix: best_tree (both tries)",
    "dresd.drafters.suffix:SuffixTrie.find": "      suffix: find",
    "dresd.drafters.suffix:expand": "      suffix: expand",
    "dresd.drafters.rest:RestDrafter.propose": "  rest.propose",
    "dresd.drafters.dense:DenseDrafter.neighbour_rows": "  dresd: neighbours' drafts",
    "dresd.datastore.transform:KeyTransform.apply": "    dresd: transform",
    "dresd.datastore.transform:KeyTransform.key": "    dresd: transform",
    "dresd.datastore.index:FaissIndex.search": "    dresd: FAISS search",
    "dresd.datastore.dense:DenseDatastore.search": "    dresd: search (transform incl.)",
    "dresd.drafters.dense:agreeing_prefixes": "  dresd: agreeing_prefixes",
    "dresd.drafters.prefixes:padded_prefix_tree": "  dresd: node budget (prefix tree)",
    "dresd.kernels.drafting:dense_drafts": "    dresd: drafts from the store, in C",
    "dresd.kernels.drafting:dense_neighbour_rows": "    dresd: key, search, drafts: one C call",
    "dresd.drafters.hybrid:HybridDrafter._learn": "  hybrid: learn (table, ledger)",
    "dresd.drafters.hybrid:HybridDrafter._learn_merge_and_cut": "  hybrid: learn, merge, cut",
    "dresd.kernels.drafting:HybridTree.observe": "    hybrid: learn, in C",
    "dresd.drafters.hybrid:SourceLedger.record": "  hybrid: ledger",
    "dresd.drafters.hybrid:HybridDrafter._merge": "  hybrid: merge candidates",
    "dresd.kernels.drafting:HybridTree.__init__": "    hybrid: merge, in C",
    "dresd.drafters.hybrid:HybridDrafter._cut": "  hybrid: cut (estimates, budget)",
    "dresd.kernels.drafting:HybridTree.drafted": "    hybrid: learn, merge, cut, in C",
    "dresd.drafters.hybrid:HybridDrafter._step_in_c": "  hybrid: the step in one C call",
    "dresd.kernels.drafting:hybrid_step": "    hybrid: sources, learn, merge, cut, in C",
    "dresd.drafters.hybrid:HybridDrafter.propose": "  hybrid: propose (all of the above)",
    "dresd.decoding.drafter:Drafter.candidates": "  hybrid: candidates of pld, rest",
    "dresd.drafters.suffix:SuffixDrafter.candidates": "  hybrid: candidates of suffix",
    "dresd.drafters.dense:DenseDrafter.candidates": "  hybrid: candidates of dresd",
    "dresd.drafters.hybrid:SourceLedger.to_skip": "  hybrid: which source to skip",
    "dresd.drafters.hybrid:HybridDrafter._follows_last_step": "  hybrid: same generation?",
    "dresd.decoding.batch:BatchEngine._fit_budget": "budget (loop)",

    "dresd.decoding.budget:AcceptanceEstimates.observe": "estimates.observe (loop)",
    "dresd.decoding.drafter:Drafter.observe": "observe (finished generation)",
    "dresd.drafters.suffix:SuffixDrafter.observe": "observe (finished generation)",
    "dresd.drafters.hybrid:HybridDrafter.observe": "observe (finished generation)",
}


class Timers:
    """Seconds and calls per probe name, filled by the wrappers `install` puts in place.
    `clock`: wall time, or the thread's CPU time (`--clock cpu`: what a step's drafting costs
    the core it runs on, whatever else the machine runs; a shared machine stretches wall time
    by the time the thread waits for a core)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth: dict[str, int] = defaultdict(int)  # recursion guard: time the outer call

    def wrap(self, name: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if self.depth[name]:
                return function(*args, **kwargs)
            self.depth[name] += 1
            started = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += self.clock() - started
                self.calls[name] += 1
                self.depth[name] -= 1
        return timed

    def install(self) -> None:
        for path, name in PROBES.items():
            module_name, attribute = path.split(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:  # not in the version of the code profiled
                continue
            owner_name, _, member = attribute.rpartition(".")
            owner = getattr(module, owner_name, None) if owner_name else module
            original = (owner.__dict__.get(member) if owner_name else getattr(module, member, None)
                        ) if owner is not None else None
            if original is None:  # not in this version of the code (a profile of an older one)
                continue
            if isinstance(original, classmethod | staticmethod):  # wrap the function inside
                timed = type(original)(self.wrap(name, original.__func__))
            else:
                timed = self.wrap(name, original)
            setattr(owner, member, timed)
            if not owner_name:  # a module function: also where drafters imported it by name
                for other in list(importlib.sys.modules.values()):
                    if getattr(other, "__name__", "").startswith("dresd.") and \
                            getattr(other, member, None) is original:
                        setattr(other, member, getattr(module, member))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--methods", default="ar,pld,suffix,dresd,dresd[max_tree_nodes=4],"
                                             "rest[max_tree_nodes=4],hybrid")
    parser.add_argument("--datastore", default="runs/demo-gsm8k-id-store",
                        help="'none': hybrid from PLD and suffix alone (a model with no store)")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time the probes by wall time or by the thread's CPU time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype)
    prompts = [encode_prompt(target.tokenizer, p.text)
               for p in load_prompts(args.dataset, args.limit)]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    timers = Timers(time.perf_counter if args.clock == "wall" else time.thread_time)
    timers.install()
    meta = {"threads": args.threads, "cpu": cpu_model(), "cpu_native_bf16": native_bf16_flags(),
            "clock": args.clock, "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report = {"meta": meta, "model": target.name,
              "dtype": str(target.dtype), "dataset": args.dataset, "prompts": len(prompts),
              "methods": {}}
    for label, method, options in parse_methods(args.methods):
        if method in ("dresd", "rest", "hybrid") and args.datastore != "none":
            options = {"datastore": args.datastore, **options}
        runner = MethodRunner(target, method, settings, label=label, **options)
        runner.generate(prompts[0])  # warm-up: kernels, the first search
        runner.forget()
        timers.reset()
        started = time.perf_counter()
        results = [runner.generate(p) for p in prompts]
        failed = [r.stop_reason for r in results if r.stop_reason == "error"]
        if failed:
            raise SystemExit(f"{label}: {len(failed)} generations failed")
        wall = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        steps = sum(len(r.steps) for r in results) or tokens  # ar: a token a step

        rows = {name: {"ms_per_step": 1e3 * timers.seconds[name] / steps,
                       "calls_per_step": timers.calls[name] / steps}
                for name in dict.fromkeys(PROBES.values()) if timers.calls.get(name)}
        verify = sum(s.verify_seconds for r in results for s in r.steps)
        report["methods"][label] = {"tokens_per_second": tokens / wall, "steps": steps,
                                    "tokens_per_step": tokens / steps,
                                    "step_ms": 1e3 * wall / steps,
                                    "verify_ms_per_step": 1e3 * verify / steps, "rows": rows}
        print(f"\n{label}: {tokens / wall:.1f} tokens/s, {1e3 * wall / steps:.2f} ms a step, "
              f"{tokens / steps:.2f} tokens a step")
        for name, row in rows.items():
            print(f"  {name:<40} {row['ms_per_step']:8.3f} ms/step  "
                  f"{row['calls_per_step']:6.2f} calls/step")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "profile.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Drafting per step, live ({report['model']}, {report['dtype']}, "
             f"{report['dataset']} x {report['prompts']}, {meta.get('threads')} thread(s), "
             f"{meta.get('cpu', '')})", "",
             f"{meta['date']}; probes timed by {meta['clock']} clock; load average before the "
             f"run {', '.join(f'{x:.1f}' for x in meta['load_average'])}. Times are inclusive "
             "(a row holds the rows indented under it); per decode step of the method.", ""]
    for label, figures in report["methods"].items():
        lines += [f"## {label}: {figures['tokens_per_second']:.1f} tokens/s, step "
                  f"{figures['step_ms']:.2f} ms (verify {figures['verify_ms_per_step']:.2f}), "
                  f"{figures['tokens_per_step']:.2f} tokens a step", "",
                  "| where | ms a step | calls a step |", "| --- | ---: | ---: |"]
        lines += [f"| {name.strip()} | {row['ms_per_step']:.3f} | {row['calls_per_step']:.2f} |"
                  for name, row in figures["rows"].items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
