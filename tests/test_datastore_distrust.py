"""Damaged datastore arrays (RELIABILITY.md, "Damaged GGUF files"): what `kernels/drafting.c`
reads of a store is checked once where it is opened (`drafting.dense_store`,
`drafting.rest_index`: one `DamagedStore` error), and the kernel itself skips an id or a
position outside the arrays it was handed. `test_gguf_distrust` runs these under ASan."""

from __future__ import annotations

import numpy as np
import pytest

from dresd.datastore.sparse import sparse_in_memory
from dresd.kernels import drafting

pytestmark = pytest.mark.skipif(drafting.kernel() is None, reason="no C drafting kernel")


def dense_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    stream = np.arange(100, dtype=np.uint32) % 7
    offsets = np.arange(0, 90, dtype=np.uint32)
    return offsets, stream, np.array([0, 40, 100], dtype=np.int64)


@pytest.mark.parametrize("damage", ["offset past the stream", "negative offset",
                                    "documents past the stream", "documents decreasing"])
def test_a_dense_store_whose_arrays_do_not_fit_is_one_error(damage):
    offsets, stream, doc_starts = dense_arrays()
    if damage == "offset past the stream":
        offsets[5] = 1000
    elif damage == "negative offset":
        offsets = offsets.astype(np.int64)
        offsets[5] = -3
    elif damage == "documents past the stream":
        doc_starts[-1] = 200
    else:
        doc_starts[1] = 120
    with pytest.raises(drafting.DamagedStore, match="damaged"):
        drafting.dense_store(offsets, stream, doc_starts, value_len=8)


def test_the_dense_kernel_skips_ids_outside_the_store():
    store = drafting.dense_store(*dense_arrays(), value_len=8)
    inside = drafting.dense_drafts(np.array([3, 10]), store, bonus=4, draft_len=4)
    # ids the index should never give (a store whose index and offsets disagree)
    outside = drafting.dense_drafts(np.array([3, 90, 10**9, -1, 10]), store, bonus=4,
                                    draft_len=4)
    assert np.array_equal(outside, inside)


@pytest.mark.parametrize("damage", ["suffix past the stream", "negative suffix",
                                    "suffix inside a symbol", "symbol past the alphabet"])
def test_a_sparse_store_whose_arrays_do_not_fit_is_one_error(damage):
    tokens = np.concatenate([np.arange(300), [5, 6, 7, 5, 6]])  # 2-byte symbols
    index = sparse_in_memory(tokens, np.array([0, 150, len(tokens)]))
    symbols, suffix_array = index.symbols.copy(), index.suffix_array.copy()
    width = symbols.dtype.itemsize
    assert width == 2
    if damage == "suffix past the stream":
        suffix_array[2] = symbols.nbytes + width
    elif damage == "negative suffix":
        suffix_array[2] = -width
    elif damage == "suffix inside a symbol":
        suffix_array[2] += 1
    else:
        symbols[3] = len(index.alphabet) + 1
    with pytest.raises(drafting.DamagedStore, match="damaged"):
        drafting.rest_index(symbols, suffix_array, index.symbol_table(), index.alphabet)
