"""Replicas x clients of `dresd serve`: one process, and `--ray --replicas R` on a local Ray.

For each server configuration (plain single process; Ray Serve with 1 and 2 replicas, each
`--threads` PyTorch threads), the same prompts are sent by 1 client after another and by C
clients at once (the official `openai` client, streaming, greedy). Reported per cell:
completion tokens / wall seconds, TTFT and latency p50, and which replicas answered; per
configuration the resident memory of each server process (model, drafters, Python) and its
start-up time. Every output must equal the plain server's with one client.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_replicas.py --out \
        benchmarks/results/serve_replicas

Traffic goes to 127.0.0.1 only; each server is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from serve_load import PROMPTS, percentile, stream_one

from dresd.serve.local import LocalServer

REPLICA_PROCESS = "ServeReplica:dresd:DresdServer"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes (and their threads) have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def server_processes(server: LocalServer) -> list[int]:
    """The processes holding a model: the Ray Serve replicas, or the plain server itself."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if REPLICA_PROCESS in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found or [server.process.pid]


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run_config(replicas: int, clients_list: list[int], prompts: list[str], args) -> dict:
    server_args = ["--threads", str(args.threads), "--method", args.method, "--dtype", args.dtype,
                   "--log-level", "warning"]
    if replicas:
        server_args += ["--ray", "--replicas", str(replicas)]
    started = time.perf_counter()
    with LocalServer(server_args, startup_timeout=600) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        # Every replica answers once before the clock starts (Ray Serve is up when /health
        # answers from one replica; the others may still be loading).
        seen: set[str] = set()
        deadline = time.monotonic() + 600
        while len(seen) < max(1, replicas) and time.monotonic() < deadline:
            seen.add(stream_one(client, model, "Hello.", 2)["replica"])
        startup_s = time.perf_counter() - started
        processes = server_processes(server)
        rss = [round(rss_mb(pid)) for pid in processes]
        cells = []
        for clients in clients_list:
            began, cpu_before = time.perf_counter(), cpu_seconds(processes)
            with ThreadPoolExecutor(clients) as pool:
                records = list(pool.map(
                    lambda p: stream_one(client, model, p, args.max_tokens), prompts))
            wall = time.perf_counter() - began
            server_cpu_s = cpu_seconds(processes) - cpu_before
            tokens = sum(r["tokens"] for r in records)
            cells.append({
                "clients": clients, "requests": len(records), "tokens": tokens, "wall_s": wall,
                "tokens_per_s": tokens / wall,
                # the model's processes only (not Ray's proxy nor the clients): robust to the
                # other jobs on a shared machine, which take wall time but not these seconds
                "server_cpu_s": server_cpu_s, "tokens_per_server_cpu_s": tokens / server_cpu_s,
                "ttft_p50_s": percentile([r["ttft_s"] for r in records if r["ttft_s"]], 50),
                "latency_p50_s": percentile([r["seconds"] for r in records], 50),
                "replicas_answering": len({r["replica"] for r in records}),
                "incomplete": sum(r["finish_reason"] is None for r in records),
                "texts": {r["prompt"]: r["text"] for r in records},
            })
    return {"replicas": replicas, "startup_s": startup_s, "rss_mb": rss, "cells": cells}


def markdown(report: dict) -> str:
    rows = []
    for config in report["configs"]:
        name = (f"Ray Serve, {config['replicas']} replica(s)" if config["replicas"]
                else "single process")
        for cell in config["cells"]:
            rows.append(f"| {name} | {cell['clients']} | {cell['requests']} | {cell['tokens']} | "
                        f"{cell['wall_s']:.1f} | **{cell['tokens_per_s']:.1f}** | "
                        f"{cell['ttft_p50_s']:.2f} | {cell['latency_p50_s']:.2f} | "
                        f"{cell['server_cpu_s']:.1f} | {cell['tokens_per_server_cpu_s']:.1f} | "
                        f"{cell['replicas_answering']} |")
    memory = "; ".join(
        f"{'Ray ' + str(c['replicas']) if c['replicas'] else 'single'}: "
        f"{', '.join(str(m) for m in c['rss_mb'])} MB, ready in {c['startup_s']:.0f} s"
        for c in report["configs"])
    return "\n".join([
        "| server | clients | requests | tokens | wall s | tokens/s | TTFT p50 s | "
        "latency p50 s | model processes' CPU s | tokens / CPU s | replicas answering |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows,
        "",
        f"Resident memory per server process, and start-up to every replica answering: "
        f"{memory}. Outputs equal to the single process with one client: "
        f"{report['identical']}; incomplete responses: {report['incomplete']}.",
    ]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="0,1,2",
                        help="server configurations: 0 = single process, R = Ray Serve with R")
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--method", default="pld")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_replicas"))
    args = parser.parse_args()
    prompts = PROMPTS[:args.prompts]
    clients = [int(c) for c in args.clients.split(",")]
    load_before = os.getloadavg()[0]
    configs = [run_config(int(r), clients, prompts, args) for r in args.replicas.split(",")]
    reference = configs[0]["cells"][0]["texts"]
    differing = sum(text != reference[prompt] for config in configs for cell in config["cells"]
                    for prompt, text in cell["texts"].items())
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(), "cores": os.cpu_count(), "threads": args.threads,
        "method": args.method, "dtype": args.dtype, "max_tokens": args.max_tokens,
        "prompts": len(prompts), "load_average": [load_before, os.getloadavg()[0]],
        "commit": subprocess.run(["git", "describe", "--always", "--dirty"],
                                 capture_output=True, text=True).stdout.strip(),
        "configs": configs,
        "identical": "all" if not differing else f"{differing} differ",
        "incomplete": sum(cell["incomplete"] for c in configs for cell in c["cells"]),
    }
    for config in configs:  # the outputs were compared above; the record keeps the figures
        for cell in config["cells"]:
            del cell["texts"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0 if not differing and not report["incomplete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
