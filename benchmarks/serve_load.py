"""Load benchmark of `dresd serve`: many concurrent streaming clients on 127.0.0.1.

Starts a server (the default model, one PyTorch thread unless told otherwise), then:

1. sequential: every prompt once, one request at a time; these outputs are the reference, and
   their speed is what one client alone gets;
2. concurrent: CLIENTS threads, each streaming its share of ROUNDS x the prompts with the
   official `openai` client, all at once.

Every concurrent response must be complete (a finish_reason) and equal to the sequential
output of its prompt (greedy). Reported, client-side: time to first token (request sent ->
first non-empty content chunk), end-to-end latency, tokens/s per request and for the whole run
(completion tokens / wall seconds), and the server's own /metrics figures. The server runs one
generation at a time (requests queue), so under load TTFT is mostly waiting in the queue.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py --clients 16 --rounds 2 \
        --max-tokens 64 --out benchmarks/results/serve

Traffic goes to 127.0.0.1 only; the run is bounded (prompts x rounds requests) and stops by
itself, the server with it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from dresd.serve.local import LocalServer

# GSM8K-like questions, written here so the benchmark needs no data files.
PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France? Answer in one sentence.",
    "Sara reads 12 pages a day. How many pages does she read in a week?",
    "List three primary colours.",
    "Explain what a prime number is in two sentences.",
    "A shirt costs $20 and is 25% off. What is the sale price?",
    "Write a haiku about the sea.",
    "How many minutes are there in 4 hours?",
    "Give two tips for staying focused while studying.",
    "If a rectangle is 7 cm by 4 cm, what is its area?",
    "Translate 'good morning' into Spanish.",
    "What is 15 times 12?",
    "Name three planets in the solar system.",
    "Describe a cat in one sentence.",
]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stream_one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int,
               extra: dict) -> dict:
    """One streamed chat completion, timed from the client's side."""
    started = time.perf_counter()
    first = None
    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - started
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    seconds = time.perf_counter() - started
    tokens = usage.completion_tokens if usage else 0
    return {"prompt": prompt, "text": "".join(pieces), "finish_reason": finish,
            "ttft_s": first, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None}


def server_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = ["spec_decode_mean_acceptance_length", "spec_decode_draft_acceptance_rate",
              "avg_generation_throughput_toks_per_s", "generation_tokens_total"]
    found = {}
    for name in wanted:
        match = re.search(rf"^dresd:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        if match:
            found[name] = float(match.group(1))
    return found


def summarize_phase(records: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    latency = [r["seconds"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "completion_tokens": tokens,
        "wall_s": wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
        "tokens_per_s": tokens / wall,  # the whole run: completion tokens / wall seconds
        "request_tokens_per_s_p50": percentile([r["tokens_per_s"] for r in records], 50),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="each prompt is sent this often")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the server's PyTorch threads")
    parser.add_argument("--method", default="pld")
    parser.add_argument("--server-args", default="", help="more `dresd serve` options")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve"))
    args = parser.parse_args()

    server_args = ["--threads", str(args.threads), "--method", args.method,
                   "--max-queue", str(max(64, args.clients * 2)), "--log-level", "warning",
                   *args.server_args.split()]
    with LocalServer(server_args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        extra: dict = {}
        stream_one(client, model, "Hello.", 4, extra)  # warm-up, not counted

        started = time.perf_counter()
        sequential = [stream_one(client, model, p, args.max_tokens, extra) for p in PROMPTS]
        sequential_wall = time.perf_counter() - started
        reference = {r["prompt"]: r["text"] for r in sequential}

        work = PROMPTS * args.rounds
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            concurrent = list(pool.map(
                lambda p: stream_one(client, model, p, args.max_tokens, extra), work))
        concurrent_wall = time.perf_counter() - started
        figures = server_metrics(server.url)

    mismatches = [r["prompt"] for r in concurrent if r["text"] != reference[r["prompt"]]]
    incomplete = [r["prompt"] for r in concurrent if r["finish_reason"] is None]
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model, "method": args.method, "threads": args.threads,
        "clients": args.clients, "max_tokens": args.max_tokens, "prompts": len(PROMPTS),
        "rounds": args.rounds,
        "sequential": summarize_phase(sequential, sequential_wall),
        "concurrent": summarize_phase(concurrent, concurrent_wall),
        "identical_to_sequential": not mismatches, "mismatches": mismatches,
        "incomplete": incomplete,
        "server_metrics": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("sequential", "concurrent",
                                              "identical_to_sequential")}, indent=2))
    return 0 if not mismatches and not incomplete else 1


if __name__ == "__main__":
    raise SystemExit(main())
