"""Time to first token, as a user times it: `dresd generate` against llama.cpp's
`llama-completion` on the same GGUF file, one new token after a short prompt, the whole process
from start to exit, the file's pages evicted from the page cache before each cold run.

    python benchmarks/peers/load_time.py --llama-completion BIN --threads 1 FILE.gguf ...

For each file: dresd runs once untimed first (its first load of a file saves the file's
tokenizer and config to its cache, and compiles the kernels on a fresh machine: timed apart as
`first`), then ROUNDS rounds of, per engine, a cold run (the file's pages dropped with
posix_fadvise after an fsync; `fincore` shows how much stayed) and a warm run (right after).
Prints a markdown table (medians, with each ratio's per-round range) and writes the runs as
JSON lines to --out. Each engine runs as its users run it by default (llama.cpp's one warm-up
decode at load included), but for llama.cpp's context: `-c 4096`, since by default it sizes its
KV cache for the file's whole context (128k tokens for Llama 3.2: 14 GB, 45 s to allocate here);
dresd grows its cache with the sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DRESD = Path(sys.executable).with_name("dresd")


def evict(path: Path) -> None:
    """The file's pages out of the page cache (clean pages: written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_share(path: Path) -> float:
    """The share of the file's pages in the page cache (`fincore`), or NaN without it."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0]) / path.stat().st_size
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return float("nan")


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def commands(file: Path, llama_completion: Path, threads: int) -> dict[str, list[str]]:
    return {
        "llama.cpp": [str(llama_completion), "-m", str(file), "-p", "Hello", "-n", "1",
                      "-t", str(threads), "-c", "4096", "-no-cnv"],
        "dresd": [str(DRESD), "generate", "--model", str(file), "--method", "ar",
                  "--prompt", "Hello", "--max-new-tokens", "1", "--threads", str(threads),
                  "--no-chat-template"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-completion", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("load_time.jsonl"))
    args = parser.parse_args()
    runs = []
    with args.out.open("w") as out:
        for file in args.files:
            engines = commands(file, args.llama_completion, args.threads)
            evict(file)
            first = {"file": file.name, "engine": "dresd", "kind": "first",
                     "seconds": seconds(engines["dresd"])}
            runs.append(first)
            out.write(json.dumps(first) + "\n")
            for round_number in range(1, args.rounds + 1):
                for engine, command in engines.items():
                    evict(file)
                    cached = cached_share(file)
                    for kind in ("cold", "warm"):
                        run = {"file": file.name, "engine": engine, "kind": kind,
                               "round": round_number, "threads": args.threads,
                               "bytes": file.stat().st_size, "seconds": seconds(command)}
                        if kind == "cold":
                            run["cached_before"] = cached
                        runs.append(run)
                        out.write(json.dumps(run) + "\n")
                        out.flush()
    print(table(runs, args.threads))


def table(runs: list[dict], threads: int) -> str:
    lines = ["| file | size | dresd first load | cold: llama.cpp | cold: dresd | dresd / "
             "llama.cpp (range) | warm: llama.cpp | warm: dresd | dresd / llama.cpp (range) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for file in dict.fromkeys(run["file"] for run in runs):
        mine = [run for run in runs if run["file"] == file]
        first = next(run["seconds"] for run in mine if run["kind"] == "first")
        size = next(run["bytes"] for run in mine if "bytes" in run)
        cells = [file, f"{size / 1e9:.2f} GB", f"{first:.1f} s"]
        for kind in ("cold", "warm"):
            by_round: dict[int, dict[str, float]] = {}
            for run in mine:
                if run["kind"] == kind:
                    by_round.setdefault(run["round"], {})[run["engine"]] = run["seconds"]
            theirs = statistics.median(r["llama.cpp"] for r in by_round.values())
            ours = statistics.median(r["dresd"] for r in by_round.values())
            ratios = [r["dresd"] / r["llama.cpp"] for r in by_round.values()]
            cells += [f"{theirs:.2f} s", f"{ours:.2f} s",
                      f"{ours / theirs:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return (f"Seconds from start to exit for one new token after a one-word prompt, {threads} "
            "thread(s), medians of the rounds\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
