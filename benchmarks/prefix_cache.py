"""The prefix cache under load: a shared system prompt and second chat turns, cache on vs off.

Starts `dresd serve` twice on the same model and options, one with `--no-prefix-cache` and one
with the cache (its default), both up for the whole run, and sends waves of CLIENTS concurrent
streaming chats (the official `openai` client) to each in turn, every chat the same
~1,000-token system prompt (worked GSM8K answers from the train split) followed by a distinct
short GSM8K test question. Each round:

- the cached server's cache is emptied (POST /reset_prefix_cache);
- a cold wave: CLIENTS questions; with the cache, the first request to be prefilled reads the
  system prompt and the others read only their question;
- a warm wave: CLIENTS other questions, the system prompt cached by the cold wave;
- multi-turn: CLIENTS MT-Bench questions' first turns, then their second turns sent with the
  history (the first turn and the server's own answer), as a chat client sends them.

Each wave goes to both servers, one after the other (which first alternates by round), so a
machine shared with other work disturbs both alike; the figures are medians over ROUNDS.
Every output of the cached server must equal, token for token (greedy: the text), the uncached
server's output for the same question; the run fails otherwise. Reported per server and wave:
time to first token (request sent -> first content chunk) p50 and p99, completion tokens / wall
seconds, and the prompt tokens read from the cache (usage.prompt_tokens_details); for the
multi-turn workload, those of the second turns.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/prefix_cache.py --threads 2 \
        --out benchmarks/results/prefix_cache

Traffic goes to 127.0.0.1 only; the run is bounded (ROUNDS x 2 waves x 2 servers x CLIENTS).
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
from serve_load import percentile
from transformers import AutoTokenizer

from dresd.datasets import data_dir
from dresd.host import cpu_model
from dresd.models import default_model_dir
from dresd.serve.local import LocalServer

MODEL = "SmolLM2-135M-Instruct"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def system_prompt(tokenizer, tokens: int) -> str:
    """A tutor's instructions and worked GSM8K train answers, about `tokens` tokens long."""
    text = ("You are a patient math tutor. Solve the student's problem step by step, like the "
            "worked examples below, and end with the final answer after '####'.\n\n")
    for row in read_jsonl(data_dir() / "gsm8k" / "train.jsonl"):
        answer = re.sub(r"<<[^>]*>>", "", row["answer"])
        example = f"Problem: {row['question']}\nSolution: {answer}\n\n"
        if len(tokenizer.encode(text + example)) > tokens:
            break
        text += example
    return text


def questions(count: int, skip: int = 0) -> list[str]:
    """`count` distinct short GSM8K test questions (under 160 characters), after `skip`."""
    short = [row["question"] for row in read_jsonl(data_dir() / "gsm8k" / "test.jsonl")
             if len(row["question"]) < 160]
    return short[skip:skip + count]


def mt_bench(count: int) -> list[list[str]]:
    """The two turns of the first `count` MT-Bench questions."""
    return [row["turns"][:2] for row in read_jsonl(data_dir() / "mt_bench" / "question.jsonl")
            ][:count]


def stream_chat(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> dict:
    started = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first if first is not None else time.perf_counter() - started
                pieces.append(choice.delta.content)
    details = usage.prompt_tokens_details
    return {"question": messages[-1]["content"], "text": "".join(pieces), "ttft_s": first,
            "seconds": time.perf_counter() - started, "tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else 0}


def wave(client: openai.OpenAI, chats: list[list[dict]], max_tokens: int) -> dict:
    """All chats at once, one client each; their records and the wave's figures."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(chats)) as pool:
        records = list(pool.map(lambda chat: stream_chat(client, chat, max_tokens), chats))
    wall = time.perf_counter() - started
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {"records": records, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "cached_tokens": sum(r["cached_tokens"] for r in records)}


def median(values: list[float]) -> float:
    return percentile(values, 50)


def reset(url: str) -> None:
    """Empty a server's prefix cache."""
    request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Prefix cache under load ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"CPU: {meta['cpu']} ({meta['cores']} cores, shared with other work during the "
             f"run), {meta['threads']} threads per server (`--threads`); model {MODEL} in "
             f"{meta['dtype']}, method {meta['method']}; waves of {meta['clients']} concurrent "
             f"streaming clients, {meta['max_tokens']} tokens each; system prompt "
             f"{meta['system_tokens']} tokens; second turns: {meta['multi_turn']}; "
             f"{meta['rounds']} rounds, medians over them "
             "(each round's figures in prefix_cache.json).", "",
             "| server | wave | TTFT p50 (s) | TTFT p99 (s) | tokens/s | prompt tokens "
             "read from the cache |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name in NAMES:
        for wave_name in WAVES:
            runs = report["servers"][name][wave_name]
            lines.append(
                f"| {name} | {wave_name} | {median([r['ttft_p50_s'] for r in runs]):.2f} | "
                f"{median([r['ttft_p99_s'] for r in runs]):.2f} | "
                f"{median([r['tokens_per_s'] for r in runs]):.1f} | "
                f"{runs[0]['cached_tokens']} of {runs[0]['prompt_tokens']} |")
    lines += ["", f"Every output identical with and without the cache: "
              f"{report['identical']} ({report['compared']} outputs compared).", ""]
    for wave_name in WAVES:
        off, on = (report["servers"][name][wave_name] for name in NAMES)
        ttft = median([a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(off, on, strict=True)])
        speed = median([b["tokens_per_s"] / a["tokens_per_s"]
                        for a, b in zip(off, on, strict=True)])
        lines.append(f"- {wave_name} wave, the median over rounds of each round's ratio: TTFT "
                     f"p50 {ttft:.1f}x lower with the cache, tokens/s {speed:.2f}x")
    return "\n".join(lines) + "\n"


NAMES = ("cache off", "cache on")
WAVES = ("cold", "warm", "second turn")


def shared_prompt(system: str, questions_: list[str]) -> list[list[dict]]:
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in questions_]


def report_wave(round_: int, wave_name: str, name: str, figures: dict) -> None:
    print(f"round {round_ + 1} {wave_name} {name}: TTFT p50 {figures['ttft_p50_s']:.2f} s, "
          f"{figures['tokens_per_s']:.1f} tokens/s, {figures['cached_tokens']} cached",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="pld")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache"))
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    system = system_prompt(tokenizer, args.system_tokens)
    waves = {"cold": shared_prompt(system, questions(args.clients)),
             "warm": shared_prompt(system, questions(args.clients, skip=args.clients))}
    turns = mt_bench(args.clients)
    common = ["--threads", str(args.threads), "--dtype", args.dtype, "--method", args.method,
              "--max-batch-size", str(args.clients), "--max-new-tokens", str(args.max_tokens)]
    servers = {NAMES[0]: LocalServer([*common, "--no-prefix-cache"]),
               NAMES[1]: LocalServer(common)}
    figures: dict[str, dict[str, list[dict]]] = {n: {w: [] for w in WAVES} for n in NAMES}
    try:
        clients = {}
        for name, server in servers.items():
            server.start().wait_ready()
            clients[name] = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                          max_retries=0, timeout=1800)
            stream_chat(clients[name], [{"role": "user", "content": "Say hello."}], 4)
        for round_ in range(args.rounds):
            reset(servers[NAMES[1]].url)
            order = NAMES if round_ % 2 == 0 else NAMES[::-1]
            for wave_name, chats in waves.items():
                for name in order:
                    figures[name][wave_name].append(wave(clients[name], chats, args.max_tokens))
                    report_wave(round_, wave_name, name, figures[name][wave_name][-1])
            for name in order:  # each server's second turns follow its own first answers
                first = wave(clients[name], [[{"role": "user", "content": t[0]}] for t in turns],
                             args.max_tokens)
                figures[name]["first turn"] = [*figures[name].get("first turn", []), first]
                second = [[{"role": "user", "content": t[0]},
                           {"role": "assistant", "content": record["text"]},
                           {"role": "user", "content": t[1]}]
                          for t, record in zip(turns, first["records"], strict=True)]
                figures[name]["second turn"].append(wave(clients[name], second, args.max_tokens))
                report_wave(round_, "second turn", name, figures[name]["second turn"][-1])
    finally:
        for server in servers.values():
            server.stop()
    texts = {name: [r["text"] for w in (*WAVES, "first turn") for run in figures[name][w]
                    for r in run["records"]] for name in NAMES}
    identical = texts[NAMES[0]] == texts[NAMES[1]]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = {"meta": {"date": now,
                       "command": "PYTHONPATH=src:benchmarks .venv/bin/python "
                                  f"benchmarks/prefix_cache.py --threads {args.threads} "
                                  f"--clients {args.clients} --max-tokens {args.max_tokens} "
                                  f"--rounds {args.rounds} --method {args.method}",
                       "cpu": cpu_model(), "machine": platform.machine(),
                       "cores": os.cpu_count(), "threads": args.threads, "dtype": args.dtype,
                       "method": args.method, "clients": args.clients,
                       "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "system_tokens": len(tokenizer.encode(system)),
                       "multi_turn": f"MT-Bench questions 1-{args.clients}, both turns"},
              "servers": figures, "identical": identical, "compared": len(texts[NAMES[0]])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(report, indent=1))
    (args.out / "README.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
