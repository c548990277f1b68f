"""Is hybrid's cut where it pays most? `dresd bench` with the verify-cost curve's rise scaled.

Hybrid keeps the n most probable nodes that maximise (1 + their reach) / cost(n + 1), reading
cost from this machine's cached curve (`dresd.calibrate`). Scaling the curve's rise,

    cost'(t) = 1 + alpha * (cost(t) - 1),

makes every tree look cheaper (alpha < 1) or dearer (alpha > 1) than measured, so the cut keeps
more or fewer nodes while the forward costs what it costs. If the cut is right, no alpha beats
1 by more than the run-to-run spread; alpha = 0 (every tree free) verifies every candidate up
to `max_tree_nodes`: the accepted length all the sources' candidates hold together.

For each alpha this writes the scaled curve over the cached one, runs `dresd bench` with the
arguments given after `--`, and puts the measured curve back (also on failure):

    PYTHONPATH=src .venv/bin/python benchmarks/micro/cut_scale.py --alphas 1,0.6,0 \\
        --out runs/cut-scale -- --methods ar,hybrid --datastore runs/demo-gsm8k-id-store \\
        --dataset gsm8k --limit 6 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from dresd.calibrate import curve_path, load_or_measure
from dresd.models.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alphas", default="1,0.6,0", help="scales of the curve's rise")
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1, help="as the bench's --threads")
    parser.add_argument("--out", type=Path, required=True, help="a folder per alpha under it")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then `dresd bench` args")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    torch.set_num_threads(args.threads)  # the curve is cached per thread count
    target = load_target(args.model)
    load_or_measure(target)  # measured once if it is not cached yet
    path = curve_path(target)
    measured = path.read_text()
    try:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            record = json.loads(measured)
            record["cost"] = {t: 1 + alpha * (c - 1) for t, c in record["cost"].items()}
            path.write_text(json.dumps(record, indent=1) + "\n")
            out = args.out / f"alpha-{alpha:g}"
            subprocess.run([sys.executable, "-m", "dresd", "bench", "--model", args.model,
                            "--threads", str(args.threads), *bench, "--out", str(out)],
                           check=True)
            print(f"alpha {alpha:g}: {out / 'report.md'}", flush=True)
    finally:
        path.write_text(measured)


if __name__ == "__main__":
    main()
