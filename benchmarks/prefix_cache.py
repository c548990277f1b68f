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

`--peer-command` adds another OpenAI-compatible server to the same waves, in turn with the two
(e.g. llama.cpp's `llama-server` with `cache_prompt` on, its default: `bash
benchmarks/peers/servers_prefix.sh`): the command, `{port}` in it replaced by a free port, is
started here on 127.0.0.1 and restarted before each round after the first, since a server of
another make may have no way to empty its caches (llama-server's slot erase needs
`--slot-save-path` and leaves its RAM prompt cache). Its requests carry `--peer-body` (default
`{"temperature": 0}`: greedy, as dresd is by default); its second turns follow its own answers;
its outputs are compared with dresd's but need not equal them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import serve_load
from serve_load import percentile
from transformers import AutoTokenizer

from dresd.datasets import data_dir
from dresd.host import cpu_model
from dresd.models.target import default_model_dir
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


def stream_chat(client: openai.OpenAI, messages: list[dict], max_tokens: int,
                extra: dict | None = None) -> dict:
    """`serve_load.stream_chat` to the default model, with the chat's last message."""
    return {"question": messages[-1]["content"],
            **serve_load.stream_chat(client, MODEL, messages, max_tokens, extra)}


def wave(client: openai.OpenAI, chats: list[list[dict]], max_tokens: int,
         concurrency: int | None = None, extra: dict | None = None) -> dict:
    """All chats at once, one client each (or `concurrency` at a time); their records and the
    wave's figures."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency or len(chats)) as pool:
        records = list(pool.map(lambda chat: stream_chat(client, chat, max_tokens, extra),
                                chats))
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


class PeerServer(LocalServer):
    """Another make of server (--peer-command), started and stopped as LocalServer does dresd
    serve: `{port}` in the command is replaced by the port LocalServer picked."""

    def __init__(self, command: str, startup_timeout: float = 300.0) -> None:
        super().__init__([], startup_timeout)
        self.command = command

    def start(self) -> PeerServer:
        argv = [part.replace("{port}", str(self.port)) for part in shlex.split(self.command)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        return self


def peer_lines(report: dict, present: list[str]) -> list[str]:
    """The peer (--peer-command) against dresd with its cache, wave by wave: medians over
    rounds of each round's ratio, as for cache on against off."""
    peer = report.get("peer")
    if not peer:
        return []
    lines = ["", f"`{peer['name']}`: `{peer['command']}`, requests with "
             f"`{json.dumps(peer['body'])}`, restarted before each round after the first. Its "
             f"outputs equal to dresd's (cache off): {peer['same_as_dresd'][0]} of "
             f"{peer['same_as_dresd'][1]} (another runtime: not expected to be all).", ""]
    for wave_name in present:
        ours, theirs = (report["servers"][name][wave_name] for name in (NAMES[1], peer["name"]))
        ttft = [b["ttft_p50_s"] / a["ttft_p50_s"] for a, b in zip(ours, theirs, strict=True)]
        speed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs, strict=True)]
        lines.append(f"- {wave_name} wave, dresd cache on against {peer['name']}, the median "
                     f"over rounds: TTFT p50 {median(ttft):.2f}x lower (rounds "
                     f"{min(ttft):.2f}-{max(ttft):.2f}x), tokens/s {median(speed):.2f}x (rounds "
                     f"{min(speed):.2f}-{max(speed):.2f}x)")
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Prefix cache under load ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"CPU: {meta['cpu']} ({meta['cores']} cores; load average before and after the "
             f"run: {', '.join(f'{x:.2f}' for x in meta.get('load_average', []))}), "
             f"{meta['threads']} threads per server (`--threads`); model {MODEL} in "
             f"{meta['dtype']}, method {meta['method']}; waves of {meta['clients']} concurrent "
             f"streaming clients, {meta['max_tokens']} tokens each; system prompt "
             f"{meta['system_tokens']} tokens; second turns: {meta['multi_turn']}; "
             f"{meta['rounds']} rounds, medians over them "
             "(each round's figures in prefix_cache.json).", "",
             "| server | wave | TTFT p50 (s) | TTFT p99 (s) | tokens/s | prompt tokens "
             "read from the cache |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    present = [w for w in WAVES if report["servers"][NAMES[0]][w]]
    for name in report["servers"]:  # cache off, cache on, then the peer where there is one
        for wave_name in present:
            runs = report["servers"][name][wave_name]
            lines.append(
                f"| {name} | {wave_name} | {median([r['ttft_p50_s'] for r in runs]):.2f} | "
                f"{median([r['ttft_p99_s'] for r in runs]):.2f} | "
                f"{median([r['tokens_per_s'] for r in runs]):.1f} | "
                f"{runs[0]['cached_tokens']} of {runs[0]['prompt_tokens']} |")
    lines += ["", f"Every output identical with and without the cache: "
              f"{report['identical']} ({report['compared']} outputs compared).", ""]
    for wave_name in present:
        off, on = (report["servers"][name][wave_name] for name in NAMES)
        ttft = median([a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(off, on, strict=True)])
        speed = median([b["tokens_per_s"] / a["tokens_per_s"]
                        for a, b in zip(off, on, strict=True)])
        spread = sorted(a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in zip(off, on, strict=True))
        lines.append(f"- {wave_name} wave, the median over rounds of each round's ratio: TTFT "
                     f"p50 {ttft:.1f}x lower with the cache (rounds {spread[0]:.1f}-"
                     f"{spread[-1]:.1f}x), tokens/s {speed:.2f}x")
    lines += peer_lines(report, present)
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


ROUTINGS = ("power-of-two", "prefix")
REPLICA_WAVES = ("system prompt", "first turn", "second turn")


def replicas_run(args, system: str, tokenizer) -> int:
    """`--replicas R`: the cache on, `dresd serve --ray --replicas R` with Ray Serve's default
    router and with conversation affinity, one server after the other (each its own local Ray).
    Each round: CLIENTS shared-system-prompt questions, then CLIENTS MT-Bench first turns and
    their second turns; every round new questions, so no round finds another's entries (the
    replicas' caches are not emptied between rounds)."""
    per_round = args.clients
    chats = [shared_prompt(system, questions(per_round, skip=r * per_round))
             for r in range(args.rounds)]
    turns = [mt_bench((r + 1) * per_round)[r * per_round:] for r in range(args.rounds)]
    figures: dict[str, dict[str, list[dict]]] = {}
    load = [os.getloadavg()[0]]
    for routing in ROUTINGS:
        server = LocalServer(["--threads", str(args.threads), "--dtype", args.dtype,
                              "--method", args.method, "--max-batch-size", str(args.clients),
                              "--max-new-tokens", str(args.max_tokens), "--ray",
                              "--replicas", str(args.replicas), "--replica-routing", routing,
                              "--log-level", "warning"], startup_timeout=900)
        figures[routing] = {w: [] for w in REPLICA_WAVES}
        try:
            server.start().wait_ready()
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                   timeout=1800)
            seen: set[str] = set()  # every replica answers once before the clock starts
            for index in range(200):
                seen.add(stream_chat(client, [{"role": "user", "content": f"Hi {index}."}],
                                     2)["replica"])
                if len(seen) == args.replicas:
                    break
            for round_ in range(args.rounds):
                runs = figures[routing]
                runs["system prompt"].append(wave(client, chats[round_], args.max_tokens))
                report_wave(round_, "system prompt", routing, runs["system prompt"][-1])
                first = wave(client, [[{"role": "user", "content": t[0]}] for t in turns[round_]],
                             args.max_tokens)
                runs["first turn"].append(first)
                second = [[{"role": "user", "content": t[0]},
                           {"role": "assistant", "content": record["text"]},
                           {"role": "user", "content": t[1]}]
                          for t, record in zip(turns[round_], first["records"], strict=True)]
                runs["second turn"].append(wave(client, second, args.max_tokens))
                report_wave(round_, "second turn", routing, runs["second turn"][-1])
        finally:
            server.stop()
        load.append(os.getloadavg()[0])
    texts = {r: [rec["text"] for w in REPLICA_WAVES for run in figures[r][w]
                 for rec in run["records"]] for r in ROUTINGS}
    identical = texts[ROUTINGS[0]] == texts[ROUTINGS[1]]
    # each conversation's two turns: on one replica or not
    for routing in ROUTINGS:
        runs = figures[routing]
        runs["same replica"] = sum(
            a["replica"] == b["replica"]
            for first, second in zip(runs["first turn"], runs["second turn"], strict=True)
            for a, b in zip(first["records"], second["records"], strict=True))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = {"meta": {"date": now, "command": "PYTHONPATH=src:benchmarks .venv/bin/python "
                       f"benchmarks/prefix_cache.py --replicas {args.replicas} --threads "
                       f"{args.threads} --clients {args.clients} --max-tokens {args.max_tokens} "
                       f"--rounds {args.rounds} --method {args.method} --out {args.out}",
                       "cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
                       "replicas": args.replicas, "dtype": args.dtype, "method": args.method,
                       "clients": args.clients, "max_tokens": args.max_tokens,
                       "rounds": args.rounds, "system_tokens": len(tokenizer.encode(system)),
                       "load_average": load},
              "servers": figures, "identical": identical, "compared": len(texts[ROUTINGS[0]])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache_replicas.json").write_text(json.dumps(report, indent=1))
    text = replicas_markdown(report)
    (args.out / "README.md").write_text(text)
    print(text)
    return 0 if identical else 1


def replicas_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Prefix cache across replicas ({meta['date']})", "",
             f"`{meta['command']}`", "",
             f"CPU: {meta['cpu']} ({meta['cores']} cores), {meta['replicas']} replicas of "
             f"{meta['threads']} thread(s) on a local Ray; load average before, between and "
             f"after: {', '.join(f'{x:.2f}' for x in meta['load_average'])}. Model {MODEL} in "
             f"{meta['dtype']}, method {meta['method']}, the prefix cache on; each round: "
             f"{meta['clients']} concurrent streaming chats with a {meta['system_tokens']}-token "
             f"system prompt and distinct GSM8K questions, then {meta['clients']} MT-Bench first "
             f"turns and their second turns (sent with the server's own answer); "
             f"{meta['max_tokens']} tokens each; {meta['rounds']} rounds, new questions each "
             f"round; medians over rounds (each round in prefix_cache_replicas.json).", "",
             "| routing | wave | prompt tokens read from the cache (hit rate) | requests per "
             "replica | TTFT p50 (s) | tokens/s |", "| --- | --- | ---: | --- | ---: | ---: |"]
    for routing in ROUTINGS:
        for wave_name in REPLICA_WAVES:
            runs = report["servers"][routing][wave_name]
            cached = sum(r["cached_tokens"] for r in runs)
            prompt = sum(r["prompt_tokens"] for r in runs)
            spread: dict[str, int] = {}
            for run in runs:
                for record in run["records"]:
                    spread[record["replica"]] = spread.get(record["replica"], 0) + 1
            lines.append(
                f"| {routing} | {wave_name} | {cached} of {prompt} ({cached / prompt:.0%}) | "
                f"{' / '.join(str(n) for n in sorted(spread.values(), reverse=True))} | "
                f"{median([r['ttft_p50_s'] for r in runs]):.2f} | "
                f"{median([r['tokens_per_s'] for r in runs]):.1f} |")
    total = report["meta"]["clients"] * report["meta"]["rounds"]
    lines += ["", "Conversations whose two turns reached the same replica: " + ", ".join(
        f"{routing} {report['servers'][routing]['same replica']} of {total}"
        for routing in ROUTINGS) + ".", "",
        f"Every output identical under both routings: {report['identical']} "
        f"({report['compared']} outputs compared)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="pld")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--multi-turn-only", action="store_true",
                        help="only the MT-Bench workload (no shared-system-prompt waves)")
    parser.add_argument("--turn-concurrency", type=int, default=None,
                        help="MT-Bench chats sent this many at a time (default: --clients, all "
                             "at once); 1: each alone, its TTFT its own prefill")
    parser.add_argument("--replicas", type=int, default=0,
                        help="R > 0: `--ray --replicas R`, Ray Serve's default routing against "
                             "conversation affinity, the cache on in both (replicas_run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/prefix_cache, with --replicas "
                             "benchmarks/results/prefix_cache_replicas")
    parser.add_argument("--peer-command", default=None,
                        help="another server in the same waves, e.g. 'llama-server -m F.gguf "
                             "--host 127.0.0.1 --port {port} -np 16 ...' ({port}: a free port)")
    parser.add_argument("--peer-name", default="llama-server")
    parser.add_argument("--peer-body", default='{"temperature": 0}',
                        help="JSON fields of every request to the peer")
    args = parser.parse_args()
    args.out = args.out or Path("benchmarks/results/prefix_cache"
                                + ("_replicas" if args.replicas else ""))
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    system = system_prompt(tokenizer, args.system_tokens)
    if args.replicas:
        return replicas_run(args, system, tokenizer)
    load = [os.getloadavg()[0]]
    waves = {"cold": shared_prompt(system, questions(args.clients)),
             "warm": shared_prompt(system, questions(args.clients, skip=args.clients))}
    if args.multi_turn_only:
        waves = {}
    turns = mt_bench(args.clients)
    common = ["--threads", str(args.threads), "--dtype", args.dtype, "--method", args.method,
              "--max-batch-size", str(args.clients), "--max-new-tokens", str(args.max_tokens)]
    servers = {NAMES[0]: LocalServer([*common, "--no-prefix-cache"]),
               NAMES[1]: LocalServer(common)}
    bodies: dict[str, dict | None] = {name: None for name in servers}
    if args.peer_command:
        servers[args.peer_name] = PeerServer(args.peer_command)
        bodies[args.peer_name] = json.loads(args.peer_body)
    names = list(servers)
    figures: dict[str, dict[str, list[dict]]] = {n: {w: [] for w in WAVES} for n in names}
    try:
        clients = {}
        for name, server in servers.items():
            server.start().wait_ready()
            clients[name] = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                          max_retries=0, timeout=1800)
            stream_chat(clients[name], [{"role": "user", "content": "Say hello."}], 4,
                        bodies[name])
        for round_ in range(args.rounds):
            reset(servers[NAMES[1]].url)
            if args.peer_command and round_:  # its way to empty its caches: a fresh process
                servers[args.peer_name].stop()
                servers[args.peer_name].start().wait_ready()
                stream_chat(clients[args.peer_name], [{"role": "user", "content": "Say hello."}],
                            4, bodies[args.peer_name])
            # who goes first rotates by round (with two servers: alternates)
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for wave_name, chats in waves.items():
                for name in order:
                    figures[name][wave_name].append(wave(clients[name], chats, args.max_tokens,
                                                         extra=bodies[name]))
                    report_wave(round_, wave_name, name, figures[name][wave_name][-1])
            for name in order:  # each server's second turns follow its own first answers
                first = wave(clients[name], [[{"role": "user", "content": t[0]}] for t in turns],
                             args.max_tokens, args.turn_concurrency, bodies[name])
                figures[name]["first turn"] = [*figures[name].get("first turn", []), first]
                second = [[{"role": "user", "content": t[0]},
                           {"role": "assistant", "content": record["text"]},
                           {"role": "user", "content": t[1]}]
                          for t, record in zip(turns, first["records"], strict=True)]
                figures[name]["second turn"].append(wave(clients[name], second, args.max_tokens,
                                                         args.turn_concurrency, bodies[name]))
                report_wave(round_, "second turn", name, figures[name]["second turn"][-1])
    finally:
        for server in servers.values():
            server.stop()
    texts = {name: [r["text"] for w in (*WAVES, "first turn") for run in figures[name][w]
                    for r in run["records"]] for name in names}
    identical = texts[NAMES[0]] == texts[NAMES[1]]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = {"meta": {"date": now,
                       "command": "PYTHONPATH=src:benchmarks .venv/bin/python "
                                  f"benchmarks/prefix_cache.py --threads {args.threads} "
                                  f"--clients {args.clients} --max-tokens {args.max_tokens} "
                                  f"--rounds {args.rounds} --method {args.method}"
                                  + (" --multi-turn-only" if args.multi_turn_only else "")
                                  + (f" --turn-concurrency {args.turn_concurrency}"
                                     if args.turn_concurrency else "")
                                  + (f" --peer-command {shlex.quote(args.peer_command)}"
                                     if args.peer_command else "")
                                  + f" --out {args.out}",
                       "cpu": cpu_model(), "machine": platform.machine(),
                       "cores": os.cpu_count(), "threads": args.threads, "dtype": args.dtype,
                       "method": args.method, "clients": args.clients,
                       "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "system_tokens": len(tokenizer.encode(system)),
                       "multi_turn": f"MT-Bench questions 1-{args.clients}, both turns, "
                                     f"{args.turn_concurrency or args.clients} at a time",
                       "load_average": [*load, os.getloadavg()[0]]},
              "servers": figures, "identical": identical, "compared": len(texts[NAMES[0]])}
    if args.peer_command:
        theirs = texts[args.peer_name]
        report["peer"] = {"name": args.peer_name, "command": args.peer_command,
                          "body": bodies[args.peer_name],
                          "same_as_dresd": [sum(a == b for a, b in zip(theirs, texts[NAMES[0]],
                                                                      strict=True)),
                                            len(theirs)]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(report, indent=1))
    (args.out / "README.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
