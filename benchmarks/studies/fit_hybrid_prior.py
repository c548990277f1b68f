"""Fit `hybrid`'s acceptance prior offline, from recorded bench runs.

    python benchmarks/studies/fit_hybrid_prior.py --runs RUN [RUN ...] --out prior.json

Each run's AR outputs are replayed (`dresd.bench.replay`) with a `hybrid` drafter on that run's
datastore and verify-cost curve; every candidate of every step is an observation of its cell
(accepted or not), exactly as the drafter learns online. The cells' summed counts are saved
(`AcceptanceTable.save`), and `hybrid[prior=prior.json]` starts from their rates instead of
its guesses. Fit on other prompts than the ones you measure on: a prior fitted on the
evaluation prompts is a leak.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from draft_shapes import recorded_outputs, recorded_references

from dresd.bench.replay import drafter_proposer, replay
from dresd.drafters.hybrid import AcceptanceTable, HybridDrafter
from dresd.models.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="bench --out folders")
    parser.add_argument("--out", type=Path, required=True, help="the prior's JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    fitted = AcceptanceTable()
    target = None
    for run in args.runs:
        meta = json.loads((run / "report.json").read_text())["meta"]
        if target is None:
            target = load_target(meta["model"], dtype=meta["dtype"])
        rows = recorded_outputs(run / "outputs.jsonl")
        refs = recorded_references(target, [r for r in rows if r["method"] == "ar"])
        curve = {int(n): c for n, c in meta["verify_cost_curve"].items()}
        drafter = HybridDrafter(datastore=meta.get("datastore"), cost=curve)
        replay(refs, drafter_proposer(drafter, refs), drafter)
        for cell, (accepted, tried) in drafter.table.counts.items():
            counts = fitted.counts.setdefault(cell, [0.0, 0.0])
            counts[0] += accepted
            counts[1] += tried
        print(f"{run}: {len(refs)} prompts, {len(drafter.table.counts)} cells")
    fitted.save(args.out)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
