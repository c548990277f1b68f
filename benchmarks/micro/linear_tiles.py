"""How the C linear kernel's panel width, row tile and prefetch distance price a call of M rows.

`kernels/linear.c` is compiled once per configuration (-DPARTS, -DMAX_TILE, -DPREFETCH for tiles
of 7+ rows, -DPREFETCH_FEW for smaller ones; the weights packed for each configuration's panel
of PARTS x 16 outputs), and every configuration runs the default model's shapes (576->3072
gate/up fused, 1536->576 down, 576->49152 LM head) at each M, alternating configuration by
configuration, at --threads (default 1), medians of the repeats. Each shape cycles over ~128 MB
of copies of its weights, so every call reads them from memory, as a forward does. Every
configuration's output must be bit for bit the first one's (the kernel's promise: tiling never
changes an output's sum).

    .venv/bin/python benchmarks/micro/linear_tiles.py \
        --configs "4,6,16,16 2,14,128,128 2,14,128,32" --rows 1,4,6,7,8,12,14,16,24
    (each config: PARTS,MAX_TILE,PREFETCH,PREFETCH_FEW; 4,6,16,16 is the kernel before 4dcf36d,
    2,14,128,128 at 4dcf36d, 2,14,128,32 after)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path
from time import perf_counter

import torch

from dresd.kernels import linear as cpu_linear

SHAPES = {"gate/up 576->3072": (3072, 576), "down 1536->576": (576, 1536),
          "head 576->49152": (49152, 576)}


def compile_config(parts: int, max_tile: int, prefetch: int, prefetch_few: int, folder: Path
                   ) -> ctypes.CDLL:
    out = folder / f"linear-{parts}-{max_tile}-{prefetch}-{prefetch_few}.so"
    subprocess.run(["gcc", *cpu_linear.FLAGS, f"-DPARTS={parts}", f"-DMAX_TILE={max_tile}",
                    f"-DPREFETCH={prefetch}", f"-DPREFETCH_FEW={prefetch_few}",
                    f"-I{cpu_linear.SOURCE.parent}",
                    str(cpu_linear.SOURCE), "-o", str(out)], check=True)
    function = ctypes.CDLL(str(out)).dresd_linear
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.argtypes = [pointer, i64, i32, pointer, i32, i32, pointer, pointer, i64, i32]
    return function


def pack(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """`linear.pack` for a panel of `panel` outputs."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // panel) * panel, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(-1, panel, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="4,6,16,16 2,14,128,128 2,14,128,32",
                        help="space-separated PARTS,MAX_TILE,PREFETCH,PREFETCH_FEW")
    parser.add_argument("--rows", default="1,4,6,7,8,12,14,16,24")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split()]
    rows = [int(m) for m in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        functions = [compile_config(*config, Path(folder)) for config in configs]
        names = ["/".join(map(str, config)) for config in configs]
        print("| shape | M | " + " | ".join(f"{n} us" for n in names) + " |")
        print("| --- | ---: | " + " | ".join("---:" for _ in names) + " |")
        for shape, (n, k) in SHAPES.items():
            weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(torch.bfloat16)
            copies = max(1, int(128e6 // weight.nbytes))
            packed = [[pack(weight, parts * 16) for _ in range(copies)]
                      for parts, *_ in configs]
            for m in rows:
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                times: list[list[float]] = [[] for _ in configs]
                outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in configs]
                for _ in range(args.repeats):
                    for index, function in enumerate(functions):
                        started = perf_counter()
                        for weights in packed[index]:
                            function(x.data_ptr(), k, m, weights.data_ptr(), k // 2, n, None,
                                     outs[index].data_ptr(), n, args.threads)
                        times[index].append((perf_counter() - started) / copies * 1e6)
                if not all(torch.equal(out, outs[0]) for out in outs):
                    raise SystemExit(f"{shape} M={m}: the configurations' outputs differ")
                print(f"| {shape} | {m} | "
                      + " | ".join(f"{statistics.median(t):.1f}" for t in times) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
