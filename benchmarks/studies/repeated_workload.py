"""A repeated workload: requests that come back, for stores that learn (`--learn`).

Two sets, each one interleaved run (every method on every request in turn, request by request,
so that a learning method sees the earlier requests' outputs, as a server would):

- `mt_bench2`: MT-Bench questions with both turns. Turn 2 is asked in the same chat, after
  turn 1's answer (AR's; every method's is identical under greedy decoding); it often asks to
  rewrite that answer.
- `gsm8k_variants`: GSM8K test questions, each asked, then asked again at once with its first
  number increased by one (a user retrying with a small change).

Before the run every method generates once for "Hi!" (untimed warm-up; a learning method keeps
that output too). Categories in the report: "turn 1" / "turn 2", "original" / "variant".

    .venv/bin/python benchmarks/studies/repeated_workload.py --set mt_bench2 --limit 5 \\
        --datastore runs/gsm8k-200 --out benchmarks/results/repeated_workload/mt_bench2
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import time
from pathlib import Path

import torch
import transformers

from dresd.bench.methods import parse_methods
from dresd.bench.report import build_report, markdown_table, write_report
from dresd.bench.runner import BenchRecord
from dresd.datasets import EvalPrompt, data_dir, read_jsonl, round_robin
from dresd.models.fastpath import dtype_name
from dresd.models.target import load_target
from dresd.prompts import encode_prompt
from dresd.runner import AR, GenerationSettings, MethodRunner

METHODS = ("ar,pld,suffix[learn=0],suffix,rest[max_tree_nodes=8],"
           "rest[max_tree_nodes=8,learn=1],dresd[max_tree_nodes=8],"
           "dresd[max_tree_nodes=8,learn=1]")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def bump_first_number(text: str) -> str:
    """The question with its first integer increased by one."""
    return re.sub(r"\d+", lambda m: str(int(m.group()) + 1), text, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=["mt_bench2", "gsm8k_variants"], required=True)
    parser.add_argument("--limit", type=int, default=5, help="questions (each asked twice)")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--datastore", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target("default")
    tokenizer = target.tokenizer
    settings = GenerationSettings(args.max_new_tokens)
    specs = [(AR, AR, {})] + [s for s in parse_methods(args.methods) if s[0] != AR]
    runners = [MethodRunner(target, method, settings, label, datastore=str(args.datastore),
                            **options) for label, method, options in specs]
    for runner in runners:  # warm-up, untimed
        runner.generate(encode_prompt(tokenizer, "Hi!"))

    records: list[BenchRecord] = []
    cpu_seconds: dict[tuple[str, int], float] = {}  # (method, request) -> this process's CPU time

    def generate(runner: MethodRunner, ids: list[int], index: int):
        """One generation, its CPU time recorded beside the wall time: on a shared machine the
        wall clock also runs while other jobs hold the core, the CPU clock does not."""
        started = time.process_time()
        result = runner.generate(ids)
        cpu_seconds[(runner.label, index)] = time.process_time() - started
        return result

    def run_all(prompt: EvalPrompt, ids: list[int]) -> list[int]:
        """Every method on one request, in turn; returns AR's output."""
        index = len(records) // len(runners)
        row = [BenchRecord(r.label, index, prompt, generate(r, ids, index)) for r in runners]
        records.extend(row)
        reference = row[0].result.token_ids
        print(f"#{index} {prompt.category}: " + ", ".join(
            f"{r.method} {len(r.result.token_ids) / r.result.total_seconds:.1f} tok/s"
            + ("" if r.result.token_ids == reference else " DIFFERS") for r in row), flush=True)
        return reference

    if args.set == "mt_bench2":
        rows = read_jsonl(data_dir() / "mt_bench" / "question.jsonl")
        by_text = {row["turns"][0]: row for row in rows}
        firsts = round_robin([(row["turns"][0], row["category"]) for row in rows])
        for text, _ in firsts[: args.limit]:
            turns = by_text[text]["turns"]
            messages = [{"role": "user", "content": turns[0]}]
            answer = run_all(EvalPrompt(args.set, "turn 1", turns[0]),
                             chat_ids(tokenizer, messages))
            messages += [{"role": "assistant",
                          "content": tokenizer.decode(answer, skip_special_tokens=True)},
                         {"role": "user", "content": turns[1]}]
            run_all(EvalPrompt(args.set, "turn 2", turns[1]), chat_ids(tokenizer, messages))
    else:
        rows = read_jsonl(data_dir() / "gsm8k" / "test.jsonl")[: args.limit]
        for row in rows:
            for category, text in (("original", row["question"]),
                                   ("variant", bump_first_number(row["question"]))):
                run_all(EvalPrompt(args.set, category, text), encode_prompt(tokenizer, text))

    methods = [label for label, _, _ in specs]
    meta = {
        "model": target.name, "methods": methods, "datasets": [args.set],
        "prompts": len(records) // len(runners), "max_new_tokens": args.max_new_tokens,
        "sampling": "greedy", "threads": torch.get_num_threads(),
        "dtype": dtype_name(target.dtype),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__, "datastore": str(args.datastore),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    report = build_report(records, methods, meta)
    write_report(report, records, args.out)
    print("\n".join(markdown_table(report["methods"])))
    cpu_table = cpu_speedups(records, cpu_seconds, methods)
    (args.out / "cpu_time.md").write_text("\n".join(cpu_table) + "\n")
    print("\n".join(cpu_table))


def cpu_speedups(records: list[BenchRecord], cpu_seconds: dict[tuple[str, int], float],
                 methods: list[str]) -> list[str]:
    """A markdown table: each method's tokens per CPU second over AR's, on all requests and
    per category."""
    groups = ["all", *sorted({r.prompt.category for r in records})]
    rate = {}
    for group in groups:
        for method in methods:
            mine = [r for r in records
                    if r.method == method and group in ("all", r.prompt.category)]
            rate[method, group] = (sum(len(r.result.token_ids) for r in mine)
                                   / sum(cpu_seconds[method, r.prompt_index] for r in mine))
    rows = ["| method | " + " | ".join(f"{g}: speedup by CPU time" for g in groups) + " |",
            "| --- |" + " ---: |" * len(groups)]
    for method in methods:
        rows.append(f"| {method} | " + " | ".join(
            f"{rate[method, g] / rate[AR, g]:.2f}x" for g in groups) + " |")
    return rows


if __name__ == "__main__":
    main()
