"""The table of `retrieval_speed.sh`: measured tokens/s of DReSD and REST against store size.

    .venv/bin/python benchmarks/retrieval_speed_summary.py

Reads `results/retrieval/speed/<store>/report.json` (the store's manifest, with its size in
corpus tokens, is in the report); writes `results/retrieval/speed/README.md`. Speedups are
tokens/s over AR's in the same interleaved run.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "retrieval" / "speed"
METHODS = {"REST, 4 nodes": "rest[max_tree_nodes=4]", "DReSD, 4 nodes": "dresd[max_tree_nodes=4]"}


def main() -> None:
    rows = []
    for report_path in RESULTS.glob("*/report.json"):
        report = json.loads(report_path.read_text())
        store = Path(report["meta"]["datastore"])
        tokens = report["meta"]["datastore_manifest"]["num_corpus_tokens"]
        rows.append((tokens, store.name, report))
    rows.sort()
    meta = rows[0][2]["meta"]
    lines = ["# Tokens/s against store size, measured (benchmarks/retrieval_speed.sh)", "",
             f"GSM8K test, first {meta['prompts']} questions; stores: the first documents of the "
             "model's own answers to the GSM8K train questions (ID); greedy, "
             f"{meta['max_new_tokens']} new tokens, {meta['dtype']}, {meta['threads']} thread; "
             "methods interleaved prompt by prompt; speedup = tokens/s over AR's in the same "
             "run; in brackets the mean accepted length.", "",
             "| store | corpus tokens | " + " | ".join(METHODS) + " | DReSD / REST (speed) |",
             "| --- | ---: | " + " | ".join("---:" for _ in METHODS) + " | ---: |"]
    for tokens, name, report in rows:
        figures = [report["methods"][m] for m in METHODS.values()]
        cells = [f"{f['speedup']:.2f}x ({f['mean_accepted_length']:.2f})" for f in figures]
        ratio = figures[1]["tokens_per_s"] / figures[0]["tokens_per_s"]
        lines.append(f"| `{name}` | {tokens:,} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
