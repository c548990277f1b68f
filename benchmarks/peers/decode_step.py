"""dresd's plain decoding measured as llama.cpp's `llama-bench` measures tg128, and the table.

    PYTHONPATH=src python benchmarks/peers/decode_step.py --threads 1 --round 1
    PYTHONPATH=src python benchmarks/peers/decode_step.py --summarize results.jsonl
    PYTHONPATH=src python benchmarks/peers/decode_step.py --model FILE.gguf --runner NAME ...
    PYTHONPATH=src python benchmarks/peers/decode_step.py --summarize-files results.jsonl

Measuring: the default model as `dresd generate` loads it (bf16 where the CPU multiplies it
natively), plain decoding through dresd's loop of 128 tokens after a one-token prompt (llama-bench
tg128 generates 128 tokens after an empty prompt), 5 timed repetitions after one untimed;
tokens/s = 128 / seconds of each repetition; one JSON line with their mean and deviation, in
llama-bench's field names (`n_threads`, `avg_ts`, `stddev_ts`).

Summarizing: llama-bench's and these lines (llama_cpp.sh interleaves them) as a markdown table
per thread count, the mean of the rounds, and dresd over llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from dresd.decoding.batch import BatchEngine, Request
from dresd.drafters import NoDrafter
from dresd.host import cpu_flags, cpu_model
from dresd.models.target import load_target

TOKENS = 128
REPETITIONS = 5


def measure(threads: int, round_number: int, model: str = "default",
            runner: str = "dresd", tokens: int = TOKENS, repetitions: int = REPETITIONS) -> dict:
    torch.set_num_threads(threads)
    target = load_target(model)
    engine = BatchEngine(target.model, max_batch_size=1)
    speeds = []
    for repetition in range(repetitions + 1):
        state = engine.add(Request(prompt=[1], drafter=NoDrafter(), max_new_tokens=tokens))
        started = time.perf_counter()
        engine.run()
        seconds = time.perf_counter() - started
        assert len(state.result.token_ids) == tokens
        if repetition:  # the first is a warm-up
            speeds.append(tokens / seconds)
    return {"runner": runner, "round": round_number, "n_threads": threads,
            "avg_ts": statistics.mean(speeds), "stddev_ts": statistics.stdev(speeds),
            "type_k": str(target.dtype), "linears": target.linears, "cpu_info": cpu_model(),
            "forward": ("C decoder" if getattr(engine.forward, "c_decoder", None) is not None
                        else type(engine.forward).__name__)}


def summarize(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    speeds: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        speeds[(row["runner"], int(row["n_threads"]))].append((row["avg_ts"], row["stddev_ts"]))
    llama = next((r for r in rows if r["runner"] == "llama.cpp"), {})
    bf16 = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in cpu_flags()]
    lines = [
        "# dresd beside llama.cpp: plain decoding, tg128",
        "",
        f"CPU: {cpu_model()} ({', '.join(bf16) or 'no native bf16'}); "
        f"llama.cpp {llama.get('build_commit', '?')} (llama-cpp-python 0.3.36's vendored "
        f"sources), bf16 GGUF converted from the default model; dresd in bf16, "
        f"{next((r.get('linears') for r in rows if r['runner'] == 'dresd'), '?')} linears, "
        f"forward: {next((r.get('forward') for r in rows if r['runner'] == 'dresd'), '?')}. "
        f"Produced by `bash benchmarks/peers/llama_cpp.sh`: each figure the mean of "
        f"{len({r['round'] for r in rows})} interleaved rounds of 5 repetitions (± the mean "
        "deviation within a round).",
        "",
        "| threads | llama.cpp tokens/s | dresd ar tokens/s | dresd / llama.cpp | "
        "llama.cpp on Q4_1 tokens/s (4-bit weights: not like for like) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]

    def mean(runner: str, threads: int) -> tuple[float, float] | None:
        """(mean tokens/s, mean deviation) over the rounds, or None if not measured."""
        measured = speeds.get((runner, threads))
        if not measured:
            return None
        return tuple(statistics.mean(column) for column in zip(*measured, strict=True))

    for threads in sorted({t for _, t in speeds}):
        theirs, mine = mean("llama.cpp", threads), mean("dresd", threads)
        if not theirs or not mine:
            continue
        quantized = mean("llama.cpp Q4_1", threads)
        lines.append(f"| {threads} | {theirs[0]:.1f} ± {theirs[1]:.1f} | "
                     f"{mine[0]:.1f} ± {mine[1]:.1f} | {mine[0] / theirs[0]:.2f} | "
                     + (f"{quantized[0]:.1f} ± {quantized[1]:.1f} |" if quantized else "- |"))
    return "\n".join(lines) + "\n"


def summarize_files(path: Path) -> str:
    """gguf_speed.sh's lines: per file and thread count, llama.cpp's and dresd's tokens/s on
    the same file (runners "llama.cpp FILE" and "dresd FILE"), the ratio, and its spread: the
    lowest and highest per-round ratio."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_round: dict[tuple[str, str, int], dict[int, float]] = defaultdict(dict)
    for row in rows:
        engine, _, name = row["runner"].partition(" ")
        by_round[(name, engine, int(row["n_threads"]))][row["round"]] = row["avg_ts"]
    llama = next((r for r in rows if r["runner"].startswith("llama.cpp")), {})
    tokens, reps = llama.get("n_gen", TOKENS), len(llama.get("samples_ts", [])) or REPETITIONS
    lines = [
        f"# dresd beside llama.cpp on the same GGUF files: plain decoding, tg{tokens}", "",
        f"CPU: {cpu_model()}; llama.cpp {llama.get('build_commit', '?')} (llama-cpp-python "
        f"0.3.36's vendored sources, `llama-bench -p 0 -n {tokens} -r {reps}`); dresd `ar` on "
        f"the same file, {tokens} tokens after a one-token prompt, {reps} repetitions after a "
        "warm-up. Rounds "
        f"interleaved: {len({r['round'] for r in rows})}. Made by "
        "`bash benchmarks/peers/gguf_speed.sh`.", "",
        "| file | threads | llama.cpp tokens/s | dresd ar tokens/s | dresd / llama.cpp "
        "(per-round range) |",
        "| --- | ---: | ---: | ---: | ---: |"]
    for name, threads in sorted({(n, t) for n, _, t in by_round}):
        theirs, mine = by_round.get((name, "llama.cpp", threads)), by_round.get(
            (name, "dresd", threads))
        if not theirs or not mine:
            continue
        rounds = sorted(set(theirs) & set(mine))
        ratios = [mine[r] / theirs[r] for r in rounds]
        lines.append(f"| {name} | {threads} | {statistics.mean(theirs.values()):.1f} | "
                     f"{statistics.mean(mine.values()):.1f} | "
                     f"{statistics.mean(mine.values()) / statistics.mean(theirs.values()):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--round", type=int, default=1)
    parser.add_argument("--model", default="default", help="default, a folder or FILE.gguf")
    parser.add_argument("--runner", default="dresd", help="the runner's name in the line")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens a repetition decodes")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument("--summarize", type=Path, default=None, metavar="JSONL")
    parser.add_argument("--summarize-files", type=Path, default=None, metavar="JSONL")
    args = parser.parse_args()
    if args.summarize is not None:
        print(summarize(args.summarize), end="")
        return
    if args.summarize_files is not None:
        print(summarize_files(args.summarize_files), end="")
        return
    print(json.dumps(measure(args.threads, args.round, args.model, args.runner, args.tokens,
                             args.repetitions)), flush=True)


if __name__ == "__main__":
    main()
