"""The C attention kernel per layer of a batched step: one `cpu_attention.attention` call per
sequence (what `LlamaForward` does) against one `cpu_attention.attention_batch` call for all of
them, at 1 and 2 threads. The default model's heads (9 query, 3 kv, 64 wide), a 400-key cache
per sequence; decode steps (1 row each) and 16-node trees. Variants interleaved, medians.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/micro/attention_batch.py
"""

from __future__ import annotations

import statistics
from time import perf_counter

import torch

from dresd import cpu_attention

HEADS, KV_HEADS, DIM, LENGTH = 9, 3, 64, 400


def main() -> None:
    if cpu_attention.kernel() is None:
        raise SystemExit("the C attention kernel is not available here")
    generator = torch.Generator().manual_seed(0)
    print("| sequences | rows each | threads | per-sequence calls us | one batch call us |"
          " speedup |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for sequences, rows in [(1, 1), (4, 1), (16, 1), (1, 16), (4, 16)]:
        total = sequences * rows
        query = torch.randn(total, HEADS, DIM, generator=generator).to(torch.bfloat16)
        keys = [torch.randn(1, KV_HEADS, LENGTH, DIM, generator=generator).to(torch.bfloat16)
                for _ in range(sequences)]
        values = [torch.randn(1, KV_HEADS, LENGTH, DIM, generator=generator).to(torch.bfloat16)
                  for _ in range(sequences)]
        visible = torch.ones(rows, LENGTH, dtype=torch.bool).tril(LENGTH - rows)
        mask = None if rows == 1 else torch.zeros(1, 1, rows, LENGTH, dtype=torch.bfloat16
                                                  ).masked_fill_(~visible, -1e38)
        masks = [mask] * sequences
        bounds = list(range(0, total + 1, rows))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = {"loop": [], "batch": []}
            for repeat in range(31):
                start = perf_counter()
                out = torch.empty(total, HEADS, DIM, dtype=torch.bfloat16)
                for s in range(sequences):
                    q = query[bounds[s]:bounds[s + 1]].transpose(0, 1)[None]
                    out[bounds[s]:bounds[s + 1]] = cpu_attention.attention(
                        q, keys[s], values[s], masks[s], DIM**-0.5)[0]
                middle = perf_counter()
                batch = cpu_attention.attention_batch(query, bounds, keys, values, masks,
                                                      DIM**-0.5)
                end = perf_counter()
                assert torch.equal(out, batch)
                if repeat:
                    times["loop"].append(middle - start)
                    times["batch"].append(end - middle)
            loop, one = (statistics.median(times[v]) * 1e6 for v in ("loop", "batch"))
            print(f"| {sequences} | {rows} | {threads} | {loop:.0f} | {one:.0f} | "
                  f"{loop / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
