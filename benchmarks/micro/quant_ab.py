"""Two builds of the quantized kernel measured paired: `quant.c` as it was (A) against as it is (B).

A change to `kernels/quant.c` moves a layer's time by a few percent, and this 2-core machine
drifts by more than that between runs. This compiles both sources, packs one 1B-shape layer per
type with each build's own packer (random blocks: speed does not depend on the values; a
change may change the layout), and times A and B on the same inputs, row count by row count,
alternating which goes first, each call on weights cycled from memory (~96 MB of copies), the
best of the repeats and the spread of the repeats. It also checks that B's outputs are A's bit
for bit: a kernel change may move speed, never a result.

    git show HEAD:src/dresd/kernels/quant.c > /tmp/quant_before.c
    cp src/dresd/kernels/bf16.h src/dresd/kernels/vec.h /tmp/   # its includes, beside it
    PYTHONPATH=src:benchmarks/micro .venv/bin/python benchmarks/micro/quant_ab.py \\
        /tmp/quant_before.c

A source from before the five-bit layout keeps `dresd_quant_group_bytes` static, which this
needs: `sed -i 's/^static int64_t dresd_quant_group_bytes/int64_t dresd_quant_group_bytes/'`.
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
    includes = tuple(source.with_name(header.name) for header in kernels.HEADERS)
    library = kernels.load(source, quant.FLAGS, "DRESD_QUANT_AB", "nothing", includes=includes)
    if library is None:
        raise SystemExit(f"could not compile {source}")
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.dresd_quant_linear.argtypes = [i32, pointer, i64, i32, i32, pointer, i32, pointer,
                                           pointer, i64, i32, i32]
    library.dresd_quant_pack.argtypes = [i32, pointer, i64, i32, i32, pointer, i32]
    library.dresd_quant_group_bytes.argtypes = [i32, i32]
    library.dresd_quant_group_bytes.restype = i64
    return library


def pack(library: ctypes.CDLL, qtype: Q, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """raw blocks in `library`'s own layout (its packer, its group size)."""
    number = quant.LAYOUTS[qtype].number
    groups = -(-n // quant.GROUP)
    packed = torch.empty(groups * library.dresd_quant_group_bytes(number, k), dtype=torch.uint8)
    if library.dresd_quant_pack(number, raw.ctypes.data, raw.strides[0], n, k,
                                packed.data_ptr(), 1):
        raise SystemExit(f"could not pack {qtype.name}")
    return packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="quant.c as it was (A)")
    parser.add_argument("--after", type=Path, default=quant.SOURCE, help="B (default: now)")
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048],
                        help="outputs, inputs (default: Llama 3.2 1B's gate/up)")
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q5_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    builds = {"A": build(args.before), "B": build(args.after)}
    n, k = args.shape
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"{cpu_model()}, 1 thread, a {n} x {k} layer; microseconds a call, A -> B "
          f"(best of {args.repeats}; [the repeats' range])")
    for name in args.types.split(","):
        qtype = Q[name]
        raw = random_blocks(qtype, n, k, rng)
        copies = {}
        for which, library in builds.items():
            packed = pack(library, qtype, raw, n, k)
            copies[which] = [packed] + [packed.clone()
                                        for _ in range(max(1, int(96e6 / packed.nbytes)))]
        inputs = {t: torch.randn(t, k).to(torch.bfloat16) for t in rows}
        times = {(which, t): [] for which in builds for t in rows}
        outputs = {}
        for repeat in range(args.repeats):
            for t in rows:
                order = list(builds.items())
                for which, library in order if repeat % 2 == 0 else order[::-1]:
                    y = torch.empty(t, n, dtype=torch.bfloat16)
                    started = time.perf_counter()
                    for weights in copies[which]:
                        library.dresd_quant_linear(quant.LAYOUTS[qtype].number,
                                                   inputs[t].data_ptr(), k, t, k,
                                                   weights.data_ptr(), n, None, y.data_ptr(), n,
                                                   1, 1)
                    seconds = (time.perf_counter() - started) / len(copies[which])
                    times[which, t].append(seconds * 1e6)
                    outputs[which, t] = y
        for t in rows:
            if not torch.equal(outputs["A", t], outputs["B", t]):
                raise SystemExit(f"{name}, {t} rows: B's outputs differ from A's")
        sizes = " -> ".join(f"{copies[which][0].nbytes / 1e6:.1f}" for which in builds)
        print(f"{name:5} ({sizes} MB)", flush=True)
        for t in rows:
            a, b = sorted(times["A", t]), sorted(times["B", t])
            print(f"    {t} rows: {a[0]:.0f} [{a[0]:.0f}-{a[-1]:.0f}] -> {b[0]:.0f} "
                  f"[{b[0]:.0f}-{b[-1]:.0f}]  B/A {b[0] / a[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
