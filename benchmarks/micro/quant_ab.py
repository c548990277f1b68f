"""Two builds of the quantized kernel measured paired: `quant.c` as it was (A) against as it is (B).

A change to `kernels/quant.c` moves a layer's time by a few percent, and this 2-core machine
drifts by more than that between runs. This compiles both sources, packs one 1B-shape layer per
type (random blocks: speed does not depend on the values), and times A and B on the same
inputs, row count by row count, alternating which goes first, each call on weights cycled from
memory (~96 MB of copies), the best of the repeats. It also checks that B's outputs are A's bit
for bit: a kernel change may move speed, never a result.

    git show HEAD:src/dresd/kernels/quant.c > /tmp/quant_before.c
    cp src/dresd/kernels/bf16.h /tmp/     # quant.c's include, beside the old source
    PYTHONPATH=src:benchmarks/micro .venv/bin/python benchmarks/micro/quant_ab.py \\
        /tmp/quant_before.c
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from quant_rows import random_blocks

from dresd import kernels
from dresd.host import cpu_model
from dresd.kernels import quant


def build(source: Path) -> ctypes.CDLL:
    library = kernels.load(source, quant.FLAGS, "DRESD_QUANT_AB", "nothing",
                           includes=(quant.BF16_HEADER,))
    if library is None:
        raise SystemExit(f"could not compile {source}")
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.dresd_quant_linear.argtypes = [i32, pointer, i64, i32, i32, pointer, i32, pointer,
                                           pointer, i64, i32, i32]
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="quant.c as it was (A)")
    parser.add_argument("--after", type=Path, default=quant.SOURCE, help="B (default: now)")
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048],
                        help="outputs, inputs (default: Llama 3.2 1B's gate/up)")
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = {"A": build(args.before), "B": build(args.after)}
    n, k = args.shape
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"{cpu_model()}, 1 thread, a {n} x {k} layer; microseconds a call, A -> B")
    for name in args.types.split(","):
        qtype = Q[name]
        packed = quant.pack(qtype, random_blocks(qtype, n, k, rng), n, k)
        copies = [packed] + [packed.clone() for _ in range(max(1, int(96e6 / packed.nbytes)))]
        inputs = {t: torch.randn(t, k).to(torch.bfloat16) for t in rows}
        best = {(which, t): float("inf") for which in builds for t in rows}
        outputs = {}
        for repeat in range(args.repeats):
            for t in rows:
                order = list(builds.items())
                for which, library in order if repeat % 2 == 0 else order[::-1]:
                    y = torch.empty(t, n, dtype=torch.bfloat16)
                    started = time.perf_counter()
                    for weights in copies:
                        library.dresd_quant_linear(quant.LAYOUTS[qtype].number,
                                                   inputs[t].data_ptr(), k, t, k,
                                                   weights.data_ptr(), n, None, y.data_ptr(), n,
                                                   1, 1)
                    seconds = (time.perf_counter() - started) / len(copies)
                    best[which, t] = min(best[which, t], seconds * 1e6)
                    outputs[which, t] = y
        for t in rows:
            if not torch.equal(outputs["A", t], outputs["B", t]):
                raise SystemExit(f"{name}, {t} rows: B's outputs differ from A's")
        print(f"{name:5}", " ".join(f"{t}: {best['A', t]:.0f} -> {best['B', t]:.0f}"
                                    for t in rows), flush=True)


if __name__ == "__main__":
    main()
