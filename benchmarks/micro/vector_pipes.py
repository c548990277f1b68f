"""How fast this CPU runs the instructions a verify row is made of, and what that floors a row at.

A speculative step verifies t rows in one forward. Past the first row, which streams the
weights, each row adds its own arithmetic: in `linear.c` one `vdpbf16ps` per 32 multiply-adds,
in `quant.c` one `vpdpbusd` per 64 and, per block of 32 inputs and 16 outputs, three float32
operations that scale the block's integer dot (`vmulps` and two `vfmadd231ps`). This measures
each instruction's throughput on one core (12 independent chains, so latency never limits it)
and whether `vpdpbusd` and `vfmadd231ps` share execution ports (if they do, the two mixed run
no faster than either alone). From these, the least one more row can cost a model (every linear
layer and the LM head, attention and the rest left out), set beside what the cached verify-cost
curves measured:

    floor per row = (MACs / 64 + 3 MACs / 512) / vpdpbusd rate     (quantized, shared ports)
                  =  MACs / 32 / vdpbf16ps rate                      (bf16)
    measured      = (cost(t) - 1) / (t - 1) * one-row step seconds   (the curve's cost(t))

    PYTHONPATH=src .venv/bin/python benchmarks/micro/vector_pipes.py \\
        --curve ~/.cache/dresd/calibration/<model>-bfloat16-GGUF-Q4-1-Q8-0-1threads-cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

from dresd import kernels
from dresd.host import cpu_flags, cpu_model

SOURCE = Path(__file__).with_name("vector_pipes.c")
CHAINS = 12  # vector_pipes.c's independent chains per loop iteration
# SmolLM2-135M (the default model): hidden, intermediate, layers, heads, kv heads, vocab
DEFAULT_SHAPE = (576, 1536, 30, 9, 3, 49152)


def instructions_per_second(function: ctypes._CFuncPtr, repeats: int = 5) -> float:
    """Best of `repeats` timed loops of ~0.1 s (one warm-up first)."""
    count = 2_000_000
    function(count)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function(count)
        best = min(best, time.perf_counter() - started)
    return count * CHAINS / best


def macs_per_row(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vocab: int) -> int:
    """Multiply-adds of one token through every linear layer and the LM head."""
    head_dim = hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return layers * (attention + 3 * hidden * intermediate) + vocab * hidden


def measured_per_row(curve_path: Path) -> tuple[str, float, dict[int, float]]:
    """(its name, the one-row step's seconds, seconds one more row costs at t rows)."""
    record = json.loads(curve_path.read_text())
    step = record["step_seconds"]
    cost = {int(t): c for t, c in record["cost"].items()}
    per_row = {t: (cost[t] - 1) / (t - 1) * step for t in (2, 4, 8, 12) if t in cost}
    return curve_path.stem, step, per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=6, default=list(DEFAULT_SHAPE),
                        metavar=("HIDDEN", "INTERMEDIATE", "LAYERS", "HEADS", "KV_HEADS",
                                 "VOCAB"), help="the model (default: SmolLM2-135M)")
    parser.add_argument("--curve", type=Path, action="append", default=[],
                        help="a cached verify-cost curve (JSON) to set beside the floors")
    args = parser.parse_args()
    if not {"avx512_vnni", "avx512_bf16"} <= cpu_flags():
        raise SystemExit("needs AVX-512 VNNI and bf16")
    library = kernels.load(SOURCE, ("-O3", "-march=native", "-shared", "-fPIC"),
                           "DRESD_VECTOR_PIPES", "nothing")
    if library is None:
        raise SystemExit(f"could not compile {SOURCE}")
    rates = {}
    for name in ("dpbusd", "dpbf16", "fma", "dpbusd_fma"):
        function = getattr(library, f"pipes_{name}")
        function.argtypes, function.restype = [ctypes.c_int64], ctypes.c_float
        rates[name] = instructions_per_second(function)
    print(f"{cpu_model()}, 1 thread; instructions per second (12 independent chains)")
    print(f"  vpdpbusd      {rates['dpbusd'] / 1e9:6.2f} G/s")
    print(f"  vdpbf16ps     {rates['dpbf16'] / 1e9:6.2f} G/s")
    print(f"  vfmadd231ps   {rates['fma'] / 1e9:6.2f} G/s")
    # the mix, instructions of either kind: at most the slower one's rate if they share ports
    shared = rates["dpbusd_fma"] < 1.25 * min(rates["dpbusd"], rates["fma"])
    print(f"  vpdpbusd and vfmadd231ps mixed {rates['dpbusd_fma'] / 1e9:6.2f} G/s: "
          f"{'the same ports' if shared else 'separate ports'}")
    macs = macs_per_row(*args.shape)
    quant_ops = macs / 64 + 3 * macs / 512
    quant_floor = quant_ops / rates["dpbusd"] if shared else max(
        macs / 64 / rates["dpbusd"], 3 * macs / 512 / rates["fma"])
    bf16_floor = macs / 32 / rates["dpbf16"]
    print(f"a row of the model: {macs / 1e6:.1f} M multiply-adds in its linears and LM head")
    print(f"  floor per row, quantized (quant.c): {quant_floor * 1e3:.3f} ms")
    print(f"  floor per row, bf16 (linear.c):     {bf16_floor * 1e3:.3f} ms")
    for path in args.curve:
        name, step, per_row = measured_per_row(path.expanduser())
        rows = ", ".join(f"{t} rows {seconds * 1e3:.3f} ms" for t, seconds in per_row.items())
        print(f"{name}: one row {step * 1e3:.2f} ms; one more row, measured: {rows}")


if __name__ == "__main__":
    main()
