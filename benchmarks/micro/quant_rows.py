"""What a quantized linear layer costs by rows: the verify-cost curve of GGUF weights, per type.

A speculative step verifies a tree of t rows in one forward, so whether drafts pay on a GGUF file
depends on how `quant.c`'s kernel grows with the rows: memory-bound at one row (it streams the
weights), then compute-bound (a row's `vpdpbusd` work, ~0.15-0.2 of a one-row call on this CPU).
This times one layer of a 1B model's shape (Llama 3.2 1B's gate/up: 8192 x 2048, random blocks:
speed does not depend on the values) for each type at t = 1 ... 16 rows, copies of the weights
cycled so that every call reads from memory (~96 MB), the row counts interleaved within each
repeat, the best of the repeats.

    PYTHONPATH=src .venv/bin/python benchmarks/micro/quant_rows.py \\
        --out benchmarks/results/quant_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from dresd.host import cpu_model
from dresd.kernels import quant

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
# Where each type keeps its float16 scales in a block (bytes): kept small and finite.
SCALES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
          Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (-2,)}


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, bytes per row]: random quants, small float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for first in SCALES[qtype]:
        first %= size
        scale = rng.uniform(0.0005, 0.002, (n, k // block)).astype(np.float16)
        raw[..., first:first + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def curve(qtype: Q, n: int, k: int, repeats: int, rng: np.random.Generator) -> dict[int, float]:
    """Microseconds a call at each row count (best of `repeats`)."""
    packed = quant.pack(qtype, random_blocks(qtype, n, k, rng), n, k)
    copies = [packed] + [packed.clone() for _ in range(max(1, int(96e6 / packed.nbytes)))]
    inputs = {t: torch.randn(t, k).to(torch.bfloat16) for t in ROWS}
    best = {t: float("inf") for t in ROWS}
    for _ in range(repeats):
        for t in ROWS:
            started = time.perf_counter()
            for weights in copies:
                quant.linear(inputs[t], qtype, weights, n)
            best[t] = min(best[t], (time.perf_counter() - started) / len(copies) * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048],
                        metavar=("OUT", "IN"))
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, k = args.shape
    rng = np.random.default_rng(0)
    report = {"meta": {"cpu": cpu_model(), "threads": 1, "shape": [n, k],
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "load_average": os.getloadavg()}, "types": {}}
    print(f"{n} x {k}, 1 thread; cost(t) = a call of t rows / a call of 1")
    for name in args.types.split(","):
        micros = curve(Q[name], n, k, args.repeats, rng)
        cost = {t: micros[t] / micros[1] for t in ROWS}
        report["types"][name] = {"us": micros, "cost": cost}
        print(f"{name:5s} 1 row {micros[1]:7.1f} us | "
              + " ".join(f"{t}:{c:.2f}" for t, c in cost.items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
