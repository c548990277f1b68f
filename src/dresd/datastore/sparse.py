"""The sparse datastore: a suffix array over a corpus' token ids, for REST's exact-match lookups.

What is stored (three plain `.npy` files, opened memory-mapped):

- `alphabet.npy`   int64 [a]: the distinct token ids of the corpus, sorted. Token id
                   `alphabet[s - 1]` is written as the symbol `s` (1..a); symbol 0 ends a document.
                   Ranks keep the order of the ids, so suffix order over symbols is suffix order
                   over token ids, and a corpus that uses fewer than 65,535 distinct ids needs two
                   bytes per token whatever the vocabulary size (Llama 3, Qwen and Gemma exceed
                   65,535 ids; REST's own library stops there).
- `symbols.npy`    the stream: every document's symbols followed by a 0, as big-endian unsigned
                   integers of w = 1, 2 or 4 bytes (the fewest that hold a). Big-endian makes the
                   byte order of two w-byte symbols their numeric order, so the stream's bytes,
                   compared from a w-aligned offset, order the suffixes exactly as the symbols do.
- `suffix_array.npy` int32 (int64 past 2 GiB) [N]: the byte offsets w*i of the stream's
                   N = tokens + documents suffixes, sorted by suffix. Built by libdivsufsort (via
                   `pydivsufsort`, O(n log n)) on the stream's bytes, keeping the w-aligned ones.
- `doc_starts.npy` int64 [documents + 1]: where each document starts in the stream; the last
                   entry is the stream's length.

Bytes per corpus token: w + 4 (+ w + 4 per document for the separators).

Why the separator: a lookup never contains symbol 0, so no match runs across a document boundary,
and a continuation is cut at the first 0. Because 0 is the smallest symbol, among the suffixes
that start with a query q those with q at the very end of a document come first: one more search
for q + [0] finds and skips them, so every match returned has at least one continuation token.

Build memory: libdivsufsort sorts the w*N byte suffixes, so the build holds 4*w*N bytes (8*w*N
past 2 GiB of stream) beside the stream: about 80 MB for 10M tokens with w = 2. Corpora of
billions of tokens would want an integer-alphabet construction (e.g. libsais) instead.

The search is libdivsufsort's `sa_search` (compiled binary search over the suffix array) called
through ctypes on the memory-mapped arrays: no Python loop runs per comparison.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydivsufsort
from pydivsufsort.dll import PATH_LIBDIVSUFSORT, PATH_LIBDIVSUFSORT64

SEPARATOR = 0  # the symbol that ends every document
FILES = ("alphabet.npy", "symbols.npy", "suffix_array.npy", "doc_starts.npy")


def _load_sa_search(path: Path, index: type, name: str):
    """libdivsufsort's `sa_search(T, Tsize, P, Psize, SA, SAsize, &left) -> count` with explicit
    argument types. We open our own handle on pydivsufsort's library so these argument types do
    not change the functions pydivsufsort itself calls."""
    function = getattr(ctypes.CDLL(str(path)), name)
    function.argtypes = [ctypes.c_void_p, index, ctypes.c_char_p, index, ctypes.c_void_p, index,
                         ctypes.POINTER(index)]
    function.restype = index
    return function


_SA_SEARCH32 = _load_sa_search(PATH_LIBDIVSUFSORT, ctypes.c_int32, "sa_search")
_SA_SEARCH64 = _load_sa_search(PATH_LIBDIVSUFSORT64, ctypes.c_int64, "sa_search64")


def symbol_dtype(num_symbols: int) -> np.dtype:
    """Big-endian unsigned dtype of 1, 2 or 4 bytes holding symbols 0 .. num_symbols - 1."""
    for width in (1, 2, 4):
        if num_symbols <= 1 << (8 * width):
            return np.dtype(f">u{width}")
    raise ValueError(f"{num_symbols} distinct symbols do not fit in 32 bits")


def build_sparse(token_ids: np.ndarray, doc_offsets: np.ndarray, folder: str | Path) -> SparseIndex:
    """Write the suffix array of a tokenised corpus into `folder` and open it.

    `token_ids`: the documents' token ids, concatenated (any non-negative integers).
    `doc_offsets`: int [documents + 1], increasing from 0 to len(token_ids); document d is
    `token_ids[doc_offsets[d] : doc_offsets[d + 1]]`.
    The caller makes the folder appear atomically (the datastore format's job, not this module's).
    """
    index = sparse_in_memory(token_ids, doc_offsets)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "alphabet.npy", index.alphabet)
    np.save(folder / "symbols.npy", index.symbols)
    np.save(folder / "suffix_array.npy", index.suffix_array)
    np.save(folder / "doc_starts.npy", index.doc_starts)
    return SparseIndex.open(folder)


def sparse_in_memory(token_ids: np.ndarray, doc_offsets: np.ndarray) -> SparseIndex:
    """The suffix array of a tokenised corpus, held in memory (arguments as `build_sparse`)."""
    token_ids = np.asarray(token_ids)
    doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
    if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
        raise ValueError("token_ids must be a 1-D integer array")
    if (doc_offsets.ndim != 1 or len(doc_offsets) < 2 or doc_offsets[0] != 0
            or doc_offsets[-1] != len(token_ids) or np.any(np.diff(doc_offsets) < 0)):
        raise ValueError("doc_offsets must increase from 0 to len(token_ids)")
    if len(token_ids) and token_ids.min() < 0:
        raise ValueError("token ids must be >= 0")

    # Ranks: symbol = 1 + rank of the id among the corpus' distinct ids (order-preserving).
    alphabet, ranks = np.unique(token_ids.astype(np.int64), return_inverse=True)
    dtype = symbol_dtype(len(alphabet) + 1)
    num_docs = len(doc_offsets) - 1
    # Document d's token j lands at stream position doc_offsets[d] + d + j (d separators before it).
    doc_of_token = np.repeat(np.arange(num_docs), np.diff(doc_offsets))
    stream = np.zeros(len(token_ids) + num_docs, dtype=dtype)
    stream[np.arange(len(token_ids)) + doc_of_token] = ranks + 1
    doc_starts = np.append(doc_offsets[:-1] + np.arange(num_docs), len(stream))

    # libdivsufsort sorts the byte suffixes; the w-aligned ones are the symbol suffixes, in order.
    byte_offsets = pydivsufsort.divsufsort(stream.view(np.uint8))
    if dtype.itemsize > 1:
        byte_offsets = byte_offsets[byte_offsets % dtype.itemsize == 0]
    index_dtype = np.int32 if stream.nbytes <= np.iinfo(np.int32).max else np.int64
    suffix_array = byte_offsets.astype(index_dtype, copy=False)
    return SparseIndex(alphabet, stream, suffix_array, doc_starts)


@dataclass
class SparseIndex:
    """A memory-mapped suffix array over a corpus: exact-match lookups and their continuations."""

    alphabet: np.ndarray  # int64 [a]: sorted distinct token ids; symbol s is alphabet[s - 1]
    symbols: np.ndarray  # big-endian uint [N]: the stream, documents separated by 0
    suffix_array: np.ndarray  # int32/int64 [N]: byte offsets of the suffixes, sorted by suffix
    doc_starts: np.ndarray  # int64 [documents + 1]: document starts in the stream, then N
    _symbol_of: np.ndarray | None = field(default=None, init=False, repr=False)  # id -> symbol

    @classmethod
    def open(cls, folder: str | Path) -> SparseIndex:
        folder = Path(folder)
        missing = [name for name in FILES if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} is not a sparse datastore: missing {', '.join(missing)}")
        arrays = {name[:-4]: np.load(folder / name, mmap_mode="r") for name in FILES}
        index = cls(**arrays)
        if len(index.suffix_array) != len(index.symbols):
            raise ValueError(f"{folder}: suffix array and stream lengths differ")
        return index

    @property
    def width(self) -> int:
        """Bytes per symbol (w)."""
        return self.symbols.dtype.itemsize

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        """Corpus tokens, separators not counted."""
        return len(self.symbols) - self.num_documents

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.alphabet, self.symbols, self.suffix_array,
                                      self.doc_starts))

    def symbol_table(self) -> np.ndarray:
        """int64 [max id + 2]: each token id's symbol, -1 for ids the corpus never has (the
        last entry, -1, also stands for every id beyond the table)."""
        if self._symbol_of is None:
            # One lookup per id instead of a binary search over the alphabet: a drafting step
            # finds the alphabet evicted from the caches by the verify forward.
            self._symbol_of = np.full(int(self.alphabet.max(initial=-1)) + 2, -1, np.int64)
            self._symbol_of[self.alphabet] = np.arange(1, len(self.alphabet) + 1)
        return self._symbol_of

    def to_symbols(self, token_ids: np.ndarray) -> np.ndarray:
        """Symbols of `token_ids`; ids that never occur in the corpus become -1."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        table = self.symbol_table()
        # Ids beyond the table (and negative ones) read its last entry, which is -1.
        inside = np.where((token_ids >= 0) & (token_ids < len(table)), token_ids, -1)
        return table[inside]

    def to_token_ids(self, symbols: np.ndarray) -> np.ndarray:
        """Token ids of non-zero symbols."""
        return self.alphabet[np.asarray(symbols, dtype=np.int64) - 1]

    def _search(self, pattern: np.ndarray) -> tuple[int, int]:
        """(first row, count) of the suffixes that start with `pattern` (symbols, none negative)."""
        if len(self.symbols) == 0:
            return 0, 0
        pattern_bytes = pattern.astype(self.symbols.dtype).tobytes()
        large = self.suffix_array.dtype == np.int64
        search, index = (_SA_SEARCH64, ctypes.c_int64) if large else (_SA_SEARCH32, ctypes.c_int32)
        left = index(0)
        count = search(self.symbols.ctypes.data, self.symbols.nbytes, pattern_bytes,
                       len(pattern_bytes), self.suffix_array.ctypes.data, len(self.suffix_array),
                       ctypes.byref(left))
        if count < 0:
            raise RuntimeError(f"libdivsufsort sa_search failed ({count})")
        return left.value, count

    def match_rows(self, query_symbols: np.ndarray) -> tuple[int, int]:
        """Suffix-array rows [lo, hi) of the occurrences of `query_symbols` that are followed by
        at least one token of the same document, in suffix order. (0, 0) when there are none."""
        query_symbols = np.asarray(query_symbols)
        if len(query_symbols) == 0 or query_symbols.min() <= 0:
            return 0, 0  # empty, or holds a token the corpus never has
        left, count = self._search(query_symbols)
        if count == 0:
            return 0, 0
        # Occurrences at a document's end are the suffixes q + [0]: the first rows of the range.
        _, at_end = self._search(np.append(query_symbols, SEPARATOR))
        return left + at_end, left + count

    def continuations(self, lo: int, hi: int, skip: int, length: int) -> np.ndarray:
        """Symbols [hi - lo, length]: the `length` symbols after the first `skip` of each suffix in
        rows lo..hi-1, with 0 from the document's end on. Rows keep suffix order, so the result is
        sorted lexicographically (0 being the smallest symbol keeps it sorted after the cut)."""
        starts = self.suffix_array[lo:hi].astype(np.int64) // self.width + skip
        positions = np.minimum(starts[:, None] + np.arange(length), len(self.symbols) - 1)
        # The stream ends with a 0, so a position clipped to the last one reads a 0.
        block = self.symbols[positions].astype(np.int64)
        return block * np.minimum.accumulate(block != SEPARATOR, axis=1)

    def occurrences(self, token_ids: np.ndarray) -> list[tuple[int, int]]:
        """(document, offset) of every occurrence of `token_ids` followed by at least one token of
        its document, in suffix order."""
        query = np.asarray(token_ids)
        lo, hi = self.match_rows(self.to_symbols(query))
        positions = self.suffix_array[lo:hi].astype(np.int64) // self.width
        docs = np.searchsorted(self.doc_starts, positions, side="right") - 1
        return list(zip(docs.tolist(), (positions - self.doc_starts[docs]).tolist(), strict=True))
