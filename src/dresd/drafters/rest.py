"""REST, retrieval-based speculative decoding (He et al., NAACL 2024): the sparse baseline.

At each step, with c the context (prompt + output so far, ending with the bonus token):

1. The longest n in min_suffix..max_suffix (2..16) whose last n tokens of c occur in the
   corpus' suffix array wins (REST tries n from 16 down; a binary search finds the same n in
   ~4 lookups, since a match of n tokens holds one of n - 1); none: no drafts.
2. The first `max_matches` (k = 5000) matches in suffix-array order (REST takes them in that
   order too) each give a continuation: the up to `draft_len` (10) corpus tokens after the match,
   cut at the end of its document.
3. Every prefix of every continuation is counted: count(p) = number of continuations starting
   with p.
4. The `max_tree_nodes` (64) prefixes ranked first by (count descending, length ascending,
   token ids lexicographically ascending) are kept. count(p) >= count(p + [t]) and a prefix is
   shorter than its extensions, so every kept prefix's own prefixes rank before it and are kept:
   the kept prefixes form a trie, the draft tree. (REST breaks ties at the cut-off in hash-map
   order; the stated order makes the tree deterministic.)
5. The drafts are the kept prefixes that no other kept prefix extends (the trie's leaves), in
   rank order; the engine merges them back into the same trie.

Where this differs from REST's code (FasterDecoding/REST, DraftRetriever), and why:
- REST concatenates the corpus without separators, so its continuations can run into the next
  document; here they stop at the document's end (the datastore keeps document bounds).
- REST takes an occurrence at the very end of its data as a match with an empty continuation;
  here a match needs a next token (in its document), so such an occurrence neither counts
  towards k nor decides n.
- REST cuts the corpus into sub-indexes of 512M tokens and takes up to k matches from each;
  here there is one suffix array, so k matches in all.
- Ties at the 64-node cut-off: REST's order is a hash map's; here the stated order.

With `learn` (`--learn`), each finished output also goes into an in-memory side store
(`learned.py`), searched as one more sub-index: step 1 takes the longest suffix that matches in
either store, step 2 up to k matches from each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dresd.datastore.format import Manifest
from dresd.datastore.sparse import SparseIndex
from dresd.datastore.sparse_store import check_sparse_target, open_sparse_datastore
from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.drafters.learned import LearnedSparseStore, merged_prefix_drafts
from dresd.drafters.prefixes import most_frequent_prefixes
from dresd.errors import UserError
from dresd.kernels import drafting
from dresd.models.target import Target


@dataclass(frozen=True)
class RestOptions:
    """RestDrafter's options (`--rest-*`, `--draft-len`, `--max-tree-nodes`, `--learn`)."""

    datastore: SparseIndex | str | Path | None = None  # a datastore folder, or an opened index
    max_suffix: int = 16  # longest context suffix looked up
    min_suffix: int = 2  # shortest context suffix looked up
    max_matches: int = 5000  # k: continuations taken from the first matches in suffix order
    draft_len: int = 10  # tokens per continuation
    max_tree_nodes: int = 64  # draft-tree nodes kept (root not counted)
    learn: bool = False  # also search the outputs of earlier generations (in memory)
    max_cached_requests: int = 1000  # learned outputs kept, oldest evicted first...
    max_cached_tokens: int = 100_000  # ... and learned tokens kept

    def __post_init__(self) -> None:
        if self.datastore is None:
            raise UserError("REST needs a sparse datastore (--datastore DIR)")
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise UserError("REST needs 1 <= min_suffix <= max_suffix")
        if self.max_matches < 1 or self.draft_len < 1 or self.max_tree_nodes < 1:
            raise UserError("REST needs max_matches, draft_len and max_tree_nodes >= 1")


class RestDrafter(RestOptions, Drafter):
    """Its options, the suffix array it opened and (with `learn`) the outputs it learned."""

    name = "rest"
    index: SparseIndex  # the datastore's suffix array
    manifest: Manifest | None  # None: a bare index given to it, or a folder without one
    learned: LearnedSparseStore | None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.datastore, SparseIndex):
            self.index, self.manifest = self.datastore, None
        else:
            self.index, self.manifest = open_sparse_datastore(self.datastore)
        self.learned = (LearnedSparseStore(self.max_cached_requests, self.max_cached_tokens)
                        if self.learn else None)
        index = self.index  # as the C kernel reads it (None: no kernel), once
        self._index_in_c = (drafting.rest_index(index.symbols, index.suffix_array,
                                                index.symbol_table(), index.alphabet)
                            if drafting.kernel() is not None else None)

    def check_target(self, target: Target) -> None:
        """Refuse a target whose tokenizer did not build the datastore (the runner calls this)."""
        opened = isinstance(self.datastore, SparseIndex)
        check_sparse_target(self.manifest, target, "the datastore" if opened else self.datastore)

    def with_options(self, **options) -> RestDrafter:
        """Another shape over the same opened suffix array and its manifest, so that it checks
        a target as this drafter does (its learned outputs its own)."""
        variant = dataclasses.replace(self, **{"datastore": self.index, **options})
        variant.manifest = self.manifest
        return variant

    def propose(self, context: DraftContext) -> list[Draft]:
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        indexes: list[SparseIndex] = [self.index]
        if self.learned is not None and self.learned.index is not None:
            indexes.append(self.learned.index)
        if len(indexes) == 1 and self._index_in_c is not None:  # steps 1-5 in one C call
            return drafting.rest_lookup(self._index_in_c, context.token_ids[-self.max_suffix :],
                                        self.min_suffix, self.max_matches, draft_len,
                                        self.max_tree_nodes)
        # Steps 1 and 2: the longest suffix with a match in any store, and its matches there.
        found = [longest_match(index, context.token_ids, self.min_suffix, self.max_suffix)
                 for index in indexes]
        n = max(length for length, _ in found)
        if n == 0:
            return []
        blocks = [(index, index.continuations(lo, min(hi, lo + self.max_matches), skip=n,
                                              length=draft_len))
                  for index, (length, (lo, hi)) in zip(indexes, found, strict=True) if length == n]
        if len(blocks) == 1:
            index, continuations = blocks[0]
            return [index.to_token_ids(d).tolist()
                    for d in most_frequent_prefixes(continuations, self.max_tree_nodes)]
        return merged_prefix_drafts(blocks, self.max_tree_nodes)

    def observe(self, prompt: list[int], output: list[int], hidden_states=None) -> None:
        """A generation finished: with `learn`, its output joins the side store."""
        if self.learned is not None:
            self.learned.add(output)


def longest_match(index: SparseIndex, token_ids: np.ndarray, min_suffix: int, max_suffix: int
                  ) -> tuple[int, tuple[int, int]]:
    """(n, its suffix-array rows) for the longest n in [min_suffix, max_suffix] whose last n
    tokens of `token_ids` occur in `index` followed by a token; (0, (0, 0)) if none does.

    A match of the last n tokens holds one of the last n - 1 (the same occurrence, one token
    later), so "has a match" is monotone in n: a binary search finds the longest in ~4 lookups
    instead of REST's up to 15."""
    tail = index.to_symbols(token_ids[-max_suffix:])
    unknown = np.flatnonzero(tail < 0)  # a token the corpus never has cannot be inside a match
    lo, hi = min_suffix, len(tail) - (unknown[-1] + 1 if len(unknown) else 0)
    best: tuple[int, tuple[int, int]] = (0, (0, 0))
    while lo <= hi:  # invariant: every n < lo matches (or is below min_suffix), none > hi does
        n = (lo + hi) // 2
        rows = index.match_rows(tail[-n:])
        if rows[1] > rows[0]:
            best, lo = (n, rows), n + 1
        else:
            hi = n - 1
    return best
