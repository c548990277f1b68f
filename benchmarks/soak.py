"""Soak test of `dresd serve`: good and fuzzed requests from many clients for a long while.

Starts a server on the default model (one PyTorch thread, `--method hybrid` unless told
otherwise), then:

1. reference: each good prompt once, alone, greedy: the output every later run must equal;
2. soak: CLIENTS threads for MINUTES, each sending, at random, a good request (a prompt of the
   set, greedy, streamed or whole, with a random method) or a fuzzed one (random JSON in every
   field the server knows, random types, out-of-range values, unknown fields), back to back.

Checked and reported: responses by status (a 5xx is a failure), every good output against its
reference, the server's resident memory (VmRSS) sampled every 10 s beside the prefix cache's
bytes (`dresd:prefix_cache_bytes`: it grows, by design, until `--prefix-cache-mb`), flat
within 5% of its value after the first minute (the warm-up's allocations) once the cache is
full, and that /health answers 200 at the end. Traffic goes to 127.0.0.1 only, and the run
stops by itself, the server with it.

    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --minutes 30 --clients 16 \
        --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

from dresd.host import cpu_model
from dresd.serve.local import LocalServer

PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France? Answer in one sentence.",
    "A shirt costs $20 and is 25% off. What is the sale price?",
    "Write a haiku about the sea.",
    "How many minutes are there in 4 hours?",
    "Name three planets in the solar system.",
    "Describe a cat in one sentence.",
]
METHODS = ["ar", "pld", "suffix", "hybrid"]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs",
          "top_logprobs", "stream", "method", "num_drafts", "max_tree_nodes", "cache_salt",
          "echo", "model", "messages", "prompt", "stream_options", "max_completion_tokens"]


def random_json(rng: random.Random, depth: int = 0):
    """Any JSON value: numbers at and past every range's edges, odd strings, nesting."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**64), 10**30])
    if kind == 3:
        return rng.choice([0.0, 1e-40, -1e-40, 1e-5, 0.5, 1.0, 2.0, 1e30, -3.5])
    if kind == 4:
        return rng.randint(-5, 300)
    if kind == 5:
        return "".join(rng.choice("ab \n\t\\\"{}<|>é🐉") for _ in range(rng.randint(0, 40)))
    if kind in (6, 7):
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS + ["x", "role", "content"]): random_json(rng, depth + 1)
            for _ in range(rng.randint(0, 4))}


def fuzzed_body(rng: random.Random) -> tuple[str, dict]:
    """A request that is mostly well formed, with a few fields set to anything."""
    chat = rng.random() < 0.5
    body: dict = ({"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]} if chat
                  else {"prompt": rng.choice(PROMPTS)})
    body["max_tokens"] = rng.randint(1, 48)
    for name in rng.sample(FIELDS, rng.randint(1, 4)):
        body[name] = random_json(rng)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def post(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read().decode("utf-8", "replace")
    finally:
        conn.close()


def good_text(port: int, prompt: str, method: str, stream: bool,
              max_tokens: int) -> tuple[int, str]:
    """A good request's status and completion text (a stream's pieces joined; a stream that
    carried an error event counts as a 500)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "method": method, "stream": stream}
    status, text = post(port, "/v1/chat/completions", body)
    if status != 200:
        return status, text[:300]
    if not stream:
        return status, json.loads(text)["choices"][0]["message"]["content"]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    if any("error" in event for event in events):
        return 500, text[-300:]
    return status, "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                           if e.get("choices"))


def cache_mb(port: int) -> float:
    """The server's prefix cache, in MB (its /metrics gauge)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith("dresd:prefix_cache_bytes"):
            return float(line.split()[-1]) / 2**20
    return 0.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--fuzz-share", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--prefix-cache-mb", type=float, default=256,
                        help="small enough to fill in the first minutes, so that what grows "
                             "after is not the cache (default 256)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    args = parser.parse_args()

    server = LocalServer(["--threads", str(args.threads), "--method", args.method,
                          "--dtype", "float32", "--max-queue", str(4 * args.clients),
                          "--prefix-cache-mb", str(args.prefix_cache_mb)])
    with server:
        port, pid = server.port, server.process.pid
        # 1. References, alone: greedy, so every method and every load gives the same text.
        references = {prompt: good_text(port, prompt, "ar", False, args.max_tokens)[1]
                      for prompt in PROMPTS}
        statuses: Counter[int] = Counter()
        mismatches: list[str] = []
        good_runs = Counter()
        memory: list[tuple[float, float]] = []
        lock = threading.Lock()
        started = time.monotonic()
        deadline = started + args.minutes * 60

        def client(seed: int) -> None:  # 2. the soak: good and fuzzed requests back to back
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                if rng.random() < args.fuzz_share:
                    path, body = fuzzed_body(rng)
                    status, _ = post(port, path, body)
                    with lock:
                        statuses[status] += 1
                    continue
                prompt, method = rng.choice(PROMPTS), rng.choice(METHODS)
                status, text = good_text(port, prompt, method, rng.random() < 0.5,
                                         args.max_tokens)
                with lock:
                    statuses[status] += 1
                    good_runs[method] += 1
                    if status != 200 or text != references[prompt]:
                        mismatches.append(f"{method} {prompt!r}: {status} {text!r}")

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(args.clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            memory.append((time.monotonic() - started, rss_mb(pid), cache_mb(port)))
            time.sleep(10)
        for thread in threads:
            thread.join()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        health = conn.getresponse().status
        conn.close()

    settled = [mb for at, mb, _ in memory if at >= 60] or [mb for _, mb, _ in memory]
    drift = (max(settled) - min(settled)) / min(settled)
    full = max(cache for _, _, cache in memory)  # after the cache has filled, RSS must be flat
    after_full = [mb for _, mb, cache in memory if cache >= 0.95 * full] or settled
    drift_after_full = (max(after_full) - min(after_full)) / min(after_full)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "threads": args.threads, "clients": args.clients,
        "minutes": args.minutes, "method": args.method, "fuzz_share": args.fuzz_share,
        "responses_by_status": dict(sorted(statuses.items())),
        "responses_5xx": sum(n for status, n in statuses.items() if status >= 500),
        "good_requests_by_method": dict(good_runs), "good_outputs_differing": len(mismatches),
        "mismatches": mismatches[:20],
        "prefix_cache_mb": args.prefix_cache_mb,
        "rss_mb_after_first_minute": {"min": min(settled), "max": max(settled),
                                      "drift": round(drift, 4)},
        "rss_mb_once_the_prefix_cache_is_full": {
            "samples": len(after_full), "min": min(after_full), "max": max(after_full),
            "drift": round(drift_after_full, 4)},
        "samples_seconds_rss_mb_prefix_cache_mb": [(round(at), round(mb, 1), round(cache, 1))
                                                   for at, mb, cache in memory],
        "health_at_end": health,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items()
                      if k != "samples_seconds_rss_mb_prefix_cache_mb"}, indent=1))


if __name__ == "__main__":
    main()
