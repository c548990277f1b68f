"""IVF-Flat (`--index ivf`) against IVF-PQ with exact re-ranking (`--index ivfpq`) at scale.

On synthetic keys shaped like a store's (64-dim unit vectors, fp16, written to a memory-mapped
`keys.npy` as a build leaves them), each index is built with the library's own `build_index`
(nprobe picked for recall@10 >= 0.9, as a build does) and measured for:

- bytes per entry: on disk (every file the index needs) and the part search keeps in RAM when
  hot (ivf: the whole index file; ivfpq: the index file; its keys.npy stays on disk, read only
  at the re-ranked candidates' rows);
- build seconds, in CPU time of this process (the machines are shared: wall time mostly
  measures the other jobs; both are recorded);
- recall@10 of fresh random unit queries against exact search;
- single-query search latency, p50 and p99 over QUERIES queries at k = 50 (DReSD's default),
  FAISS on one thread, in CPU time of the thread (and wall time, recorded beside it).

Random unit keys are the worst case for both indexes: they have no cluster structure, so IVF
needs many lists probed and PQ codes separate neighbours poorly. Real keys (PCA'd hidden
states) are clustered: `--from-store DIR` takes the keys of an existing `ivf` store instead
(read from its index, whose fp16 codes are the keys; the store is only read), the queries
then being QUERIES of its own keys, each one's own entry left out of its neighbours.

    python benchmarks/micro/index_scale.py --entries 100000 --entries 1000000
    python benchmarks/micro/index_scale.py --entries 1000000 \\
        --from-store ~/.cache/dresd/datastores/stdlib-1m
    python benchmarks/micro/index_scale.py --entries 10000000 \\
        --resampled-from ~/.cache/dresd/datastores/stdlib-1m --out results/index_scale_10m

Past a real store's size, `--resampled-from` makes keys with its cluster structure
(`write_resampled_keys`): the 10M point of `results/scale.md`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dresd.datastore import index as key_index

DIM = 64
K = 50
QUERIES = 500
RECALL_QUERIES = 200
BLOCK = 1 << 18


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def write_keys(path: Path, n: int, seed: int) -> np.ndarray:
    """n random unit keys as fp16 in a .npy file, written in blocks; returned memory-mapped."""
    rng = np.random.default_rng(seed)
    keys = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, DIM))
    for start in range(0, n, BLOCK):
        keys[start : start + BLOCK] = unit_rows(rng, min(BLOCK, n - start))
    keys.flush()
    return np.load(path, mmap_mode="r")


def keys_from_ivf_store(store: Path, path: Path) -> np.ndarray:
    """The fp16 keys of an `ivf` store, read list by list from its index into a .npy file (to
    fp16 rounding of the residual plus centroid)."""
    import faiss

    index = faiss.read_index(str(store / key_index.IVF_FILE), faiss.IO_FLAG_MMAP_IFC)
    lists = index.invlists
    keys = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16,
                                     shape=(index.ntotal, index.d))
    for number in range(index.nlist):
        size = lists.list_size(number)
        if size:
            codes = faiss.rev_swig_ptr(lists.get_codes(number), size * lists.code_size)
            ids = faiss.rev_swig_ptr(lists.get_ids(number), size)
            # The codes are fp16 residuals: key minus its list's centroid.
            residuals = np.array(codes).view(np.float16).reshape(size, index.d)
            centroid = index.quantizer.reconstruct(number)
            keys[np.array(ids)] = residuals.astype(np.float32) + centroid
    keys.flush()
    return np.load(path, mmap_mode="r")


def write_resampled_keys(store: Path, path: Path, n: int, seed: int) -> np.ndarray:
    """n keys shaped like a real store's, past its size: each a random real key of the `ivf`
    store plus Gaussian noise whose expected norm is the median distance from a real key to its
    nearest other key. So every real neighbourhood holds n / N copies, each as far from its
    origin as real neighbours are from each other: the clusters of the real keys at n / N times
    their density. An assumption, stated as one: real stores need not grow that way."""
    real_path = path.with_name(path.stem + "-real.npy")
    real = keys_from_ivf_store(store, real_path)
    rng = np.random.default_rng(seed)
    sample = rng.choice(len(real), 500, replace=False)
    nearest = exact_top10(real, np.asarray(real[sample], dtype=np.float32), sample)[:, 0]
    gaps = np.linalg.norm(np.asarray(real[nearest], np.float32)
                          - np.asarray(real[sample], np.float32), axis=1)
    sigma = float(np.median(gaps)) / np.sqrt(DIM)  # E||noise|| ~ sigma sqrt(DIM)
    keys = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, DIM))
    for start in range(0, n, BLOCK):
        rows = rng.integers(0, len(real), min(BLOCK, n - start))
        block = np.asarray(real[np.sort(rows)], dtype=np.float32)
        keys[start : start + len(rows)] = block + rng.normal(0, sigma, block.shape)
    keys.flush()
    del real
    real_path.unlink()
    return np.load(path, mmap_mode="r")


def key_set(source: str, n: int, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys memory-mapped from `path`, queries, each query's own id or -1): n random unit
    keys and fresh random queries; or a store's keys (n = 0) or n keys resampled from them
    (`write_resampled_keys`), with a seeded sample of those keys as queries."""
    if source == "random unit":
        keys = write_keys(path, n, seed=0)
        return keys, unit_rows(np.random.default_rng(1), QUERIES), np.full(QUERIES, -1)
    if n:
        keys = write_resampled_keys(Path(source).expanduser(), path, n, seed=0)
        own = np.sort(np.random.default_rng(1).choice(len(keys), QUERIES, replace=False))
        return keys, np.asarray(keys[own], dtype=np.float32), own
    keys = keys_from_ivf_store(Path(source).expanduser(), path)
    own = np.sort(np.random.default_rng(1).choice(len(keys), QUERIES, replace=False))
    return keys, np.asarray(keys[own], dtype=np.float32), own


def exact_top10(keys: np.ndarray, queries: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Exact top 10 ids by inner product, each query's `own` id left out (-1: none)."""
    _, best_ids = key_index.exact_neighbours(keys, queries, 11, BLOCK)
    return np.array([without(row, o)[:10] for row, o in zip(best_ids, own, strict=True)])


def without(row: np.ndarray, own: int) -> np.ndarray:
    return row[row != own]


def measure(kind: str, keys_path: Path, folder: Path, queries: np.ndarray, own: np.ndarray,
            truth: np.ndarray) -> dict:
    folder.mkdir()
    if kind == "ivfpq":  # the re-ranking reads keys.npy from the index's own folder
        (folder / key_index.KEYS_FILE).symlink_to(keys_path)
    keys = np.load(keys_path, mmap_mode="r")
    cpu, wall = time.process_time(), time.perf_counter()
    settings = key_index.build_index(kind, keys, folder)
    build_cpu, build_wall = time.process_time() - cpu, time.perf_counter() - wall
    files = key_index.index_files(kind, folder)
    disk = sum((folder / f).stat().st_size for f in files)
    ram = (folder / key_index.IVF_FILE).stat().st_size
    index = key_index.open_index(folder, settings)
    _, found = index.search(queries[:RECALL_QUERIES], 11)
    recall = np.mean([len(set(without(f, o)[:10]) & set(t)) / 10
                      for f, o, t in zip(found, own[:RECALL_QUERIES], truth, strict=True)])
    cpu_ms, wall_ms = [], []
    for query in queries:
        cpu, wall = time.thread_time(), time.perf_counter()
        index.search(query[None, :], K)
        cpu_ms.append(1e3 * (time.thread_time() - cpu))
        wall_ms.append(1e3 * (time.perf_counter() - wall))
    n = len(keys)
    return {"index": kind, "entries": n, **{k: v for k, v in settings.items() if k != "index"},
            "disk_bytes_per_entry": disk / n, "ram_bytes_per_entry": ram / n,
            "build_cpu_s": build_cpu, "build_wall_s": build_wall,
            "recall_at_10_queries": float(recall),
            "search_ms_cpu_p50": float(np.percentile(cpu_ms, 50)),
            "search_ms_cpu_p99": float(np.percentile(cpu_ms, 99)),
            "search_ms_wall_p50": float(np.percentile(wall_ms, 50)),
            "search_ms_wall_p99": float(np.percentile(wall_ms, 99))}


def markdown(rows: list[dict]) -> str:
    lines = ["| keys | index | entries | nlist | nprobe | disk B/entry | RAM B/entry | build CPU s "
             "(wall s) | recall@10 | search p50 / p99 ms CPU (wall) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['keys']} | {r['index']} {r.get('codes', '')} | {r['entries']:,} | "
            f"{r['nlist']} | "
            f"{r['nprobe']} | {r['disk_bytes_per_entry']:.1f} | {r['ram_bytes_per_entry']:.1f} | "
            f"{r['build_cpu_s']:.0f} ({r['build_wall_s']:.0f}) | "
            f"{r['recall_at_10_queries']:.3f} | {r['search_ms_cpu_p50']:.2f} / "
            f"{r['search_ms_cpu_p99']:.2f} ({r['search_ms_wall_p50']:.2f} / "
            f"{r['search_ms_wall_p99']:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, action="append", help="store sizes (repeatable)")
    parser.add_argument("--from-store", type=Path, action="append",
                        help="also the keys of this ivf store (repeatable)")
    parser.add_argument("--resampled-from", type=Path, default=None,
                        help="the --entries sizes as keys resampled from this ivf store's, "
                             "instead of random unit keys")
    parser.add_argument("--kinds", nargs="+", default=["ivf", "ivfpq"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/index_scale"))
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: tmp)")
    args = parser.parse_args()
    import faiss

    faiss.omp_set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        sizes_from = str(args.resampled_from) if args.resampled_from else "random unit"
        sets = [(sizes_from, n) for n in args.entries or []]
        sets += [(str(store), 0) for store in args.from_store or []]
        for number, (source, n) in enumerate(sets or [("random unit", 1_000_000)]):
            keys_path = Path(work) / f"keys{number}.npy"
            keys, queries, own = key_set(source, n, keys_path)
            truth = exact_top10(keys, queries[:RECALL_QUERIES], own[:RECALL_QUERIES])
            for kind in args.kinds:
                row = measure(kind, keys_path, Path(work) / f"{kind}{number}", queries, own,
                              truth)
                row["keys"] = (source if n == 0 or source == "random unit"
                               else f"{Path(source).name}, resampled")
                print(json.dumps(row), flush=True)
                rows.append(row)
            del keys
            keys_path.unlink()
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
