"""The table of `servers.sh`: llama-server against dresd serve, from serve_load.py's reports.

Reads RUNS/r<repeat>-<server>.json (one `serve_load.py --url` report per server and repeat)
and writes OUT.md (the table) and OUT.jsonl (one line per server: the figures averaged over
the repeats, each repeat's too). Ratios are over `dresd serve --method ar` with 1 client in
the same repeat, then averaged; "outputs equal to dresd ar": each server's sequential (1
client) outputs against dresd ar's, as text (informative for llama.cpp: another runtime,
which rounds differently at near-ties; must be all for dresd's methods).

    PYTHONPATH=src .venv/bin/python benchmarks/peers/servers_table.py --runs runs/peers/servers \
        --out benchmarks/results/peers/servers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
from collections import defaultdict
from pathlib import Path

from dresd.host import cpu_flags, cpu_model

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
         "amx_bf16", "amx_int8")
AR = "dresd serve --method ar"


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{mean(values):.1f} ± {(max(values) - min(values)) / 2:.1f}"


def llama_version(build: Path) -> str:
    try:
        done = subprocess.run([str(build / "bin" / "llama-server"), "--version"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    match = re.search(r"version: (.+)", done.stdout + done.stderr)
    return match.group(1).strip() if match else "?"


def dresd_dtype(runs: Path) -> str:
    for log in sorted(runs.glob("dresd-*.log")):
        match = re.search(r"dresd: dtype (\S+)", log.read_text(errors="replace"))
        if match:
            return match.group(1)
    return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--datastore", default="none")
    parser.add_argument("--build", type=Path, default=Path("."))
    parser.add_argument("--command-line", default="")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    reports: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in sorted(args.runs.glob("r*-*.json")):
        repeat = int(path.name[1:].split("-", 1)[0])
        report = json.loads(path.read_text())
        reports[report["server"]][repeat] = report
    if AR not in reports:
        raise SystemExit(f"no `{AR}` report in {args.runs}")
    reference = reports[AR][min(reports[AR])]["sequential_outputs"]
    order = ["llama-server", AR, "dresd serve --method hybrid"]
    servers = sorted(reports, key=lambda s: order.index(s) if s in order else len(order))

    rows, figures = [], []
    dtype = dresd_dtype(args.runs)
    for server in servers:
        runs = reports[server]
        seq = [r["sequential"]["tokens_per_s"] for r in runs.values()]
        con = [r["concurrent"]["tokens_per_s"] for r in runs.values()]
        over_ar = [r["sequential"]["tokens_per_s"] / reports[AR][k]["sequential"]["tokens_per_s"]
                   for k, r in runs.items() if k in reports[AR]]
        con_over_ar = [r["concurrent"]["tokens_per_s"]
                       / reports[AR][k]["sequential"]["tokens_per_s"]
                       for k, r in runs.items() if k in reports[AR]]
        first = runs[min(runs)]
        same = sum(a == b for a, b in zip(first["sequential_outputs"], reference, strict=False))
        identical = sum(r["identical_to_sequential"] for r in runs.values())
        mismatched = max(len(r["mismatches"]) for r in runs.values())
        incomplete = max(len(r["incomplete"]) for r in runs.values())
        weights = "bf16 GGUF" if server == "llama-server" else dtype
        figures.append({
            "server": server, "weights": weights, "threads": first["threads"],
            "clients": first["clients"], "max_tokens": first["max_tokens"],
            "prompts": first["prompts"], "rounds": first["rounds"], "repeats": len(runs),
            "sequential_tokens_per_s": mean(seq), "sequential_rounds": seq,
            "concurrent_tokens_per_s": mean(con), "concurrent_rounds": con,
            "sequential_over_dresd_ar": mean(over_ar),
            "concurrent_over_dresd_ar_sequential": mean(con_over_ar),
            "ttft_p50_s": first["concurrent"]["ttft_p50_s"],
            "ttft_p99_s": first["concurrent"]["ttft_p99_s"],
            "latency_p50_s": first["concurrent"]["latency_p50_s"],
            "latency_p99_s": first["concurrent"]["latency_p99_s"],
            "sequential_ttft_p50_s": first["sequential"]["ttft_p50_s"],
            "outputs_equal_to_dresd_ar": [same, len(reference)],
            "concurrent_identical_to_sequential_repeats": [identical, len(runs)],
            "concurrent_mismatches_max": mismatched, "incomplete_max": incomplete,
            "request_fields": first.get("request_fields"),
            "server_metrics": first.get("server_metrics")})
        f = figures[-1]
        agree = ("all" if identical == len(runs) else
                 f"{mismatched} of {first['prompts'] * first['rounds']} differ")
        rows.append(
            f"| `{server}` | {weights} | {spread(seq)} | {f['sequential_over_dresd_ar']:.2f}x | "
            f"{f['sequential_ttft_p50_s']:.2f} | {spread(con)} | "
            f"{f['concurrent_over_dresd_ar_sequential']:.2f}x | "
            f"{f['ttft_p50_s']:.2f} / {f['ttft_p99_s']:.2f} | "
            f"{f['latency_p50_s']:.2f} / {f['latency_p99_s']:.2f} | {agree} | "
            f"{same}/{len(reference)} |")

    sample = reports[AR][min(reports[AR])]
    flags = [flag for flag in FLAGS if flag in cpu_flags()]
    clients = sample["clients"]
    lines = [
        f"# llama-server beside dresd serve, 1 and {clients} streaming clients"
        f"{' (SMOKE RUN)' if args.smoke else ''}",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {cpu_model()} "
        f"({platform.machine()}, {os.cpu_count()} cores; flags: {', '.join(flags) or '-'}), "
        f"every server at {sample['threads']} thread(s) on 127.0.0.1, the clients on the same "
        f"machine (`benchmarks/serve_load.py --url`, the official `openai` client, streaming). "
        f"{len(reports[AR])} repeat(s), the servers in turn (tokens/s: the mean ± half the "
        "range; ratios: over `dresd serve --method ar` with 1 client in the same repeat). "
        "Produced by `bash benchmarks/peers/servers.sh`"
        f"{' (' + args.command_line + ')' if args.command_line else ''}.",
        "",
        f"- Prompts: serve_load.py's {sample['prompts']} short questions, as chat messages; "
        f"greedy (`temperature: 0`), `max_tokens` {sample['max_tokens']}. 1 client: the "
        f"prompts one at a time; {clients} clients: each prompt {sample['rounds']} times, all "
        "clients at once (aggregate tokens/s = completion tokens / wall seconds).",
        f"- llama-server: llama.cpp {llama_version(args.build)} (llama-cpp-python 0.3.36's "
        f"vendored sources), `-np {clients} -t {sample['threads']} -tb {sample['threads']} "
        f"-c {clients * 1024}`, the bf16 GGUF converted from the default model, its chat "
        "template from the GGUF (the model's own), `cache_prompt: false` in every request; "
        "completion tokens from its `timings` where no usage chunk comes. **Not like for "
        "like**: llama.cpp's sampler and kernels (its bf16 batched forward is not "
        "batch-invariant: concurrent outputs may differ from sequential ones).",
        f"- dresd serve: {dtype}, `--max-batch-size {clients}`, a fresh process per method; "
        f"hybrid's datastore: {args.datastore if args.datastore != 'none' else 'none'}; "
        "hybrid's suffix source learns from finished outputs, and the concurrent phase sends "
        "prompts it has seen (as a server with repeated questions gets them).",
        "",
        f"| server | weights | 1 client tokens/s | x dresd ar | TTFT p50 s | {clients} clients "
        f"tokens/s | x dresd ar (1 client) | TTFT p50 / p99 s | latency p50 / p99 s | "
        f"concurrent = sequential | outputs = dresd ar |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    with open(args.out.with_suffix(".jsonl"), "w") as f:
        for entry in figures:
            f.write(json.dumps(entry) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
