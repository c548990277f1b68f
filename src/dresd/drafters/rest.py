"""REST, retrieval-based speculative decoding (He et al., NAACL 2024): the sparse baseline.

At each step, with c the context (prompt + output so far, ending with the bonus token):

1. For n = max_suffix, ..., min_suffix (16 down to 2), look up the last n tokens of c in the
   corpus' suffix array. The first n with at least one match wins; none: no drafts.
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dresd.datastore.format import Manifest
from dresd.datastore.sparse import SparseIndex
from dresd.datastore.sparse_store import check_sparse_target, open_sparse_datastore
from dresd.drafters.base import Draft, DraftContext
from dresd.models import Target


@dataclass
class RestDrafter:
    datastore: SparseIndex | str | Path | None = None  # the index, or a datastore folder
    max_suffix: int = 16  # longest context suffix looked up
    min_suffix: int = 2  # shortest context suffix looked up
    max_matches: int = 5000  # k: continuations taken from the first matches in suffix order
    draft_len: int = 10  # tokens per continuation
    max_tree_nodes: int = 64  # draft-tree nodes kept (root not counted)
    name: str = "rest"
    manifest: Manifest | None = field(default=None, init=False, repr=False)  # None: bare index
    folder: str | Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.datastore is None:
            raise ValueError("REST needs a sparse datastore (--datastore DIR)")
        if not isinstance(self.datastore, SparseIndex):
            self.folder = self.datastore
            self.datastore, self.manifest = open_sparse_datastore(self.datastore)
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise ValueError("REST needs 1 <= min_suffix <= max_suffix")
        if self.max_matches < 1 or self.draft_len < 1 or self.max_tree_nodes < 1:
            raise ValueError("REST needs max_matches, draft_len and max_tree_nodes >= 1")

    def check_target(self, target: Target) -> None:
        """Refuse a target whose tokenizer did not build the datastore (the runner calls this)."""
        check_sparse_target(self.manifest, target, self.folder or "the datastore")

    def propose(self, context: DraftContext) -> list[Draft]:
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        index: SparseIndex = self.datastore
        tail = index.to_symbols(context.token_ids[-self.max_suffix :])
        # A token the corpus never has cannot be inside a match: look only after the last one.
        unknown = np.flatnonzero(tail < 0)
        longest = len(tail) - (unknown[-1] + 1 if len(unknown) else 0)
        for n in range(longest, self.min_suffix - 1, -1):
            lo, hi = index.match_rows(tail[-n:])
            if hi > lo:
                hi = min(hi, lo + self.max_matches)
                continuations = index.continuations(lo, hi, skip=n, length=draft_len)
                return [index.to_token_ids(d).tolist()
                        for d in most_frequent_prefixes(continuations, self.max_tree_nodes)]
        return []


def most_frequent_prefixes(continuations: np.ndarray, max_nodes: int) -> list[np.ndarray]:
    """The leaves of the trie of the `max_nodes` most frequent prefixes of `continuations`.

    `continuations`: int [m, L], rows sorted lexicographically, each row's tokens positive and
    followed by zeros (row i has length len_i = number of non-zero entries, at least 1).
    Prefixes are ranked by (count descending, length ascending, tokens ascending); see the module
    docstring. Returns the kept prefixes that no kept prefix extends, in rank order.

    Sorted rows make the trie explicit: the rows that share a prefix p of length d are a run of
    consecutive rows, so the nodes at depth d are the runs of rows with len_i >= d between the
    places where lcp(row i-1, row i) < d, and count(p) is the run's length.
    """
    m, width = continuations.shape
    lengths = (continuations != 0).sum(axis=1)
    differs = continuations[1:] != continuations[:-1]
    # lcp[i] = common prefix length of rows i-1 and i (lcp[0] = 0: row 0 starts every run).
    lcp = np.concatenate([[0], np.where(differs.any(axis=1), differs.argmax(axis=1), width)])

    node_depth, node_row, node_count = [], [], []
    for depth in range(1, width + 1):
        run_starts = np.flatnonzero(lcp < depth)
        run_sizes = np.diff(np.append(run_starts, m))
        real = lengths[run_starts] >= depth  # a run of rows that end before `depth` is no node
        node_depth.append(np.full(int(real.sum()), depth))
        node_row.append(run_starts[real])
        node_count.append(run_sizes[real])
    depth, row, count = (np.concatenate(a) for a in (node_depth, node_row, node_count))
    # The nodes are listed by depth, then by first row, which within one depth is token order:
    # the tie-break order already. So the ranking is a stable sort by count, of which only the
    # first max_nodes are needed: those above the max_nodes-th largest count, then the first
    # nodes listed at that count.
    if len(count) > max_nodes:
        threshold = np.partition(count, len(count) - max_nodes)[len(count) - max_nodes]
        above = np.flatnonzero(count > threshold)
        at = np.flatnonzero(count == threshold)[: max_nodes - len(above)]
        candidates = np.concatenate([above, at])
    else:
        candidates = np.arange(len(count))
    kept = candidates[np.argsort(-count[candidates], kind="stable")]

    # A kept node is a leaf of the kept trie when no kept node one deeper starts in its run.
    kd, kr, kc = depth[kept], row[kept], count[kept]
    child = (kd[None, :] == kd[:, None] + 1) & (kr[None, :] >= kr[:, None]) & (
        kr[None, :] < (kr + kc)[:, None])
    leaves = [continuations[r, :d] for d, r, has_child in zip(kd, kr, child.any(axis=1),
                                                              strict=True) if not has_child]
    return leaves

