"""A draft tree of at most N nodes from many continuations: their N most frequent prefixes.

REST picks its tree this way (and DReSD does with a node budget): count(p) = the number of
continuations that start with p, and the N prefixes ranked first by (count descending, length
ascending, tokens ascending) are kept. count(p) >= count(p + [t]) and a prefix is shorter than its
extensions, so every kept prefix's own prefixes rank before it and are kept too: the kept prefixes
form a trie, and its leaves are the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dresd.kernels import drafting


def prefix_tree_drafts(continuations: Sequence[Sequence[int]], max_nodes: int) -> list[list[int]]:
    """The leaves of the trie of the `max_nodes` most frequent prefixes, for token-id lists.

    Repeats count: five neighbours that continue alike make that continuation five times as
    likely to be kept. Empty continuations are ignored.
    """
    rows = [list(c) for c in continuations if len(c) > 0]
    if not rows:
        return []
    # Shift ids by one so that 0 marks a row's end.
    padded = np.zeros((len(rows), max(map(len, rows))), dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = np.asarray(row, dtype=np.int64) + 1
    return padded_prefix_tree(padded, max_nodes)


def padded_prefix_tree(padded: np.ndarray, max_nodes: int) -> list[list[int]]:
    """`prefix_tree_drafts` of rows of token ids + 1 followed by zeros (rows of zeros: empty
    continuations, ignored), in any order: in C where it is compiled (it sorts and ranks in one
    call), else sorted here and ranked by `most_frequent_prefixes`."""
    if len(padded) == 0:
        return []
    if drafting.kernel() is not None:
        leaves = drafting.frequent_prefixes(padded, max_nodes)
    else:
        leaves = most_frequent_prefixes(padded[np.lexsort(padded.T[::-1])], max_nodes)
    return [(leaf - 1).tolist() for leaf in leaves]


def most_frequent_prefixes(continuations: np.ndarray, max_nodes: int) -> list[np.ndarray]:
    """The leaves of the trie of the `max_nodes` most frequent prefixes of `continuations`.

    `continuations`: int [m, L], rows sorted lexicographically, each row's tokens positive and
    followed by zeros (row i has length len_i = number of non-zero entries; a row of zeros, an
    empty continuation, makes no node).
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

    # Every depth at once (one numpy call per operation, not one per depth: drafting runs
    # with caches the verify forward just evicted, where each call costs microseconds):
    # starts[d - 1, i] says that row i starts a run at depth d.
    starts = lcp[None, :] < np.arange(1, width + 1)[:, None]
    level, row = np.nonzero(starts)  # by depth, then by row
    following = np.append(row[1:], m)  # the next run's first row, if at the same depth
    same_level = np.append(level[1:] == level[:-1], False)
    count = np.where(same_level, following, m) - row
    real = lengths[row] > level  # a run of rows that end before its depth is no node
    depth, row, count = level[real] + 1, row[real], count[real]
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
