"""Nearest-neighbour search: planted neighbours are found by every backend."""

from __future__ import annotations

import numpy as np
import pytest

from dresd.datastore import index as key_index
from dresd.kernels import drafting


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def planted(n: int = 6000, dim: int = 32, seed: int = 0):
    """Random unit keys, and queries each planted right next to one known key."""
    rng = np.random.default_rng(seed)
    keys = unit(rng.normal(size=(n, dim)))
    targets = rng.choice(n, size=min(n, 40), replace=False)
    queries = unit(keys[targets] + 0.05 * rng.normal(size=(len(targets), dim)))
    return keys.astype(np.float16), targets, queries


def test_choose_kind_by_size():
    assert key_index.choose_kind("auto", 1000) == "exact"
    assert key_index.choose_kind("auto", key_index.EXACT_MAX_ENTRIES + 1) == "ivf"
    assert key_index.choose_kind("ivf", 10) == "ivf"
    with pytest.raises(ValueError, match="unknown index"):
        key_index.choose_kind("hnsw", 10)


def test_exact_finds_planted_neighbours_in_order():
    keys, targets, queries = planted()
    scores, ids = key_index.ExactIndex(keys).search(queries, 5)
    assert np.array_equal(ids[:, 0], targets)
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first


def test_exact_pads_when_k_exceeds_entries():
    keys, _, queries = planted(n=3)
    _, ids = key_index.ExactIndex(keys).search(queries[:1], 5)
    assert sorted(ids[0, :3].tolist()) == [0, 1, 2] and ids[0, 3:].tolist() == [-1, -1]


def test_ivf_finds_planted_neighbours_and_records_nprobe(tmp_path):
    keys, targets, queries = planted()
    settings = key_index.build_index("ivf", keys, tmp_path, recall_target=0.9)
    assert settings["nlist"] == key_index.ivf_num_lists(len(keys))
    assert 1 <= settings["nprobe"] <= settings["nlist"]
    assert settings["recall_at_10"] >= 0.9
    index = key_index.open_index(tmp_path, settings)  # memory-mapped
    _, ids = index.search(queries, 10)
    found = np.mean([t in row for t, row in zip(targets, ids, strict=True)])
    assert found >= 0.9
    for query, batch_scores, batch_ids in zip(queries[:20], *index.search(queries[:20], 10),
                                              strict=True):  # one query: the direct call
        scores, one = index.search(query, 10)
        assert np.array_equal(one[0], batch_ids) and np.array_equal(scores[0], batch_scores)


def ivf_fp16(keys: np.ndarray, nlist: int, by_residual: bool, centroids: np.ndarray | None = None):
    """FAISS's IVF index with fp16 codes by inner product, as `build_ivf` makes it; with
    `centroids`, those as its lists' (no k-means)."""
    import faiss

    dim = keys.shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    if centroids is not None:
        quantizer.add(centroids)
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16,
                                          faiss.METRIC_INNER_PRODUCT, by_residual)
    index.train(keys)
    index.add(keys)
    return index


def assert_same_neighbours(faiss_result, kernel_result):
    """The same scores (up to a sum's order) and the same ids, except which of the entries
    tied with the k-th score made the list (ties are common: stores repeat keys)."""
    (faiss_scores, faiss_ids), (scores, ids) = faiss_result, kernel_result
    assert np.allclose(scores, faiss_scores, rtol=0, atol=1e-5)
    assert np.array_equal(ids == -1, faiss_ids == -1)
    clear = faiss_scores > faiss_scores[-1] + 1e-5  # above the k-th score's ties
    assert sorted(ids[clear].tolist()) == sorted(faiss_ids[clear].tolist())


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler: FAISS searches")
@pytest.mark.parametrize("by_residual", [True, False])
@pytest.mark.parametrize("dim", [32, 20])  # 20: lanes of 8 and a tail
def test_the_kernels_ivf_search_is_faisss(by_residual, dim):
    """On random keys with repeats, every nprobe from 1 to the kernel's most, k beyond what
    the probed lists hold: the neighbours FAISS finds in the same index."""
    rng = np.random.default_rng(dim)
    keys = unit(rng.normal(size=(3000, dim)))
    keys[1000:1300] = keys[0]  # 300 equal keys: ties at every k
    index = ivf_fp16(keys, 40, by_residual)
    lists = drafting.ivf_lists(index)
    queries = np.concatenate([unit(rng.normal(size=(30, dim))),
                              unit(keys[:10] + 0.05 * rng.normal(size=(10, dim)))])
    for nprobe in (1, 3, drafting.MAX_PROBES):
        index.nprobe = nprobe
        for k in (10, 200):
            for query in queries:
                scores, ids = index.search(query[None, :], k)
                assert_same_neighbours((scores[0], ids[0]),
                                       drafting.ivf_search(query, lists, nprobe, k))


@pytest.mark.skipif(drafting.kernel() is None, reason="no C compiler: FAISS searches")
def test_the_kernel_probes_the_lists_float32_ranks_first_at_half_precision_ties():
    """Centroids closer together than half precision tells apart: the lists their halves
    rank first are mostly not float32's, and only the float32 re-scoring within the rounding
    bound picks the lists FAISS probes (each list holds keys no other holds, so another list
    finds other ids)."""
    rng = np.random.default_rng(1)
    dim, nlist = 16, 64
    centroids = unit(unit(rng.normal(size=dim)) + 1e-4 * rng.normal(size=(nlist, dim)))
    keys = unit(rng.normal(size=(4000, dim)))
    index = ivf_fp16(keys, nlist, by_residual=False, centroids=centroids)
    lists = drafting.ivf_lists(index)
    queries = unit(centroids[0] + 0.5 * rng.normal(size=(40, dim)))
    halves = centroids.astype(np.float16).astype(np.float32)
    first = [np.argmax(halves @ query) != np.argmax(centroids @ query) for query in queries]
    assert sum(first) >= 10  # the halves' best list is often not float32's
    compared = 0
    for nprobe in (1, 4, 8):
        index.nprobe = nprobe
        for query in queries:
            coarse = np.sort(centroids @ query)[::-1]
            if coarse[nprobe - 1] - coarse[nprobe] < 1e-6:
                continue  # lists tied in float32 too: either may be probed
            scores, ids = index.search(query[None, :], 50)
            assert_same_neighbours((scores[0], ids[0]), drafting.ivf_search(query, lists,
                                                                            nprobe, 50))
            compared += 1
    assert compared >= 100
