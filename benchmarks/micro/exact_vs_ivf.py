"""One DReSD query: an exact search against an IVF index, by store size, with cold caches.

DReSD searches one key per decode step, between two verify forwards that stream the model's
weights through the caches. FAISS's IVF search has a fixed cost (the coarse quantizer's scan of
~4 sqrt(N) centroids, then nprobe lists); an exact scan costs N x 64 multiply-adds. This
measures both on the index types `dresd build` writes (`datastore/index.py`: `ExactIndex`, an
IVF with fp16 codes and nprobe 8, the demo store's), on unit keys around 2,000 random centres
(hidden states cluster), with a 64 MB buffer read between queries as a forward would (so every
query starts cold), and reports the per-query time at each size: where `auto` should switch.
The IVF index is timed twice: as `FaissIndex` searches one query (the drafting kernel's search
of FAISS's lists, `drafting.ivf_search`), and through FAISS itself (`faiss_ivf_*`).

    PYTHONPATH=src .venv/bin/python benchmarks/micro/exact_vs_ivf.py \\
        --out benchmarks/results/exact_vs_ivf.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

from dresd.datastore import index as key_index
from dresd.host import cpu_model

DIM, CENTRES = 64, 2000


def keys_of(n: int, rng: np.random.Generator) -> np.ndarray:
    centres = rng.normal(size=(CENTRES, DIM)).astype(np.float32)
    keys = centres[rng.integers(0, CENTRES, n)] + rng.normal(size=(n, DIM)).astype(np.float32)
    return (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float16)


class FaissOnly:
    """An IVF index searched by FAISS alone, one query as `faiss_search` makes the call."""

    def __init__(self, index) -> None:
        self.index = index

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return key_index.faiss_search(self.index, queries, k)


def per_query_us(index, queries: np.ndarray, k: int, evict: np.ndarray | None) -> float:
    """Median microseconds a query, each after reading `evict` (None: warm)."""
    times = []
    for query in queries:
        if evict is not None:
            evict.sum()  # what a forward does to the caches
        started = time.perf_counter()
        index.search(query[None, :], k)
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--k", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    evict = np.ones(64 << 20 >> 3)  # 64 MB of float64
    rows = []
    for n in args.sizes:
        keys = keys_of(n, rng)
        queries = keys[rng.integers(0, n, args.queries)].astype(np.float32)
        queries += rng.normal(scale=0.05, size=queries.shape).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            np.save(folder / key_index.KEYS_FILE, keys)
            exact = key_index.ExactIndex.open(folder)
            settings = key_index.build_ivf(keys, folder)
            ivf = key_index.FaissIndex.open(folder, settings["nprobe"])
            faiss_only = FaissOnly(ivf.index)
            for k in args.k:
                row = {"entries": n, "k": k, "nlist": settings["nlist"],
                       "nprobe": settings["nprobe"], "recall_at_10": settings["recall_at_10"],
                       "exact_us_cold": per_query_us(exact, queries, k, evict),
                       "ivf_us_cold": per_query_us(ivf, queries, k, evict),
                       "faiss_ivf_us_cold": per_query_us(faiss_only, queries, k, evict),
                       "exact_us_warm": per_query_us(exact, queries, k, None),
                       "ivf_us_warm": per_query_us(ivf, queries, k, None),
                       "faiss_ivf_us_warm": per_query_us(faiss_only, queries, k, None)}
                rows.append(row)
                print(json.dumps(row))
    report = {"cpu": cpu_model(), "threads": 1, "load_average": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
