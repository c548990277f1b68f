"""What speculation can give on a model, from its verify-cost curve and recorded acceptance.

    PYTHONPATH=src python benchmarks/peers/gguf_projection.py --threads 1 \
        --models default default-gguf FILE.gguf ... \
        --reports benchmarks/results/hybrid/*/report.json

For each model, its verify-cost curve on this machine (`dresd calibrate`: cost(t) = seconds of a
forward over a tree of t tokens / seconds of a one-token step; measured once and cached), and
for each method of each recorded report (run on the default model), the projected speedup over
that model's plain decoding:

    projected speedup = mean accepted length / cost(1 + drafted tokens per step)

(cost interpolated linearly between measured sizes): the report's acceptance, as if the same
drafts were verified on this model's curve. Random-weight files accept nothing of their own, so
every figure for them is a projection; the measured one is the curve. One markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dresd.calibrate import load_or_measure
from dresd.host import cpu_model
from dresd.models.target import load_target


def cost_at(curve: dict[int, float], tokens: float) -> float:
    sizes = sorted(curve)
    return float(np.interp(tokens, sizes, [curve[s] for s in sizes]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--reports", nargs="+", type=Path, required=True)
    parser.add_argument("--methods", default="pld,suffix,hybrid")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    curves = {}
    for name in args.models:
        target = load_target(name)
        curves[Path(name).name] = (target.linears, load_or_measure(target, quiet=True))
        del target
    methods = args.methods.split(",")
    print(f"# Verify-cost curves and projected speedups ({cpu_model()}, {args.threads} "
          "thread(s))\n")
    sizes = sorted(next(iter(curves.values()))[1])
    print("| model | linears | " + " | ".join(f"cost({s})" for s in sizes) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in sizes) + " |")
    for name, (linears, curve) in curves.items():
        print(f"| {name} | {linears} | " + " | ".join(f"{curve[s]:.2f}" for s in sizes) + " |")
    print("\nProjected speedup over each model's own plain decoding (recorded acceptance from "
          "runs on the default model; measured on the default model in bf16 where that is the "
          "model and the report's machine):\n")
    print("| report | method | mean accepted length | drafted per step | "
          + " | ".join(curves) + " |")
    print("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in curves) + " |")
    for path in args.reports:
        report = json.loads(path.read_text())["methods"]
        for method in methods:
            if method not in report:
                continue
            row = report[method]
            length, drafted = row["mean_accepted_length"], row["drafted_tokens_per_step"]
            projected = [length / cost_at(curve, 1 + drafted) for _, curve in curves.values()]
            print(f"| {path.parent.name} | {method} | {length:.2f} | {drafted:.1f} | "
                  + " | ".join(f"{p:.2f}x" for p in projected) + " |")


if __name__ == "__main__":
    main()
