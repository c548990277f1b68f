"""The IVF-PQ index: PQ codes in memory-mapped IVF lists, re-ranked exactly on fp16 keys."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_targets import tiny_target, word_corpus

from dresd.corpus import CorpusSpec
from dresd.datastore import dense
from dresd.datastore import index as key_index
from dresd.datastore.format import read_manifest


def unit_keys(n: int, dim: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def exact_top(keys: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(queries @ keys.astype(np.float32).T), axis=1)[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth,
                                                                          strict=True)]))


@pytest.fixture(scope="module")
def pq_folder(tmp_path_factory):
    """An IVF-PQ index over 5k random 64-dim unit keys, with its keys.npy beside it."""
    folder = tmp_path_factory.mktemp("ivfpq")
    keys = unit_keys(5_000, 64)
    np.save(folder / key_index.KEYS_FILE, keys)
    mapped = np.load(folder / key_index.KEYS_FILE, mmap_mode="r")
    settings = key_index.build_index("ivfpq", mapped, folder, recall_target=0.9)
    return folder, keys, settings


def test_ivfpq_settings_in_the_manifest(pq_folder):
    folder, keys, settings = pq_folder
    assert settings["index"] == "ivfpq"
    assert settings["nlist"] == key_index.ivf_num_lists(5_000)
    assert 1 <= settings["nprobe"] <= settings["nlist"]
    assert settings["recall_at_10"] >= 0.9
    assert settings["pq_subquantizers"] == 16 and settings["pq_bits"] == 8
    assert settings["codes"] == "pq16x8" and settings["rerank_factor"] >= 1
    assert key_index.index_files("ivfpq", folder) == [key_index.IVF_FILE, key_index.KEYS_FILE]
    # 16 bytes of code + 8 of id per key (+ ~100 kB of centroids) against 128 bytes of fp16 key.
    assert (folder / key_index.IVF_FILE).stat().st_size < 0.4 * keys.nbytes


def test_ivfpq_recall_at_10_against_exact_search(pq_folder):
    folder, keys, settings = pq_folder
    index = key_index.open_index(folder, settings)  # memory-mapped lists and keys
    assert isinstance(index.keys, np.memmap)
    queries = unit_keys(100, 64, seed=1).astype(np.float32)
    scores, ids = index.search(queries, 10)
    assert recall(ids, exact_top(keys, queries, 10)) >= 0.85  # fresh queries, not the sample
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first, by exact inner product
    exact_scores = np.einsum("qkd,qd->qk", keys[ids].astype(np.float32), queries)
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-5, atol=1e-6)


def test_ivfpq_pads_with_minus_one_when_candidates_run_out(tmp_path):
    keys = unit_keys(300, 16)
    np.save(tmp_path / key_index.KEYS_FILE, keys)
    settings = key_index.build_index("ivfpq", keys, tmp_path)
    assert settings["pq_bits"] == 8 and settings["pq_subquantizers"] == 4
    index = key_index.open_index(tmp_path, settings)
    index.nprobe = 1
    scores, ids = index.search(keys[:2].astype(np.float32), 299)
    assert (ids == -1).any() and np.isneginf(scores[ids == -1]).all()
    assert ids[0, 0] == 0 and ids[1, 0] == 1  # a key's nearest key is itself


def test_subquantizers_divide_the_dimensions():
    assert key_index.pq_subquantizers(64) == 16
    assert key_index.pq_subquantizers(30) == 6
    assert key_index.pq_subquantizers(3) == 1


def test_dense_store_with_ivfpq_opens_and_searches(tmp_path):
    corpus = word_corpus(tmp_path / "corpus.jsonl")
    store = dense.build_dense(tiny_target(), CorpusSpec([str(corpus)]), tmp_path / "store",
                              dense.DenseBuildConfig(pca_dim=16, index="ivfpq", chunk_tokens=256,
                                                     sample_min=100, sample_fraction=0.0),
                              progress=False)
    settings = read_manifest(store).settings
    assert settings["index"] == "ivfpq" and (store / "keys.npy").exists()
    opened = dense.DenseDatastore(store)
    assert isinstance(opened.index, key_index.ReRankedIndex)
    assert opened.index.nprobe == settings["nprobe"]
    # Random states are far from the corpus's own (the sample nprobe was tuned on): probe every
    # list, so that what is checked is the PQ scan and the exact re-ranking.
    opened.index.nprobe = opened.index.nlist
    keys = np.load(store / "keys.npy").astype(np.float32)
    states = np.random.default_rng(0).normal(size=(20, 64)).astype(np.float32)
    queries = opened.transform.apply(states)
    # A random model over a repetitive corpus stores many equal keys, so ids tie: count a
    # found entry as right when its exact score reaches the exact 10th best score.
    tenth = np.sort(queries @ keys.T, axis=1)[:, -10]
    found = [keys[opened.search(s, 10)] @ q for s, q in zip(states, queries, strict=True)]
    hits = [np.mean(f >= t - 1e-3) for f, t in zip(found, tenth, strict=True)]
    assert np.mean(hits) >= 0.9


def test_repeated_keys_do_not_push_nprobe_to_every_list(tmp_path):
    """A fifth of a chat store's keys are the template's, equal in every document. Among equal
    keys which ids exact search lists is arbitrary, so a recall counted by id stays low however
    many lists are probed; the nprobe rule counts a neighbour scoring as high as the 10th true
    one as found, and so stops where a store without repeats would."""
    rng = np.random.default_rng(1)
    distinct = unit_keys(4_000, 64, seed=2)
    template = distinct[rng.choice(len(distinct), 40, replace=False)]  # 40 positions, 25 copies
    keys = np.concatenate([distinct, np.repeat(template, 25, axis=0)])[rng.permutation(5_000)]
    np.save(tmp_path / key_index.KEYS_FILE, keys)
    mapped = np.load(tmp_path / key_index.KEYS_FILE, mmap_mode="r")
    settings = key_index.build_index("ivfpq", mapped, tmp_path, recall_target=0.9)
    assert settings["recall_at_10"] >= 0.9
    assert settings["nprobe"] < settings["nlist"]
    # and on the same keys, exact search's own answer scores as recall 1
    query = np.asarray(template[:1], dtype=np.float32)[0]
    top = exact_top(keys, query[None, :], 10)[0]
    least = float((keys[top].astype(np.float32) @ query).min())
    copies = np.flatnonzero((keys == template[0]).all(axis=1))
    others = [int(i) for i in copies if i not in set(top.tolist())][:10]
    assert key_index._hits(keys, query, np.array(others), set(top.tolist()), least) == len(others)
