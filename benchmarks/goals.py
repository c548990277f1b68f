"""Read bench reports against the paper's goals (issue 5) and write one summary table.

For each report folder: DReSD / REST ratios of mean accepted length, acceptance rate and
tokens/s, DReSD against PLD and AR, and DReSD's drafting share of the time.

    python benchmarks/goals.py benchmarks/results/default_model/*/ > summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GOALS = [  # (label, function of the method table, goal, higher is better)
    ("DReSD / REST mean accepted length",
     lambda m: m["dresd"]["mean_accepted_length"] / m["rest"]["mean_accepted_length"], 1.65),
    ("DReSD / REST acceptance rate",
     lambda m: m["dresd"]["acceptance_rate"] / m["rest"]["acceptance_rate"], 1.87),
    ("DReSD / REST tokens/s",
     lambda m: m["dresd"]["tokens_per_s"] / m["rest"]["tokens_per_s"], 1.19),
    ("DReSD / PLD tokens/s",
     lambda m: m["dresd"]["tokens_per_s"] / m["pld"]["tokens_per_s"], 1.0),
    ("DReSD / AR tokens/s", lambda m: m["dresd"]["speedup"], 1.5),
]


def summarize(folder: Path) -> list[str]:
    report = json.loads((folder / "report.json").read_text())
    methods = report["methods"]
    meta = report["meta"]
    lines = [f"## {folder.name}", "",
             f"{meta['prompts']} prompts of {', '.join(meta['datasets'])}, "
             f"{meta['max_new_tokens']} new tokens at most, {meta['sampling']}, "
             f"{meta['threads']} thread(s), {meta['date']}"
             + (" (interrupted: partial)" if meta.get("interrupted") else ""), "",
             "| method | tokens/s | speedup | mean accepted length | acceptance rate | "
             "drafted/step | draft time | identical |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, f in methods.items():
        rate = "-" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.1%}"
        share = "-" if f["draft_time_share"] is None else f"{f['draft_time_share']:.1%}"
        lines.append(f"| {name} | {f['tokens_per_s']:.1f} | {f['speedup']:.2f}x | "
                     f"{f['mean_accepted_length']:.2f} | {rate} | "
                     f"{f['drafted_tokens_per_step']:.1f} | {share} | "
                     f"{f['identical_fraction']:.0%} |")
    lines += ["", "| goal | measured | goal | met |", "| --- | ---: | ---: | :---: |"]
    for label, measure, goal in GOALS:
        try:
            value = measure(methods)
        except (KeyError, TypeError, ZeroDivisionError):
            lines.append(f"| {label} | - | {goal} | - |")
            continue
        lines.append(f"| {label} | {value:.2f} | {goal} | {'yes' if value >= goal else 'no'} |")
    share = methods.get("dresd", {}).get("draft_time_share")
    if share is not None:
        lines.append(f"| DReSD drafting share of the time | {share:.1%} | <= 5% | "
                     f"{'yes' if share <= 0.05 else 'no'} |")
    return lines + [""]


def main() -> None:
    for folder in sys.argv[1:]:
        print("\n".join(summarize(Path(folder))))


if __name__ == "__main__":
    main()
