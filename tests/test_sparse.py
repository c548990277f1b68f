"""The suffix array and its lookups, held against brute force on random token streams."""

from __future__ import annotations

import numpy as np
import pytest
from corpus_helpers import SEP, concat, random_docs

from dresd.datastore.sparse import SparseIndex, build_sparse


def brute_force_suffix_order(docs: list[list[int]], key_len: int | None = None) -> list[int]:
    """Start positions of the stream's suffixes in lexicographic order, by Python's own list
    ordering. The stream is every document followed by SEP. With `key_len`, suffixes are compared
    on their first `key_len` tokens only, and the keys are checked to be distinct (so the order
    they give is the full order)."""
    stream = [t for doc in docs for t in [*doc, SEP]]
    keys = [tuple(stream[i : i + key_len] if key_len else stream[i:]) for i in range(len(stream))]
    if key_len:
        assert len(set(keys)) == len(keys), "key_len too short to order these suffixes"
    return sorted(range(len(stream)), key=keys.__getitem__)


@pytest.mark.parametrize(
    "case, width",
    [
        ("four ids, long repeats", 1),
        ("500 ids above 65,535", 2),
        ("over 65,535 distinct ids up to 200,000", 4),
    ],
)
def test_suffix_array_matches_brute_force(tmp_path, case, width):
    rng = np.random.default_rng(len(case))
    key_len = None
    if width == 1:
        docs = random_docs(rng, np.arange(4), num_docs=30, max_len=80)
    elif width == 2:
        docs = random_docs(rng, rng.choice(np.arange(65_000, 300_000), 500, replace=False), 40, 60)
    else:
        # So many distinct ids need 4-byte symbols; random suffixes differ within a few tokens.
        docs = random_docs(rng, np.arange(200_000), num_docs=400, max_len=500)
        key_len = 6
    index = build_sparse(*concat(docs), tmp_path)
    assert index.width == width
    assert index.suffix_array.dtype == np.int32
    positions = index.suffix_array.astype(np.int64) // index.width
    assert positions.tolist() == brute_force_suffix_order(docs, key_len)


def test_stream_round_trips_through_symbols(tmp_path):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, np.array([3, 70_000, 123_456, 2**31 - 1]), num_docs=20, max_len=30)
    index = build_sparse(*concat(docs), tmp_path)
    for d, doc in enumerate(docs):
        start, end = index.doc_starts[d], index.doc_starts[d + 1]
        assert index.symbols[end - 1] == 0  # the separator
        assert index.to_token_ids(index.symbols[start : end - 1]).tolist() == doc
    assert index.num_tokens == sum(len(doc) for doc in docs)
    assert index.num_documents == len(docs)


def brute_force_occurrences(docs: list[list[int]], query: list[int]) -> set[tuple[int, int]]:
    """(document, offset) of every occurrence of `query` with a token after it in its document."""
    n = len(query)
    return {(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - n)
            if doc[i : i + n] == query}


def test_lookup_finds_every_occurrence(tmp_path):
    rng = np.random.default_rng(2)
    ids = np.array([0, 1, 2, 65_535, 65_536, 99_999])
    docs = random_docs(rng, ids, num_docs=25, max_len=120)
    index = build_sparse(*concat(docs), tmp_path)
    queries = [rng.choice(ids, size=rng.integers(1, 6)).tolist() for _ in range(200)]
    queries += [doc[-3:] for doc in docs if len(doc) >= 3]  # document ends: no continuation
    found_any = 0
    for query in queries:
        found = index.occurrences(query)
        assert len(found) == len(set(found))
        assert set(found) == brute_force_occurrences(docs, query)
        found_any += bool(found)
    assert found_any > 50  # the check is not vacuous


def test_64_bit_suffix_array_gives_the_same_lookups(tmp_path):
    """Streams past 2 GiB get an int64 suffix array and libdivsufsort's 64-bit search; the same
    search on a small stream, with its suffix array widened, must find the same rows."""
    rng = np.random.default_rng(3)
    docs = random_docs(rng, np.array([1, 2, 3, 70_000]), num_docs=10, max_len=200)
    index = build_sparse(*concat(docs), tmp_path)
    wide = SparseIndex(index.alphabet, index.symbols, index.suffix_array.astype(np.int64),
                       index.doc_starts)
    for _ in range(50):
        query = index.to_symbols(rng.choice([1, 2, 3, 70_000], size=rng.integers(1, 5)))
        assert wide.match_rows(query) == index.match_rows(query)
    assert any(index.match_rows(index.to_symbols([1, 2])))


def test_lookup_of_ids_the_corpus_lacks(tmp_path):
    index = build_sparse(*concat([[5, 6, 5, 6, 7], [], [6, 5]]), tmp_path)
    assert index.occurrences([5, 6]) == [(0, 0), (0, 2)]
    assert index.occurrences([8]) == []
    assert index.occurrences([6, 8]) == []
    assert index.occurrences([7]) == []  # at the end of its document: nothing follows it
    assert index.to_symbols([4, 5, 7, 8]).tolist() == [-1, 1, 3, -1]
    assert index.to_symbols([-3, 7, 10**9]).tolist() == [-1, 3, -1]  # outside the id table


def test_continuations_stop_at_the_document_end(tmp_path):
    index = build_sparse(*concat([[1, 2, 3, 4], [1, 2, 9]]), tmp_path)
    lo, hi = index.match_rows(index.to_symbols([1, 2]))
    rows = index.continuations(lo, hi, skip=2, length=4)
    tokens = [index.to_token_ids(row[row > 0]).tolist() for row in rows]
    assert tokens == [[3, 4], [9]]  # suffix order: 3 < 9


def test_open_is_memory_mapped_and_checks_files(tmp_path):
    build_sparse(*concat([[1, 2, 3]]), tmp_path / "store")
    index = SparseIndex.open(tmp_path / "store")
    assert isinstance(index.suffix_array, np.memmap)
    assert isinstance(index.symbols, np.memmap)
    (tmp_path / "store" / "suffix_array.npy").unlink()
    with pytest.raises(FileNotFoundError, match="suffix_array.npy"):
        SparseIndex.open(tmp_path / "store")


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="doc_offsets"):
        build_sparse(np.array([1, 2, 3]), np.array([0, 2]), tmp_path)
    with pytest.raises(ValueError, match=">= 0"):
        build_sparse(np.array([1, -2]), np.array([0, 2]), tmp_path)
