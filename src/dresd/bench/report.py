"""The bench report: `report.json` for scripts, `report.md` for people, PNG plots for eyes.

`report.json` holds, per method, overall, per dataset and per category (keys fixed so that
scripts can rely on them): `tokens_per_s`, `speedup`, `mean_accepted_length`,
`acceptance_rate`, `per_position_acceptance`, `drafted_tokens_per_step`, `draft_time_share`,
`identical_fraction`, `near_tie_divergences`, `unexplained_divergences`, and `num_prompts`,
`num_new_tokens`, `seconds`, `accepted_length_histogram`. `outputs.jsonl` holds every
generation's token ids, one per line.

- speedup = the method's tokens/s / AR's tokens/s over the same prompts (the same run);
- identical_fraction = prompts whose output equals AR's token for token / prompts (under greedy
  decoding it must be 1.0; under sampling it only says how often the samples coincide);
- near_tie_divergences, unexplained_divergences = greedy outputs that differ from AR's, at a
  near-tie of AR's logits or not (the rule in decoding/verify.py; in float32 both must be 0,
  in reduced precision only the first may be above 0);
- accepted_length_histogram[k] = verify steps that emitted k tokens (accepted + bonus).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import torch

from dresd.bench.runner import BenchRecord
from dresd.decoding.verify import classify_divergence
from dresd.metrics import GenerationResult, summarize
from dresd.runner import AR


def method_figures(records: list[BenchRecord], methods: list[str],
                   dtype: torch.dtype = torch.float32) -> dict[str, dict]:
    """The figures of each method over `records` (which cover the same prompts per method)."""
    by_method: dict[str, list[BenchRecord]] = defaultdict(list)
    for record in records:
        by_method[record.method].append(record)
    reference = {r.prompt_index: r.result for r in by_method.get(AR, [])}
    ar_speed = summarize(r.result for r in by_method[AR])["tokens_per_s"] if reference else None
    table = {}
    for method in methods:
        runs = by_method.get(method, [])
        if not runs:
            continue
        figures = summarize(r.result for r in runs)
        histogram = Counter(s.num_accepted + 1 for r in runs for s in r.result.steps)
        kinds = Counter(_divergence(r.result, reference.get(r.prompt_index), dtype)
                        for r in runs)
        speed = figures["tokens_per_s"]
        table[method] = {
            "num_prompts": len(runs),
            "num_new_tokens": figures["num_new_tokens"],
            "seconds": figures["seconds"],
            "tokens_per_s": speed,
            "speedup": speed / ar_speed if speed and ar_speed else None,
            "mean_accepted_length": figures["mean_accepted_length"],
            "acceptance_rate": figures["acceptance_rate"],
            "per_position_acceptance": figures["per_position_acceptance"],
            "drafted_tokens_per_step": figures["drafted_tokens_per_step"],
            "draft_time_share": figures["draft_time_share"],
            "identical_fraction": kinds["identical"] / len(runs) if reference else None,
            "near_tie_divergences": kinds["near_tie"] if reference else None,
            "unexplained_divergences": kinds["unexplained"] if reference else None,
            "accepted_length_histogram": {str(k): histogram[k] for k in sorted(histogram)},
        }
    return table


def _divergence(result: GenerationResult, reference: GenerationResult | None,
                dtype: torch.dtype) -> str | None:
    """`identical`, `near_tie` or `unexplained` (verify.classify_divergence); under sampling only
    `identical` or `sampled` (samples need not coincide), None without a reference."""
    if reference is None:
        return None
    if reference.top2_logits is None:  # sampled: no logits are kept, and none are needed
        return "identical" if result.token_ids == reference.token_ids else "sampled"
    return classify_divergence(result.token_ids, reference.token_ids, reference.top2_logits,
                               dtype)


def build_report(records: list[BenchRecord], methods: list[str], meta: dict) -> dict:
    datasets: dict[str, list[BenchRecord]] = defaultdict(list)
    categories: dict[str, dict[str, list[BenchRecord]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        datasets[record.prompt.dataset].append(record)
        categories[record.prompt.dataset][record.prompt.category].append(record)
    dtype = getattr(torch, meta.get("dtype", "float32"))
    return {
        "meta": meta,
        "methods": method_figures(records, methods, dtype),
        "datasets": {name: method_figures(rs, methods, dtype) for name, rs in datasets.items()},
        "categories": {
            name: {cat: method_figures(rs, methods, dtype) for cat, rs in cats.items()}
            for name, cats in categories.items()
        },
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def markdown_table(table: dict[str, dict]) -> list[str]:
    lines = ["| method | tokens/s | speedup | mean accepted length | acceptance rate | "
             "drafted/step | draft time | identical | near-tie / unexplained divergences |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, f in table.items():
        lines.append(
            f"| {method} | {_num(f['tokens_per_s'], '.1f')} | {_num(f['speedup'], '.2f', 'x')} "
            f"| {_num(f['mean_accepted_length'])} | {_pct(f['acceptance_rate'])} "
            f"| {_num(f['drafted_tokens_per_step'], '.1f')} | {_pct(f['draft_time_share'])} "
            f"| {_pct(f['identical_fraction'])} "
            f"| {_num(f['near_tie_divergences'], 'd')} "
            f"/ {_num(f['unexplained_divergences'], 'd')} |"
        )
    return lines


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# dresd bench: {meta['model']}", ""]
    lines.append(", ".join(f"{k}: {v}" for k, v in meta.items()
                           if k not in ("model", "drafter_options", "datastore_manifest")))
    lines.append("")
    for method, options in meta.get("drafter_options", {}).items():
        lines.append(f"- {method}: " + ", ".join(f"{k}={v}" for k, v in options.items()))
    if meta.get("interrupted"):
        lines += ["", "**Interrupted: partial results over the prompts that finished.**"]
    lines += ["", "## All prompts", "", *markdown_table(report["methods"])]
    for name, table in report["datasets"].items():
        lines += ["", f"## {name}", "", *markdown_table(table)]
        cats = report["categories"][name]
        if len(cats) > 1:
            for cat, cat_table in cats.items():
                lines += ["", f"### {name} / {cat}", "", *markdown_table(cat_table)]
    return "\n".join(lines) + "\n"


def write_report(report: dict, records: list[BenchRecord], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    with open(out / "outputs.jsonl", "w") as f:
        for r in records:
            row = dict(method=r.method, dataset=r.prompt.dataset, category=r.prompt.category,
                       prompt_index=r.prompt_index, token_ids=r.result.token_ids)
            f.write(json.dumps(row) + "\n")
    (out / "report.md").write_text(markdown(report))
    write_plots(report, out)


def write_plots(report: dict, out: Path) -> None:
    """speedup.png, per_position_acceptance.png, accepted_length.png, each legend to the right
    of its axes, where it covers no bar or curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(report["methods"])
    groups = [(f"{d}/{c}" if len(cats) > 1 else d, table)
              for d, cats in report["categories"].items() for c, table in cats.items()]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(groups) * len(methods) + 1.5), 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [table.get(method, {}).get("speedup") or 0 for _, table in groups]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([name for name, _ in groups], rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (tokens/s ratio)")
    _save(fig, ax, out / "speedup.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, f in report["methods"].items():
        curve = f["per_position_acceptance"]
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=method)
    ax.set_xlabel("draft position d")
    ax.set_ylabel("P(accepted >= d | drafted to depth d)")
    ax.set_ylim(0, 1)
    _save(fig, ax, out / "per_position_acceptance.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, f in report["methods"].items():
        hist = {int(k): v for k, v in f["accepted_length_histogram"].items()}
        total = sum(hist.values())
        if total and method != "none":
            xs = sorted(hist)
            ax.plot(xs, [hist[x] / total for x in xs], marker="o", label=method)
    ax.set_xlabel("tokens emitted per verify step (accepted + bonus)")
    ax.set_ylabel("fraction of steps")
    _save(fig, ax, out / "accepted_length.png")


def _save(fig, ax, path: Path) -> None:
    """Write the figure with its legend outside the axes: inside, the legend sits over the
    tallest bars or the highest curves, the very ones a reader looks for."""
    import matplotlib.pyplot as plt  # loaded by write_plots, after choosing its backend

    if ax.get_legend_handles_labels()[0]:  # a legend only where something was drawn
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  frameon=False)
    # the axes keep their size; the saved image grows to hold the legend and the tick labels
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
