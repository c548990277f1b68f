"""Stores that learn online (`--learn`): what the model just said, searched beside a datastore.

`LearnedSparseStore` keeps the outputs of finished generations, oldest evicted first once more
than `max_requests` outputs or `max_tokens` tokens are held, as an in-memory suffix array (the
same structure as the on-disk sparse datastore, rebuilt after each output: O(N log N) for N
held tokens, a few milliseconds for 100k). Memory: (w + 4) bytes per held token, w = 1, 2 or 4
bytes per symbol (`datastore/sparse.py`), plus the token lists themselves.

REST searches it as one more sub-index, as REST itself does when a corpus is split into several
suffix arrays: up to k matches from each, their continuations counted together.

`LearnedDenseStore` keeps DReSD keys for finished outputs: the key of output token j is the
datastore's transform of the hidden state that predicted it, which the verify passes already
computed (the loop hands them to `observe`), so learning costs no forward. Its value is the
output from token j on, so that, as on disk, value[0] is the token the keyed state predicted.
Search is exact (inner product on unit keys, FAISS flat); memory: 4 * dim + 16 bytes per held
token (dim = the transform's PCA dimension, 64 by default: 272 bytes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from dresd.datastore.sparse import SparseIndex, sparse_in_memory
from dresd.drafters.prefixes import most_frequent_prefixes
from dresd.errors import UserError


class LearnedSparseStore:
    def __init__(self, max_requests: int = 1000, max_tokens: int = 100_000) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise UserError("a learned store needs max_requests and max_tokens >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.num_tokens = 0
        self.index: SparseIndex | None = None  # None until the first output

    def add(self, output: Sequence[int]) -> None:
        """Keep one finished output (its last `max_tokens` tokens), evicting the oldest."""
        output = [int(t) for t in output][-self.max_tokens :]
        if not output:
            return
        self.outputs.append(output)
        self.num_tokens += len(output)
        while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self.outputs.popleft())
        tokens = np.fromiter((t for out in self.outputs for t in out), dtype=np.int64,
                             count=self.num_tokens)
        offsets = np.cumsum([0] + [len(out) for out in self.outputs])
        self.index = sparse_in_memory(tokens, offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of the suffix-array side (the token lists add ~8 bytes per token in lists)."""
        return 0 if self.index is None else self.index.nbytes


def merged_prefix_drafts(blocks: list[tuple[SparseIndex, np.ndarray]], max_nodes: int
                         ) -> list[list[int]]:
    """REST's tree over continuations from several suffix arrays, each with its own alphabet.

    `blocks`: (index, symbols [m, L] as `SparseIndex.continuations` returns them). Symbols become
    token ids + 1 (0 still ends a row), rows are sorted lexicographically, and the most frequent
    prefixes are ranked as for one store (ids ascending break ties, as symbols do there)."""
    rows = []
    for index, symbols in blocks:
        ids = index.alphabet[np.maximum(symbols, 1) - 1] + 1
        rows.append(np.where(symbols > 0, ids, 0))
    width = max(r.shape[1] for r in rows)
    padded = np.concatenate([np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows])
    padded = padded[np.lexsort(padded.T[::-1])]
    return [(leaf - 1).tolist() for leaf in most_frequent_prefixes(padded, max_nodes)]


class LearnedDenseStore:
    def __init__(self, transform, max_requests: int = 1000, max_tokens: int = 100_000) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise UserError("a learned store needs max_requests and max_tokens >= 1")
        self.transform = transform  # the datastore's KeyTransform: keys comparable to its own
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.outputs: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (token ids, keys)
        self.num_tokens = 0
        self.tokens = np.zeros(0, dtype=np.int64)  # the held outputs, one after another
        self.doc_ends = np.zeros(0, dtype=np.int64)  # entry e's value stops at doc_ends[e]
        self.index = None  # FAISS flat inner-product index over the held keys

    def add(self, output: Sequence[int], states: np.ndarray) -> None:
        """Keep one output and the hidden states [len(output), d] that predicted its tokens."""
        if len(states) != len(output):
            raise ValueError(f"{len(output)} output tokens but {len(states)} hidden states")
        output = np.asarray(output, dtype=np.int64)[-self.max_tokens :]
        states = np.asarray(states, dtype=np.float32)[-self.max_tokens :]
        if len(output) == 0:
            return
        self.outputs.append((output, self.transform.apply(states).astype(np.float32)))
        self.num_tokens += len(output)
        while len(self.outputs) > self.max_requests or self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self.outputs.popleft()[0])
        import faiss

        self.tokens = np.concatenate([out for out, _ in self.outputs])
        self.doc_ends = np.repeat(np.cumsum([len(out) for out, _ in self.outputs]),
                                  [len(out) for out, _ in self.outputs])
        keys = np.ascontiguousarray(np.concatenate([k for _, k in self.outputs]))
        self.index = faiss.IndexFlatIP(keys.shape[1])
        self.index.add(keys)

    def search(self, key: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, entry ids) of the k nearest held keys to a transformed query `key` [dim]."""
        if self.index is None:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        scores, ids = self.index.search(key[None, :].astype(np.float32), k)
        valid = ids[0] >= 0
        return scores[0][valid], ids[0][valid]

    def value(self, entry: int, length: int) -> np.ndarray:
        """The up to `length` tokens from entry's own token on, within its output."""
        return self.tokens[entry : min(entry + length, self.doc_ends[entry])]

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.doc_ends.nbytes + 4 * self.num_tokens * (
            self.transform.dim)
