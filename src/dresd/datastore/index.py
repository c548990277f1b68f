"""Nearest-neighbour search over unit-length keys by inner product (= cosine similarity).

Three backends behind one small interface (`search(queries, k) -> (scores, ids)`):

- `exact`: every key scored (FAISS flat inner product); for small stores, where it is fast
  and has recall 1. Keys live in `keys.npy` (fp16 on disk, float32 in memory for the product).
- `ivf`: FAISS IVF with inner product, ~4*sqrt(N) lists, the keys stored at fp16 inside the
  index (IVF-Flat at half precision: the "flat" codes are the fp16 keys themselves, so the
  keys are not stored twice). `nprobe` is the smallest power of two whose recall@10 against
  exact search on a sample of queries reaches `recall_target` (a neighbour found counts when it
  is a true one or scores as high as the 10th true one: equal keys are interchangeable); it is
  recorded in the manifest.
  The index is opened memory-mapped (`IO_FLAG_MMAP_IFC`): opening costs no copy of the lists.
- `ivfpq`: for stores whose keys do not fit in RAM. The same IVF lists, but each key stored
  as a product-quantization code (`m` sub-quantizers of 8 bits, ~dim/4 bytes) instead of fp16
  (dim*2 bytes), so the index is ~8x smaller. PQ scores are approximate, so the top
  `rerank_factor * k` PQ candidates are re-scored by exact inner product against the fp16 keys
  kept in `keys.npy`, read memory-mapped: only the candidates' rows are touched, so the keys
  stay on disk. `nprobe` is chosen as for `ivf`, with the re-ranking included.
- `scann`: ScaNN, the paper's search library, in its standard configuration (tree +
  anisotropic asymmetric hashing + exact reordering; the paper's exact parameters are not
  restated here), optional: `pip install dresd[scann]`.

`auto` picks `exact` below `EXACT_MAX_ENTRIES` entries and `ivf` above.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Protocol

import numpy as np

from dresd.datastore.format import DatastoreError
from dresd.errors import MissingPackageError, UserError
from dresd.kernels import drafting

KINDS = ("auto", "exact", "ivf", "ivfpq", "scann")
# Above this many keys an IVF query beats an exact one with the caches a verify forward leaves
# cold (`benchmarks/micro/exact_vs_ivf.py`: exact 94 vs IVF 139 us at 10k keys, 154 vs 150 at
# 20k, 352 vs 121 at 50k, k = 20, one thread; `benchmarks/results/exact_vs_ivf.json`)
EXACT_MAX_ENTRIES = 20_000
KEYS_FILE = "keys.npy"
IVF_FILE = "index.faiss"
SCANN_DIR = "scann"
RECALL_SAMPLE = 200  # queries used to pick nprobe
RECALL_AT = 10
TRAIN_PER_LIST = 64  # k-means training points per inverted list
PQ_BITS = 8  # bits per sub-quantizer code: 256 centroids each, FAISS's fast path
PQ_DIMS_PER_CODE = 4  # key dimensions per sub-quantizer: 64 dims -> 16 bytes per key
PQ_TRAIN = 65_536  # training points for the PQ codebooks (>= 39 * 256 per sub-quantizer)
# PQ candidates re-scored exactly per neighbour asked for: on random 64-dim unit keys (the
# worst case: no structure for PQ to exploit) 16-byte codes find ~0.88 of the true top 10 in
# the best 40 candidates and ~0.98 in the best 100.
RERANK_FACTOR = 8


class KeyIndex(Protocol):
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [m, k], ids [m, k]) for float32 unit queries [m, dim], best first; ids are
        -1 where fewer than k keys exist."""
        ...


def choose_kind(kind: str, num_entries: int) -> str:
    if kind not in KINDS:
        raise UserError(f"unknown index {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "auto":
        return "exact" if num_entries <= EXACT_MAX_ENTRIES else "ivf"
    return kind


class ExactIndex:
    """Brute force: every key scored against the query (FAISS flat inner product, whose SIMD
    scan with a top-k heap is ~10x faster than a NumPy product and partial sort)."""

    def __init__(self, keys: np.ndarray) -> None:
        import faiss

        keys = np.ascontiguousarray(keys, dtype=np.float32)
        self.index = faiss.IndexFlatIP(keys.shape[1])
        self.index.add(keys)

    @classmethod
    def open(cls, folder: Path) -> ExactIndex:
        return cls(np.load(folder / KEYS_FILE, mmap_mode="r"))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return faiss_search(self.index, queries, k)


def faiss_search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) [n, k] of a FAISS index's search. A decode step's one query goes straight
    to the SWIG call, past the Python wrapper's checks and copies (~6 us of ~100 with the
    caches a forward leaves)."""
    import faiss

    queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    if len(queries) != 1:
        return index.search(queries, k)
    scores = np.empty((1, k), dtype=np.float32)
    ids = np.empty((1, k), dtype=np.int64)
    index.search_c(1, faiss.swig_ptr(queries), k, faiss.swig_ptr(scores), faiss.swig_ptr(ids))
    return scores, ids


class FaissIndex:
    """A FAISS index opened memory-mapped; `nprobe` applies to IVF indexes. `lists`: its lists
    as the drafting kernel reads them (`drafting.ivf_lists`: fp16 codes, inner product, nprobe
    <= 32; else None), for DReSD's query in one C call (`DenseDrafter`). Searched alone, the
    kernel costs what FAISS does with the caches a forward leaves
    (`benchmarks/results/exact_vs_ivf.json`), so `search` stays FAISS's."""

    def __init__(self, index, nprobe: int | None = None) -> None:
        self.index = index
        if nprobe is not None:
            index.nprobe = nprobe
        self.nprobe = int(getattr(index, "nprobe", 0))

    @functools.cached_property
    def lists(self) -> drafting.IvfLists | None:
        """Read on first use (a drafter's), not at open: a Python pass over every list (2.8 ms
        for the demo store's 1,193; ~4*sqrt(N) lists for N keys) that opening to inspect or
        append need not pay."""
        if not 1 <= self.nprobe <= drafting.MAX_PROBES:
            return None
        return drafting.ivf_lists(self.index)

    @classmethod
    def open(cls, folder: Path, nprobe: int | None) -> FaissIndex:
        import faiss

        return cls(faiss.read_index(str(folder / IVF_FILE), faiss.IO_FLAG_MMAP_IFC), nprobe)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return faiss_search(self.index, queries, k)


def ivf_num_lists(num_entries: int) -> int:
    """About 4 * sqrt(N) inverted lists, at least 1 and at most N / 39 (FAISS wants ~39
    training points per centroid)."""
    return max(1, min(int(round(4 * math.sqrt(num_entries))), num_entries // 39))


def build_ivf(keys: np.ndarray, folder: Path, recall_target: float = 0.9,
              seed: int = 0) -> dict:
    """Train, fill and write an IVF index (fp16 codes, inner product); pick nprobe for
    `recall_target` recall@10 on a sample of the keys as queries (their own entry excluded)."""
    import faiss

    n, dim = keys.shape
    nlist = ivf_num_lists(n)
    index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, nlist,
                                          faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    # 64 points per list trains k-means well enough (FAISS asks for >= 39) at a quarter of
    # the cost of FAISS's own cap of 256.
    _train_and_fill(index, keys, TRAIN_PER_LIST * nlist, rng)
    nprobe, recall = _choose_nprobe(index, keys, recall_target, rng)
    index.nprobe = nprobe
    faiss.write_index(index, str(folder / IVF_FILE))
    return {"index": "ivf", "nlist": nlist, "nprobe": nprobe, "recall_at_10": recall,
            "recall_target": recall_target, "codes": "fp16"}


def pq_subquantizers(dim: int) -> int:
    """About dim / PQ_DIMS_PER_CODE sub-quantizers; FAISS needs a divisor of `dim`."""
    m = max(1, dim // PQ_DIMS_PER_CODE)
    while dim % m:
        m -= 1
    return m


def build_ivfpq(keys: np.ndarray, folder: Path, recall_target: float = 0.9,
                seed: int = 0) -> dict:
    """Train, fill and write an IVF-PQ index (inner product); the fp16 keys must stay in
    `folder/keys.npy` for the re-ranking. nprobe is picked as for `ivf`, re-ranking included."""
    import faiss

    n, dim = keys.shape
    nlist = ivf_num_lists(n)
    m = pq_subquantizers(dim)
    # 8-bit codes need 256 training points per sub-quantizer; a tiny store gets fewer bits.
    bits = min(PQ_BITS, max(1, int(math.log2(n))))
    index = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, m, bits,
                             faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    # The codebooks want more points than the lists' k-means (256 centroids per sub-quantizer).
    _train_and_fill(index, keys, max(TRAIN_PER_LIST * nlist, PQ_TRAIN), rng)
    reranked = ReRankedIndex(index, keys, RERANK_FACTOR)
    nprobe, recall = _choose_nprobe(reranked, keys, recall_target, rng)
    index.nprobe = nprobe
    faiss.write_index(index, str(folder / IVF_FILE))
    return {"index": "ivfpq", "nlist": nlist, "nprobe": nprobe, "recall_at_10": recall,
            "recall_target": recall_target, "codes": f"pq{m}x{bits}",
            "pq_subquantizers": m, "pq_bits": bits, "rerank_factor": RERANK_FACTOR}


def _train_and_fill(index, keys: np.ndarray, train_size: int, rng: np.random.Generator) -> None:
    """Train `index` on a seeded sample of `keys`, then add all keys in blocks (the keys may be
    a memory map larger than RAM: only one block is converted to float32 at a time)."""
    n = len(keys)
    train = keys[np.sort(rng.choice(n, size=min(n, train_size), replace=False))]
    index.train(np.asarray(train, dtype=np.float32))
    for start in range(0, n, 1 << 18):
        index.add(np.asarray(keys[start : start + (1 << 18)], dtype=np.float32))


class ReRankedIndex:
    """An approximate FAISS index whose top `factor * k` candidates are re-scored exactly
    against `keys` (fp16, usually memory-mapped) and the best k kept. `nprobe` and `nlist`
    pass through to the FAISS index, so `_choose_nprobe` can tune it like a plain IVF."""

    def __init__(self, index, keys: np.ndarray, factor: int) -> None:
        self.index = index
        self.keys = keys
        self.factor = factor

    @classmethod
    def open(cls, folder: Path, settings: dict) -> ReRankedIndex:
        import faiss

        index = faiss.read_index(str(folder / IVF_FILE), faiss.IO_FLAG_MMAP_IFC)
        if settings.get("nprobe") is not None:
            index.nprobe = settings["nprobe"]
        return cls(index, np.load(folder / KEYS_FILE, mmap_mode="r"), settings["rerank_factor"])

    @property
    def nlist(self) -> int:
        return self.index.nlist

    @property
    def nprobe(self) -> int:
        return self.index.nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self.index.nprobe = value

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        _, candidates = self.index.search(queries, k * self.factor)
        # Only the candidates' rows of the (memory-mapped) keys are read; -1, FAISS's "no
        # candidate", reads row 0 and is scored -inf.
        rows = np.where(candidates >= 0, candidates, 0)
        vectors = np.asarray(self.keys[rows.ravel()], dtype=np.float32)
        scores = np.einsum("qcd,qd->qc", vectors.reshape(*rows.shape, -1), queries)
        scores = np.where(candidates >= 0, scores, -np.inf).astype(np.float32)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(candidates, order,
                                                                             axis=1)


def exact_neighbours(keys: np.ndarray, queries: np.ndarray, k: int,
                     block: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of each query's k nearest keys by exact inner product, best first; the
    keys (fp16, possibly a memory map larger than RAM) scanned a block at a time."""
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_ids = np.full((len(queries), k), -1, dtype=np.int64)
    for start in range(0, len(keys), block):
        rows = np.asarray(keys[start : start + block], dtype=np.float32)
        scores, ids = ExactIndex(rows).search(queries, k)
        merged_scores = np.concatenate([best_scores, scores], axis=1)
        merged_ids = np.concatenate([best_ids, ids + start], axis=1)
        order = np.argsort(-merged_scores, axis=1, kind="stable")[:, :k]
        best_scores = np.take_along_axis(merged_scores, order, axis=1)
        best_ids = np.take_along_axis(merged_ids, order, axis=1)
    return best_scores, best_ids


def _choose_nprobe(index, keys: np.ndarray, target: float,
                   rng: np.random.Generator) -> tuple[int, float]:
    n = len(keys)
    sample = np.sort(rng.choice(n, size=min(n, RECALL_SAMPLE), replace=False))
    queries = np.asarray(keys[sample], dtype=np.float32)
    k = min(RECALL_AT + 1, n)
    best_scores, best_ids = exact_neighbours(keys, queries, k)
    # Each query's own entry left out: its k - 1 nearest others, and the score of the last one.
    others = [row[row != q][: k - 1] for row, q in zip(best_ids, sample, strict=True)]
    floor = np.array([scores[row != q][: k - 1][-1] if len(t) else np.inf
                      for scores, row, q, t in zip(best_scores, best_ids, sample, others,
                                                   strict=True)], dtype=np.float32)
    nprobe, recall = 1, 0.0
    while True:
        index.nprobe = nprobe
        _, found = index.search(queries, k)
        hits = sum(_hits(keys, query, row[row != q][: len(t)], set(t.tolist()), least)
                   for query, row, q, t, least in zip(queries, found, sample, others, floor,
                                                      strict=True))
        recall = hits / max(1, sum(len(t) for t in others))
        if recall >= target or nprobe >= index.nlist:
            return nprobe, recall
        nprobe = min(nprobe * 2, index.nlist)


def _hits(keys: np.ndarray, query: np.ndarray, found: np.ndarray, truth: set[int],
          least: float) -> int:
    """Found neighbours that are true ones: in the exact top list, or scoring at least as high
    as its last entry (the usual tie rule of ANN benchmarks). Keys repeat in real stores (a
    chat template's positions are the same in every document), and among equal keys which
    ids the exact search lists is arbitrary: counting by id alone, no nprobe would ever reach
    the target on such a store, and the rule would end at probing every list."""
    found = found[found >= 0]
    rest = np.array([i for i in found.tolist() if i not in truth], dtype=np.int64)
    if len(rest) == 0:
        return len(found)
    scores = np.asarray(keys[np.sort(rest)], dtype=np.float32) @ query
    return len(found) - len(rest) + int(np.sum(scores >= least - 1e-5))  # rounding of sums


def build_scann(keys: np.ndarray, folder: Path, k: int = 50) -> dict:
    """ScaNN in its standard configuration: a partitioning tree (~sqrt(N) leaves, 10% searched),
    anisotropic asymmetric hashing (2 dims per block, threshold 0.2), exact reordering of the
    best 100."""
    scann = import_scann()
    n = len(keys)
    leaves = max(1, int(math.sqrt(n)))
    data = np.asarray(keys, dtype=np.float32)
    searcher = (scann.scann_ops_pybind.builder(data, k, "dot_product")
                .tree(num_leaves=leaves, num_leaves_to_search=max(1, leaves // 10),
                      training_sample_size=min(n, 250_000))
                .score_ah(2, anisotropic_quantization_threshold=0.2)
                .reorder(100).build())
    (folder / SCANN_DIR).mkdir()
    searcher.serialize(str(folder / SCANN_DIR))
    return {"index": "scann", "num_leaves": leaves, "leaves_to_search": max(1, leaves // 10)}


class ScannIndex:
    def __init__(self, searcher) -> None:
        self.searcher = searcher

    @classmethod
    def open(cls, folder: Path) -> ScannIndex:
        scann = import_scann()
        return cls(scann.scann_ops_pybind.load_searcher(str(folder / SCANN_DIR)))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        ids, scores = self.searcher.search_batched(queries, final_num_neighbors=k)
        return scores, ids.astype(np.int64)


def import_scann():
    try:
        import scann
    except ImportError as err:
        raise MissingPackageError("the ScaNN index needs the optional package: pip install "
                                  "'dresd[scann]' (wheels exist for Linux x86-64 only)") from err
    return scann


def build_index(kind: str, keys: np.ndarray, folder: Path, recall_target: float = 0.9) -> dict:
    """Build the index of `kind` (already resolved from `auto`) over `keys` into `folder`;
    returns its settings for the manifest. `exact` uses `keys.npy` as it is."""
    if kind == "exact":
        return {"index": "exact"}
    if kind == "ivf":
        return build_ivf(keys, folder, recall_target)
    if kind == "ivfpq":
        return build_ivfpq(keys, folder, recall_target)
    if kind == "scann":
        return build_scann(keys, folder)
    raise UserError(f"unknown index kind {kind!r}")


def open_index(folder: Path, settings: dict) -> KeyIndex:
    kind = settings["index"]
    if kind == "exact":
        return ExactIndex.open(folder)
    if kind == "ivf":
        return FaissIndex.open(folder, settings.get("nprobe"))
    if kind == "ivfpq":
        return ReRankedIndex.open(folder, settings)
    if kind == "scann":
        return ScannIndex.open(folder)
    raise DatastoreError(f"unknown index kind {kind!r} in the manifest")


def index_files(kind: str, folder: Path) -> list[str]:
    """The files an index of `kind` keeps in the datastore folder (relative names)."""
    if kind == "exact":
        return [KEYS_FILE]
    if kind == "ivf":
        return [IVF_FILE]
    if kind == "ivfpq":  # the re-ranking reads the fp16 keys
        return [IVF_FILE, KEYS_FILE]
    return sorted(str(p.relative_to(folder)) for p in (folder / SCANN_DIR).rglob("*")
                  if p.is_file())
