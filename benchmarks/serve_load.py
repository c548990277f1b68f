"""Load benchmark of `dresd serve`: many concurrent streaming clients on 127.0.0.1.

Starts a server (the default model, one PyTorch thread unless told otherwise), then:

1. sequential AR: every prompt once with `method: ar` (plain decoding), one request at a
   time: the single-stream baseline every ratio is over;
2. sequential: every prompt once with METHOD, one request at a time; these outputs are the
   reference, and their speed is what one client alone gets;
3. concurrent: CLIENTS threads, each streaming its share of ROUNDS x the prompts with the
   official `openai` client, all at once (the server batches them: continuous batching).

Every concurrent response must be complete (a finish_reason) and equal to the sequential
output of its prompt (greedy). Reported, client-side: time to first token (request sent ->
first non-empty content chunk), end-to-end latency, tokens/s per request and for the whole run
(completion tokens / wall seconds), the concurrent throughput over single-stream AR's, and
the server's own /metrics figures (mean batch size among them). Methods that learn from
finished outputs (suffix, hybrid) see the prompts again in phases 2 and 3, as a server that
gets repeated questions does.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py --clients 16 --rounds 2 \
        --max-tokens 64 --out benchmarks/results/serve

Traffic goes to 127.0.0.1 only; the run is bounded (prompts x rounds requests) and stops by
itself, the server with it.

`--url` drives a server already running instead (any OpenAI-compatible one, e.g. llama.cpp's
`llama-server`, started and stopped by the caller: `benchmarks/peers/servers.sh`): no `method`
field is sent, phase 1 is skipped, and /metrics is read only where it answers in dresd's names.
`--temperature` and `--extra-body` add fields to every request (by default none are sent).
`--prompt-set gsm8k` sends the first 16 short GSM8K test questions (the shared data folder)
instead of the questions written here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from dresd.datasets import data_dir
from dresd.host import cpu_model
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


def gsm8k_prompts(count: int) -> list[str]:
    """The first `count` GSM8K test questions under 160 characters: real user questions, short
    enough that the answer, not the prompt, is most of each request's work."""
    rows = (json.loads(line) for line in
            (data_dir() / "gsm8k" / "test.jsonl").read_text().splitlines() if line.strip())
    return [row["question"] for row in rows if len(row["question"]) < 160][:count]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stream_chat(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int,
                extra: dict | None = None) -> dict:
    """One streamed chat completion, timed from the client's side, with the replica that
    answered (`x-dresd-replica`, "-" from a server without replicas). Completion tokens from
    the usage chunk, else from llama.cpp's `timings` (its server reports them there)."""
    started = time.perf_counter()
    first = None
    pieces, finish, usage, predicted = [], None, None, 0
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra) as response:
        replica = response.headers.get("x-dresd-replica", "-")
        for chunk in response.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            timings = (chunk.model_extra or {}).get("timings")
            if usage is None and isinstance(timings, dict) and "predicted_n" in timings:
                predicted = int(timings["predicted_n"])
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first if first is not None else time.perf_counter() - started
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    seconds = time.perf_counter() - started
    tokens = usage.completion_tokens if usage else predicted
    details = usage.prompt_tokens_details if usage else None
    return {"text": "".join(pieces), "finish_reason": finish,
            "ttft_s": first, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else None,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": (details.cached_tokens or 0) if details else 0, "replica": replica}


def stream_one(client: openai.OpenAI, model: str, prompt: str, max_tokens: int,
               extra: dict | None = None) -> dict:
    """`stream_chat` of one user message, with the prompt in the record."""
    return {"prompt": prompt, **stream_chat(client, model, [{"role": "user", "content": prompt}],
                                            max_tokens, extra)}


def server_metrics(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:  # another server (--url) may have no /metrics
        return {}
    wanted = ["spec_decode_mean_acceptance_length", "spec_decode_draft_acceptance_rate",
              "avg_generation_throughput_toks_per_s", "generation_tokens_total",
              "mean_batch_size"]
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
        # prompt tokens the server read from its prefix cache (usage.prompt_tokens_details)
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in records),
        "cached_tokens": sum(r.get("cached_tokens", 0) for r in records),
    }


def markdown(report: dict) -> str:
    """benchmarks/results/serve.md: the figures of one run, as measured."""
    rows = []
    for phase in ("sequential_ar", "sequential", "concurrent"):
        if phase not in report:
            continue
        f = report[phase]
        clients = 1 if phase.startswith("sequential") else report["clients"]
        rows.append(f"| {phase} | {clients} | {f['requests']} | {f['completion_tokens']} | "
                    f"{f['ttft_p50_s']:.2f} | {f['ttft_p99_s']:.2f} | {f['latency_p50_s']:.2f} | "
                    f"{f['latency_p99_s']:.2f} | {f['tokens_per_s']:.1f} | "
                    f"{f['request_tokens_per_s_p50']:.1f} |")
    m = report["server_metrics"]
    same = "all identical" if report["identical_to_sequential"] else (
        f"{len(report['mismatches'])} differ")
    load = report.get("load_average")
    return "\n\n".join(textwrap.fill(block, 100) if block[0].isalpha() else block for block in [
        f"# `{report.get('server', 'dresd serve')}` under load",
        f"Measured {report['date']} on {report['machine']}, shared with other jobs (load "
        f"average {load[0]:.1f} before the run, {load[1]:.1f} after), {report['model']}, method "
        f"`{report['method']}`, greedy, max_tokens {report['max_tokens']}, the server in "
        f"{report.get('dtype', 'float32')} with {report['threads']} PyTorch thread(s), the "
        "clients on the same machine (127.0.0.1) "
        "using the official `openai` client, streaming. Produced by",
        "    PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py "
        f"--clients {report['clients']} --rounds {report['rounds']} "
        f"--max-tokens {report['max_tokens']} --threads {report['threads']} "
        f"--dtype {report.get('dtype', 'float32')}"
        + (f" --method {report['method']}" if report.get("server_args") is not None else "")
        + (f" --server-args '{report['server_args']}'" if report.get("server_args") else "")
        + (" --reset-prefix-cache" if report.get("reset_prefix_cache") else ""),
        f"Sequential: the {report['prompts']} prompts one at a time. Concurrent: "
        f"{report['clients']} clients at once, each prompt {report['rounds']} times. "
        f"Concurrent outputs against sequential ones: {same}; incomplete responses: "
        f"{len(report['incomplete'])}. Concurrent throughput over single-stream AR's: "
        f"{report.get('concurrent_over_sequential_ar', float('nan')):.2f}x; CPU: "
        f"{report.get('cpu', 'unknown')}.",
        "\n".join([
            "| phase | clients | requests | tokens | TTFT p50 s | TTFT p99 s | latency p50 s | "
            "latency p99 s | tokens/s (run) | tokens/s per request p50 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows]),
        "Prompt tokens read from the prefix cache: " + "; ".join(
            f"{phase} {report[phase].get('cached_tokens', 0)} of "
            f"{report[phase].get('prompt_tokens', 0)}"
            for phase in ("sequential_ar", "sequential", "concurrent") if phase in report)
        + (" (the cache emptied before each phase)" if report.get("reset_prefix_cache")
           else "") + f"; server options: `{report.get('server_args') or '(none)'}`.",
        "TTFT: request sent to the first non-empty content chunk. tokens/s (run): completion "
        "tokens / wall seconds of the phase. sequential_ar: the same prompts with method ar "
        "(plain decoding), one at a time. The server batches concurrent requests (up to "
        "--max-batch-size, one forward per step for all of them).",
        "Server's /metrics at the end: mean acceptance length "
        f"{m.get('spec_decode_mean_acceptance_length', float('nan')):.2f}, draft acceptance "
        f"rate {m.get('spec_decode_draft_acceptance_rate', float('nan')):.1%}, generation "
        f"{m.get('avg_generation_throughput_toks_per_s', float('nan')):.1f} tokens/s "
        f"({m.get('generation_tokens_total', 0):.0f} tokens, warm-up included), mean batch "
        f"size {m.get('mean_batch_size', float('nan')):.1f} requests per forward.",
    ]) + "\n"


class ExternalServer:
    """A server someone else started (--url): entered and left as LocalServer is, stopping
    nothing; it has no log of ours to read."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __enter__(self) -> ExternalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def log(self) -> str:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="each prompt is sent this often")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the server's PyTorch threads")
    parser.add_argument("--method", default="pld")
    parser.add_argument("--dtype", default="auto", help="the server's --dtype")
    parser.add_argument("--server-args", default="", help="more `dresd serve` options")
    parser.add_argument("--reset-prefix-cache", action="store_true",
                        help="empty the server's prefix cache before each phase, so that the "
                             "concurrent phase does not start with the prompts the sequential "
                             "ones left cached")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve"),
                        help="writes OUT.json and OUT.md")
    parser.add_argument("--render", action="store_true",
                        help="only write OUT.md again from OUT.json")
    parser.add_argument("--url", default=None,
                        help="drive the OpenAI-compatible server already running at URL "
                             "(e.g. llama-server) instead of starting dresd serve; no method "
                             "field is sent and the sequential AR phase is skipped")
    parser.add_argument("--server-name", default=None,
                        help="the server's name in the report (default: dresd serve)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sent in every request (default: none sent, the server's own)")
    parser.add_argument("--extra-body", default="{}",
                        help="JSON object of more fields for every request")
    parser.add_argument("--prompt-set", choices=("builtin", "gsm8k"), default="builtin",
                        help="builtin: the 16 questions written here; gsm8k: 16 short GSM8K "
                             "test questions")
    args = parser.parse_args()
    prompts = PROMPTS if args.prompt_set == "builtin" else gsm8k_prompts(len(PROMPTS))
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(report))
        return 0

    server_args = ["--threads", str(args.threads), "--method", args.method, "--dtype", args.dtype,
                   "--max-queue", str(max(64, args.clients * 2)), "--log-level", "warning",
                   *args.server_args.split()]
    load_before = os.getloadavg()[0]
    extra: dict = json.loads(args.extra_body)
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    with ExternalServer(args.url) if args.url else LocalServer(server_args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        stream_one(client, model, "Hello.", 4, extra)  # warm-up, not counted

        def reset() -> None:
            if args.reset_prefix_cache:
                request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"",
                                                 method="POST")
                with urllib.request.urlopen(request, timeout=60) as reply:
                    reply.read()

        sequential_ar, sequential_ar_wall = None, None
        if not args.url:
            reset()
            started = time.perf_counter()
            sequential_ar = [stream_one(client, model, p, args.max_tokens,
                                        {**extra, "method": "ar"}) for p in prompts]
            sequential_ar_wall = time.perf_counter() - started
        reset()
        started = time.perf_counter()
        sequential = [stream_one(client, model, p, args.max_tokens, extra) for p in prompts]
        sequential_wall = time.perf_counter() - started
        reference = {r["prompt"]: r["text"] for r in sequential}

        work = prompts * args.rounds
        reset()
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            concurrent = list(pool.map(
                lambda p: stream_one(client, model, p, args.max_tokens, extra), work))
        concurrent_wall = time.perf_counter() - started
        figures = server_metrics(server.url)
        chosen = re.search(r"dresd: dtype (\S+)", server.log())  # the server says what auto chose

    mismatches = [r["prompt"] for r in concurrent if r["text"] != reference[r["prompt"]]]
    incomplete = [r["prompt"] for r in concurrent if r["finish_reason"] is None]
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": model, "method": args.method if not args.url else "(the server's own)",
        "threads": args.threads,
        "dtype": chosen.group(1) if chosen else args.dtype,
        "clients": args.clients, "max_tokens": args.max_tokens, "prompts": len(prompts),
        "prompt_set": args.prompt_set,
        "rounds": args.rounds,
        "server": args.server_name or ("dresd serve" if not args.url else args.url),
        "request_fields": extra,
        "sequential": summarize_phase(sequential, sequential_wall),
        "concurrent": summarize_phase(concurrent, concurrent_wall),
        "cpu": cpu_model(),
        "identical_to_sequential": not mismatches, "mismatches": mismatches,
        "incomplete": incomplete,
        "server_metrics": figures,
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, before and after
        "server_args": args.server_args, "reset_prefix_cache": args.reset_prefix_cache,
    }
    report["sequential_outputs"] = [r["text"] for r in sequential]  # in prompts' order
    if sequential_ar is not None:
        report["sequential_ar"] = summarize_phase(sequential_ar, sequential_ar_wall)
        report["sequential_ar_outputs"] = [r["text"] for r in sequential_ar]
        report["concurrent_over_sequential_ar"] = (report["concurrent"]["tokens_per_s"]
                                                   / report["sequential_ar"]["tokens_per_s"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps({k: report.get(k) for k in ("sequential_ar", "sequential", "concurrent",
                                                  "concurrent_over_sequential_ar",
                                                  "identical_to_sequential")}, indent=2))
    return 0 if not mismatches and not incomplete else 1


if __name__ == "__main__":
    raise SystemExit(main())
