"""Small corpora for the sparse datastore and REST tests."""

from __future__ import annotations

import numpy as np

SEP = -1  # the brute-force stream's document separator: below every token id, like symbol 0


def concat(docs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(token stream, document offsets) as `build_sparse` takes them."""
    tokens = np.array([t for doc in docs for t in doc], dtype=np.int64)
    offsets = np.cumsum([0] + [len(doc) for doc in docs])
    return tokens, offsets


def random_docs(rng: np.random.Generator, ids: np.ndarray, num_docs: int, max_len: int,
                ) -> list[list[int]]:
    return [rng.choice(ids, size=rng.integers(0, max_len + 1)).tolist() for _ in range(num_docs)]
