"""One row, 1 thread: a Q4_1 576 -> 1536 linear (quant.c) and the bf16 lm_head 576 -> 49152
(linear.c) on this process's kernel tier (run it under each DRESD_ISA; README.md)."""

from __future__ import annotations

import time

import gguf
import numpy as np
import torch

from dresd import kernels
from dresd.kernels import linear, quant


def microseconds(call, repeats: int) -> float:
    """Mean time of `call()` after a tenth as many warm-up calls."""
    for _ in range(max(1, repeats // 10)):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(1)
    n, k = 1536, 576
    weights = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    packed = quant.pack(quant.Q.Q4_1, gguf.quants.quantize(weights, quant.Q.Q4_1), n, k)
    x = torch.randn(1, k).to(torch.bfloat16)
    quantized = microseconds(lambda: quant.linear(x, quant.Q.Q4_1, packed, n), 2000)
    head = linear.InvariantLinear(torch.randn(49152, k).to(torch.bfloat16))
    bf16 = microseconds(lambda: head(x), 50)
    print(f"{kernels.tier().name}: Q4_1 576->1536 {quantized:.1f} us; "
          f"bf16 576->49152 {bf16:.0f} us")


if __name__ == "__main__":
    main()
