"""`hybrid` against the best single method of each set: the table behind the README's results.

Reads the bench reports of `benchmarks/hybrid.sh` (`results/hybrid/<set>/report.json`), and for
each set, and each MT-Bench category, prints the best single method (plain decoding, AR, counts
among them at 1.00x), its speedup over AR, hybrid's, and

    hybrid / best single = hybrid tokens/s / best single method's tokens/s   (same run)

Goals: at least 0.97 on every set and category, at least 1.15 on average, drafting under 5% of
the step. Writes `results/hybrid/summary.md`.

    .venv/bin/python benchmarks/hybrid_summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "hybrid"
HYBRID = "hybrid"


def row(name: str, table: dict) -> tuple[str, float, str]:
    """One markdown row and hybrid / best single for one method table of a report."""
    singles = {m: f for m, f in table.items() if m.split("[")[0] != HYBRID}  # not variants
    best = max(singles, key=lambda m: singles[m]["tokens_per_s"])
    ratio = table[HYBRID]["tokens_per_s"] / singles[best]["tokens_per_s"]
    hybrid = table[HYBRID]
    line = (f"| {name} | {table[HYBRID]['num_prompts']} | {best} | "
            f"{singles[best]['speedup']:.2f}x | {hybrid['speedup']:.2f}x | **{ratio:.2f}** | "
            f"{hybrid['mean_accepted_length']:.2f} | {hybrid['draft_time_share']:.1%} | "
            f"{hybrid['identical_fraction']:.0%} |")
    return line, ratio, best


def main() -> None:
    lines = ["# hybrid against the best single method (recorded by benchmarks/hybrid.sh)", "",
             "Speedups over AR in the same run; the best single method includes AR itself.", "",
             "| set | prompts | best single method | its speedup | hybrid | hybrid / best "
             "| hybrid accepted length | hybrid draft time | identical to AR |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    for report_path in sorted(RESULTS.glob("*/report.json")):
        report = json.loads(report_path.read_text())
        if HYBRID not in report["methods"]:
            continue
        line, ratio, _ = row(report_path.parent.name, report["methods"])
        lines.append(line)
        ratios.append(ratio)
        if report_path.parent.name.startswith("mt-bench"):
            for category, table in report["categories"].get("mt_bench", {}).items():
                line, ratio, _ = row(f"mt-bench: {category}", table)
                lines.append(line)
    lines += ["", f"Mean hybrid / best single over the {len(ratios)} sets: "
                  f"**{sum(ratios) / len(ratios):.2f}** (goal 1.15); lowest "
                  f"{min(ratios):.2f} (goal 0.97)."]
    text = "\n".join(lines) + "\n"
    (RESULTS / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
