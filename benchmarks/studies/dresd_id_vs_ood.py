"""DReSD with an in-distribution (ID) vs an out-of-distribution (OOD) datastore, beside AR and PLD.

The paper's finding: a datastore built from the target's own responses (ID) drafts far better
than one built from a corpus's reference responses (OOD). Here, at a small CPU scale:

- corpus: the first `--train` GSM8K training questions;
- OOD store: those questions with GSM8K's reference answers;
- ID store: the same questions with the target's own greedy answers (`regenerate`);
- evaluation: the first `--eval` GSM8K *test* questions (never in either store), greedy,
  `--max-new-tokens` tokens, methods interleaved prompt by prompt; every speculative output is
  checked against AR's. DReSD runs with the paper's draft shape (10 drafts of 10) and, on the ID
  store, also with 3 drafts of 6 (`dresd-id-3x6`): on a CPU, verifying a tree costs about as
  much as its token count, unlike on a GPU.

    PYTHONPATH=src python benchmarks/studies/dresd_id_vs_ood.py [--train 96] [--eval 8] \\
        [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dresd.corpus import CorpusSpec
from dresd.datasets import data_dir, read_jsonl
from dresd.datastore.dense import build_dense
from dresd.metrics import summarize
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.regenerate import RegenerateConfig, regenerate
from dresd.runner import AR, GenerationSettings, MethodRunner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=96)
    parser.add_argument("--eval", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/dresd_id_vs_ood.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("default")
    gsm8k = data_dir() / "gsm8k"
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "train.jsonl"
        rows = read_jsonl(gsm8k / "train.jsonl")[: args.train]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        started = time.perf_counter()
        own = tmp / "own.jsonl"
        regenerate(target, prompts, own, RegenerateConfig(prompt_field="question",
                                                          max_new_tokens=256, batch_size=8))
        timings["regenerate_seconds"] = round(time.perf_counter() - started, 1)
        stores = {}
        for name, corpus, field in (("ood", prompts, "answer"), ("id", own, "response")):
            started = time.perf_counter()
            spec = CorpusSpec([str(corpus)], prompt_field="question", response_field=field)
            stores[name] = build_dense(target, spec, tmp / name, progress=False)
            timings[f"build_{name}_seconds"] = round(time.perf_counter() - started, 1)

        settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
        runners = {AR: MethodRunner(target, AR, settings),
                   "pld": MethodRunner(target, "pld", settings),
                   "dresd-ood": MethodRunner(target, "dresd", settings,
                                             datastore=str(stores["ood"])),
                   "dresd-id": MethodRunner(target, "dresd", settings,
                                            datastore=str(stores["id"])),
                   # A smaller tree: on a CPU a verify forward costs about its token count.
                   "dresd-id-3x6": MethodRunner(target, "dresd", settings,
                                                datastore=str(stores["id"]), num_drafts=3,
                                                draft_len=6)}
        questions = [r["question"] for r in read_jsonl(gsm8k / "test.jsonl")[: args.eval]]
        warmup = encode_prompt(target.tokenizer, "Hello")
        for runner in runners.values():
            runner.generate(warmup)
        results = {name: [] for name in runners}
        for number, question in enumerate(questions, 1):
            ids = encode_prompt(target.tokenizer, question)
            for name, runner in runners.items():  # interleaved: drift hits all alike
                results[name].append(runner.generate(ids))
            print(f"prompt {number}/{len(questions)}", file=sys.stderr)

    reference = results[AR]
    ar_speed = summarize(reference)["tokens_per_s"]
    methods = {}
    for name, runs in results.items():
        figures = summarize(runs)
        methods[name] = {
            "tokens_per_s": round(figures["tokens_per_s"], 2),
            "speedup": round(figures["tokens_per_s"] / ar_speed, 3),
            "mean_accepted_length": None if name == AR else
            round(figures["mean_accepted_length"], 3),
            "acceptance_rate": None if figures.get("acceptance_rate") is None else
            round(figures["acceptance_rate"], 4),
            "identical_to_ar": sum(r.token_ids == a.token_ids
                                   for r, a in zip(runs, reference, strict=True)),
        }
        print(name, json.dumps(methods[name]), file=sys.stderr)
    result = {"benchmark": "dresd_id_vs_ood", "threads": args.threads,
              "model": "SmolLM2-135M-Instruct",
              "stores": f"first {args.train} GSM8K train questions; OOD = reference answers, "
                        "ID = the model's own greedy answers (256 new tokens at most)",
              "eval": f"first {args.eval} GSM8K test questions, greedy, "
                      f"{args.max_new_tokens} new tokens at most",
              **timings, "methods": methods,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
