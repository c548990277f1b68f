"""`dresd bench --concurrency 1,4,16,32`: every method under load, as a server would carry it.

At each concurrency c, each method runs all the prompts through one batched loop, c of them
generating at once (the rest queue and join as others finish: c clients that each send their
next prompt when the last one is answered). Methods take turns at each level, so drift on a
noisy machine hits all of them alike; with `rounds` > 1 each level runs every method that many
times in turn (A B C, A B C, ...) and a row sums them. Every level runs the same prompts, so each
timed run starts from a drafter that has learned nothing (`MethodRunner.forget`): a method that
learns finished outputs (suffix, hybrid) would otherwise draft a level's answers from the
answers it gave the same prompts earlier, a repeated workload. Per method and level:

- tokens_per_s = all new tokens / wall-clock seconds, over its runs (aggregate throughput);
- speedup = tokens_per_s / AR's tokens_per_s at the same concurrency (the same run);
  speedup_min, speedup_max = the lowest and highest of the per-round ratios (each over AR's
  run in the same round): the machine's noise, seen beside the ratio;
- ttft_p50, ttft_p99 = percentiles of the time from submission to a request's first token
  (prefill, and the wait for a slot), over every request of its runs;
- latency_p50, latency_p99 = percentiles of the time from submission to its last token;
- identical = outputs equal to AR's single-stream output (the lowest level, first round);
  near_tie, unexplained = the others, told apart by the rule in decoding/verify.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dresd.decoding.verify import classify_divergence
from dresd.metrics import GenerationResult
from dresd.runner import AR, MethodRunner

Run = tuple[list[GenerationResult], float]  # one timed run: its results, its seconds


def run_concurrency(runners: list[MethodRunner], prompt_ids: list[list[int]],
                    levels: list[int], rounds: int = 1, progress: bool = True) -> list[dict]:
    """One row per (level, method), in the order run; AR must be among the runners."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    rows, reference = [], None
    bar = tqdm(total=len(levels) * rounds * len(runners), disable=not progress,
               desc="concurrency")
    for runner in runners:  # warm-up, untimed
        runner.generate_many([ids[:64] for ids in prompt_ids[:2]], 2)
    for level in sorted(levels):
        runs: dict[str, list[Run]] = {}
        for _ in range(rounds):
            for runner in runners:
                bar.set_postfix_str(f"c={level} {runner.label}")
                runner.forget()
                started = time.perf_counter()
                results = runner.generate_many(prompt_ids, level)
                seconds = time.perf_counter() - started
                runs.setdefault(runner.label, []).append((results, seconds))
                if runner.method == AR and reference is None:
                    reference = results
                bar.update()
        ar_runs = next(runs[r.label] for r in runners if r.method == AR)
        for runner in runners:
            rows.append(_row(runner, level, runs[runner.label], ar_runs, reference))
    bar.close()
    return rows


def _tokens_per_s(results: list[GenerationResult], seconds: float) -> float:
    return sum(len(r.token_ids) for r in results) / seconds


def _pooled(runs: list[Run]) -> Run:
    """Several runs as one: all their results, all their seconds."""
    return [result for results, _ in runs for result in results], sum(s for _, s in runs)


def _row(runner: MethodRunner, level: int, runs: list[Run], ar_runs: list[Run],
         reference: list[GenerationResult] | None) -> dict:
    results, seconds = _pooled(runs)
    tokens = sum(len(r.token_ids) for r in results)
    forwards = sum(r.num_target_forwards for r in results)
    ratios = [_tokens_per_s(*mine) / _tokens_per_s(*ar)
              for mine, ar in zip(runs, ar_runs, strict=True)]
    verdicts = {"identical": 0, "near_tie": 0, "unexplained": 0}
    if reference is not None and runner.settings.sampling is None:
        dtype = runner.target.dtype
        for run, _ in runs:
            for result, ref in zip(run, reference, strict=True):
                verdicts[classify_divergence(result.token_ids, ref.token_ids,
                                             ref.top2_logits or [], dtype)] += 1
    ttft = [r.prefill_seconds for r in results]
    latency = [r.total_seconds for r in results]
    return {
        "method": runner.label, "concurrency": level, "rounds": len(runs),
        "num_prompts": len(runs[0][0]), "num_outputs": len(results),
        "num_new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "speedup": tokens / seconds / _tokens_per_s(*_pooled(ar_runs)),
        "speedup_min": min(ratios), "speedup_max": max(ratios),
        "mean_accepted_length": tokens / forwards if forwards else None,
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "latency_p50": float(np.percentile(latency, 50)),
        "latency_p99": float(np.percentile(latency, 99)),
        **verdicts,
    }


def concurrency_table(rows: list[dict]) -> list[str]:
    lines = ["| concurrency | method | tokens/s | speedup (rounds: lowest - highest) | "
             "accepted length | TTFT p50 / p99 s | latency p50 / p99 s | identical |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        length = row["mean_accepted_length"]
        spread = (f" ({row['speedup_min']:.2f} - {row['speedup_max']:.2f})"
                  if row["rounds"] > 1 else "")
        lines.append(
            f"| {row['concurrency']} | {row['method']} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x{spread} | {length:.2f} | "
            f"{row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | "
            f"{row['latency_p50']:.2f} / {row['latency_p99']:.2f} | "
            f"{row['identical']}/{row['num_outputs']} |")
    return lines


def write_concurrency(rows: list[dict], meta: dict, out: Path) -> None:
    """concurrency.json, concurrency.md and concurrency.png (tokens/s against concurrency)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    header = [f"# dresd bench --concurrency: {meta['model']}", "",
              f"{meta['cpu']}, {meta['threads']} thread(s), {meta['dtype']}, "
              f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens, "
              f"{rows[0]['rounds'] if rows else 1} round(s) per level", ""]
    (out / "concurrency.md").write_text("\n".join(header + concurrency_table(rows)) + "\n")
    import matplotlib  # as report.py: loaded only where a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        ax.plot([r["concurrency"] for r in mine], [r["tokens_per_s"] for r in mine],
                marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    plt.close(fig)
