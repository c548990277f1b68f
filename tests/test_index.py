"""Nearest-neighbour search: planted neighbours are found by every backend."""

from __future__ import annotations

import numpy as np
import pytest

from dresd.datastore import index as key_index


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


def test_num_lists_is_about_four_sqrt_n():
    assert key_index.ivf_num_lists(1_000_000) == 4000
    assert key_index.ivf_num_lists(100) == 2  # capped so each list has ~39 training points


def test_scann_finds_planted_neighbours(tmp_path):
    pytest.importorskip("scann", reason="ScaNN is optional: pip install 'dresd[scann]'")
    keys, targets, queries = planted()
    settings = key_index.build_index("scann", keys, tmp_path)
    _, ids = key_index.open_index(tmp_path, settings).search(queries, 10)
    assert np.mean([t in row for t, row in zip(targets, ids, strict=True)]) >= 0.9
