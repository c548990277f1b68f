"""A multi-turn tool-calling agent over a small SQLite database, against `dresd serve` (`ar`,
`hybrid`) and, where it is built, llama.cpp's `llama-server --jinja`, on the same GGUF file.

The agent is the loop every tool-calling client runs: send the conversation with the tools;
if the answer holds tool calls, run each against the database and send the results back as
`role: "tool"` messages; stop at an answer in text. Each task is two user turns (a question,
then a follow-up on the same data), so the second turn's prompt starts with the whole first
exchange: the prefix cache's case. The first request of each user turn asks for a call
(`tool_choice: "required"`: a 135M model rarely calls a tool on its own), later ones leave it
to the model (`"auto"`) and the last one allowed asks for text (`"none"`); one call a request
(`parallel_tool_calls: false`: given the choice, the default model calls tools until
`max_tokens`).

The tools: `read_table` (a table's rows as text, the table named from an enum) and `run_sql`
(one read-only query). Answers quote the rows they were given: the copying that prompt lookup
and suffix drafting are for.

Every server starts fresh for each round (empty caches and tables), and within a round the
servers take the tasks in turn, so all of them see the same machine at the same time. Greedy
(temperature 0), streamed. Reported per server: tokens/s as the agent times it (completion
tokens over the summed wall time of its requests, prefill included), time to first token,
and the ratio over `dresd ar` per round with its spread. `dresd hybrid`'s transcript (every
turn's text and calls) must be `dresd ar`'s, else the run fails; llama-server's is compared and
the result reported (its kernels, and its prompt for tools where the template has none, differ).

    PYTHONPATH=src .venv/bin/python benchmarks/agent_loop.py --rounds 2 \
        --llama-server ~/.cache/dresd/peers/llama.cpp-build/bin/llama-server \
        --out benchmarks/results/agent_loop
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from dresd.host import cpu_model
from dresd.models.target import ensure_default_gguf
from dresd.serve.local import LocalServer, free_port

TABLES = ["employees", "departments", "orders"]
TOOLS = [
    {"type": "function", "function": {
        "name": "read_table",
        "description": "Return every row of one table of the company database.",
        "parameters": {"type": "object", "properties": {
            "table": {"type": "string", "enum": TABLES}}, "required": ["table"]}}},
    {"type": "function", "function": {
        "name": "run_sql",
        "description": "Run one read-only SQLite query on the company database (tables: "
                       "employees(name, department, city, salary), departments(name, floor, "
                       "manager), orders(id, customer, employee, amount)) and return its rows.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]
SYSTEM = ("You are a data assistant for a small company. Use the tools to look at the database, "
          "then answer from the rows you were given, listing them.")
TASKS = [
    ("Who works in the Sales department?", "Which of them earns the most?"),
    ("List the departments and their managers.", "Which department is on the highest floor?"),
    ("Show me the orders handled by Alice Martin.", "What is the total amount of those orders?"),
    ("Which employees live in Lyon?", "List their salaries too."),
    ("What are the biggest orders?", "Which customers placed them?"),
    ("Who works in Engineering?", "Who of them lives in Paris?"),
]
FIRST_NAMES = ["Alice", "Bruno", "Chloe", "David", "Emma", "Farid", "Gina", "Hugo", "Ines",
               "Jules", "Karim", "Lea", "Marc", "Nora", "Omar", "Paula"]
LAST_NAMES = ["Martin", "Bernard", "Dubois", "Thomas", "Robert", "Petit", "Durand", "Leroy"]
MAX_CALLS_PER_TURN = 3


def make_database(path: Path) -> None:
    """A small company, the same rows every time (a seeded generator)."""
    rng = random.Random(0)
    departments = [("Sales", 2, "Alice Martin"), ("Engineering", 4, "Hugo Durand"),
                   ("Finance", 3, "Nora Petit"), ("Support", 1, "Omar Leroy")]
    employees = [(f"{first} {rng.choice(LAST_NAMES)}", rng.choice(departments)[0],
                  rng.choice(["Paris", "Lyon", "Lille", "Nantes"]),
                  rng.randrange(32_000, 90_000, 500)) for first in FIRST_NAMES]
    customers = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Vandelay"]
    orders = [(index + 1, rng.choice(customers), rng.choice(employees)[0],
               rng.randrange(200, 20_000, 50)) for index in range(24)]
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE departments (name TEXT, floor INTEGER, manager TEXT)")
        db.execute("CREATE TABLE employees (name TEXT, department TEXT, city TEXT, "
                   "salary INTEGER)")
        db.execute("CREATE TABLE orders (id INTEGER, customer TEXT, employee TEXT, "
                   "amount INTEGER)")
        db.executemany("INSERT INTO departments VALUES (?, ?, ?)", departments)
        db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?)", employees)
        db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", orders)


def run_tool(database: Path, name: str, arguments: str) -> str:
    """A tool's result as the model reads it; a bad call gets an error message, as agents do."""
    try:
        args = json.loads(arguments or "{}")
        if name == "read_table" and args.get("table") in TABLES:
            query = f"SELECT * FROM {args['table']}"
        elif name == "run_sql" and isinstance(args.get("query"), str):
            query = args["query"]
        else:
            return f"error: no tool {name} taking {arguments}"
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
            cursor = db.execute(query)
            header = ", ".join(column[0] for column in cursor.description or [])
            rows = ["; ".join(str(value) for value in row) for row in cursor.fetchmany(30)]
        return "\n".join([header, *rows]) if rows else f"{header}\n(no rows)"
    except (ValueError, sqlite3.Error) as error:
        return f"error: {error}"


def streamed_turn(client: openai.OpenAI, model: str, messages: list[dict], tool_choice: str,
                  max_tokens: int, extra_body: dict) -> dict:
    """One request, streamed: the text, the calls, the completion tokens, the wall time and
    the time to the first chunk that carries output."""
    started = time.perf_counter()
    first = None
    text, calls, usage = [], {}, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_body=extra_body)
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.content or delta.tool_calls) and first is None:
                first = time.perf_counter() - started
            text.append(delta.content or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function and call.function.name:
                    entry["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
    return {"text": "".join(text), "calls": [calls[i] for i in sorted(calls)],
            "completion_tokens": usage.completion_tokens if usage else 0,
            "seconds": time.perf_counter() - started, "ttft": first}


def run_task(client: openai.OpenAI, model: str, database: Path, task: tuple[str, ...],
             max_tokens: int, extra_body: dict) -> tuple[list[dict], list[dict]]:
    """The agent loop over a task's user turns: its transcript and its requests' timings."""
    messages = [{"role": "system", "content": SYSTEM}]
    transcript, requests = [], []
    for question in task:
        messages.append({"role": "user", "content": question})
        for calls_so_far in range(MAX_CALLS_PER_TURN + 1):
            tool_choice = ("required" if calls_so_far == 0 else
                           "none" if calls_so_far == MAX_CALLS_PER_TURN else "auto")
            turn = streamed_turn(client, model, messages, tool_choice, max_tokens, extra_body)
            requests.append({key: turn[key] for key in ("completion_tokens", "seconds", "ttft")})
            transcript.append({"text": turn["text"], "calls": turn["calls"]})
            if not turn["calls"]:
                messages.append({"role": "assistant", "content": turn["text"]})
                break
            calls = [(f"call_{len(requests)}_{i}", call) for i, call in enumerate(turn["calls"])]
            messages.append({"role": "assistant", "content": turn["text"] or None,
                             "tool_calls": [{"id": call_id, "type": "function",
                                             "function": call} for call_id, call in calls]})
            messages += [{"role": "tool", "tool_call_id": call_id,
                          "content": run_tool(database, call["name"], call["arguments"])}
                         for call_id, call in calls]
    return transcript, requests


class LlamaServer:
    """llama.cpp's server on 127.0.0.1 with the file's own chat template (`--jinja`)."""

    def __init__(self, binary: str, model: str, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log",
                                               delete=False)
        self.process = subprocess.Popen(
            [binary, "-m", model, "--jinja", "-np", "1", "-c", "8192", "-t", str(threads),
             "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port),
             "--no-webui"], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> LlamaServer:
        for _ in range(600):
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server did not get ready: see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_servers(args: argparse.Namespace) -> dict[str, object]:
    servers: dict[str, object] = {}
    for method in args.methods.split(","):
        servers[f"dresd {method}"] = LocalServer(
            ["--model", args.model, "--method", method, "--threads", str(args.threads),
             "--log-level", "warning"]).start()
    if args.llama_server:
        servers["llama-server"] = LlamaServer(args.llama_server, args.llama_model, args.threads)
    for server in servers.values():
        server.wait_ready()
    return servers


def summarize(runs: dict[str, list[dict]], rounds: int, baseline: str) -> dict:
    def speed(name: str, round_: int) -> float:
        rows = [r for r in runs[name] if r["round"] == round_]
        return sum(r["completion_tokens"] for r in rows) / sum(r["seconds"] for r in rows)

    summary = {}
    for name, rows in runs.items():
        ratios = [speed(name, r) / speed(baseline, r) for r in range(rounds)]
        ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
        summary[name] = {"tokens_per_s": [speed(name, r) for r in range(rounds)],
                         "ratio_over_" + baseline.replace(" ", "_"): ratios,
                         "ratio_mean": statistics.mean(ratios),
                         "ratio_spread": max(ratios) - min(ratios),
                         "ttft_median_s": statistics.median(ttfts) if ttfts else None,
                         "requests_per_round": len(rows) // rounds,
                         "completion_tokens_per_round": sum(r["completion_tokens"]
                                                            for r in rows) // rounds}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default-gguf",
                        help="what `dresd serve --model` loads (default: the default model's "
                             "own Q4_1 file, the file llama-server gets)")
    parser.add_argument("--methods", default="ar,hybrid")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (optional)")
    parser.add_argument("--llama-model", help="the GGUF file llama-server loads (default: the "
                                              "file `--model default-gguf` is)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=len(TASKS))
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_loop"))
    args = parser.parse_args()
    if args.llama_server and not args.llama_model:
        args.llama_model = str(ensure_default_gguf())

    database = Path(tempfile.mkdtemp(prefix="dresd-agent-")) / "company.db"
    make_database(database)
    tasks = TASKS[:args.tasks]
    names = [f"dresd {m}" for m in args.methods.split(",")] + (
        ["llama-server"] if args.llama_server else [])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    transcripts: dict[str, list] = {name: [] for name in names}
    for round_ in range(args.rounds):
        servers = start_servers(args)
        try:
            for index, task in enumerate(tasks):
                for name, server in servers.items():
                    extra = {"cache_prompt": True} if name == "llama-server" else {}
                    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                           timeout=600)
                    model = client.models.list().data[0].id  # the name it serves under
                    transcript, requests = run_task(client, model, database, task,
                                                    args.max_tokens, extra)
                    runs[name] += [{"round": round_, "task": index, **r} for r in requests]
                    if round_ == 0:
                        transcripts[name].append(transcript)
                    print(f"round {round_} task {index} {name}: {len(requests)} requests, "
                          f"{sum(r['completion_tokens'] for r in requests)} tokens, "
                          f"{sum(r['seconds'] for r in requests):.2f} s", file=sys.stderr)
        finally:
            for server in servers.values():
                server.stop()

    baseline = names[0]
    identical = {name: transcripts[name] == transcripts[baseline] for name in names}
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "model": args.model,
              "llama_model": args.llama_model, "tasks": len(tasks), "rounds": args.rounds,
              "max_tokens": args.max_tokens,
              "transcript_identical_to_" + baseline.replace(" ", "_"): identical,
              "summary": summarize(runs, args.rounds, baseline), "runs": runs,
              "transcripts": transcripts}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "transcripts")},
                     indent=1))
    dresd_names = [name for name in names if name.startswith("dresd")]
    if not all(identical[name] for name in dresd_names):
        sys.exit(f"a dresd transcript differs from {baseline}'s: see {args.out}/report.json")


if __name__ == "__main__":
    main()
