"""Draft budgets priced by the whole step's forward: speculation never costs throughput.

A step's forward costs cost(R) one-token steps for R rows in all (the machine's curve,
`calibrate.py`): every sequence's root row, its draft nodes, and any prompt chunk. A draft
node v pays when the tokens it is expected to add beat what its row costs the whole batch.

    reach(v)   = P(v is on the accepted path)
               = reach(parent) * a(method, depth(v), rank(v))
    a(...)     = accepted / tried over the nodes verified so far whose parent was accepted
                 (rank: 0 for a parent's first child in the drafter's order, 1, 2+ after it),
                 with a prior of PRIOR_ACCEPTED / PRIOR_TRIED
    expected tokens of a step with node set S = (decoding sequences) + sum_{v in S} reach(v)
    S*         = argmax over S = the k highest-reach nodes of every tree together, k = 0, 1, ..
                 of expected tokens / cost(fixed rows + k)

Sorting every candidate of the batch by reach and taking a prefix keeps each tree closed under
parents (a child's reach never exceeds its parent's; ties go to the shallower node), so what
stays is a set of root paths. With k = 0 every sequence is a plain decoding row: a draft that
the curve says will not pay is not verified, alone or under load. Each sequence's own
acceptance statistics are its method's (`method` is the drafter's name): they are learned by
the engine from every tree it verifies, so they follow the prompts being served.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from dresd.decoding.tree import DraftTree

PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 3.0  # a new (method, depth, rank) starts at 1/3
MAX_DEPTH_BUCKET = 8  # depths past this share one estimate
MAX_RANK_BUCKET = 2  # third and later siblings share one estimate


class AcceptanceEstimates:
    """a(method, depth, rank): how often a drafted node is accepted when its parent was."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int, int], list[float]] = defaultdict(
            lambda: [PRIOR_ACCEPTED, PRIOR_TRIED])

    @staticmethod
    def _cell(method: str, tree: DraftTree, node: int) -> tuple[str, int, int]:
        parent = tree.parents[node]
        rank = list(tree.children[parent].values()).index(node)
        return (method, min(tree.depths[node], MAX_DEPTH_BUCKET), min(rank, MAX_RANK_BUCKET))

    def reach(self, method: str, tree: DraftTree) -> list[float]:
        """reach(v) for every node of `tree` (the root: 1)."""
        reach = [1.0] * len(tree)
        for node in range(1, len(tree)):  # parents come before children
            accepted, tried = self.counts[self._cell(method, tree, node)]
            reach[node] = reach[tree.parents[node]] * accepted / tried
        return reach

    def observe(self, method: str, tree: DraftTree, path: list[int]) -> None:
        """Count the verified tree: every child of an accepted node was tried."""
        on_path = set(path)
        for node in range(1, len(tree)):
            if tree.parents[node] in on_path:
                counts = self.counts[self._cell(method, tree, node)]
                counts[0] += node in on_path
                counts[1] += 1


def batch_budget(reaches: list[list[float]], fixed_rows: int, decoding: int,
                 cost: Callable[[int], float]) -> list[set[int]]:
    """The draft nodes worth verifying in this step, per tree (node indices, root excluded).

    `reaches[i]`: reach(v) of tree i's nodes (node 0 the root); `fixed_rows`: rows the step
    has whatever is drafted (roots, prompt chunks); `decoding`: sequences that emit tokens this
    step (each emits at least one); `cost(rows)`: the forward's cost in one-token steps.
    """
    # highest reach first; among equals, the lower node index (a parent before its children)
    ranked = sorted((-reach[node], node, tree) for tree, reach in enumerate(reaches)
                    for node in range(1, len(reach)))
    gains = np.cumsum([-negative for negative, _, _ in ranked])
    expected = decoding + np.concatenate(([0.0], gains))
    costs = np.array([cost(fixed_rows + k) for k in range(len(ranked) + 1)])
    best = int(np.argmax(expected / costs))  # the first maximum: on ties, the smaller step
    kept: list[set[int]] = [set() for _ in reaches]
    for _, node, tree in ranked[:best]:
        kept[tree].add(node)
    return kept


def restrict(tree: DraftTree, kept: set[int]) -> DraftTree:
    """`tree` with only the nodes in `kept` (closed under parents) and the root, renumbered in
    the original order, so that a parent still precedes its children."""
    order = [0] + sorted(kept)
    index = {old: new for new, old in enumerate(order)}
    pruned = DraftTree(tokens=[], parents=[], depths=[], children=[])
    for old in order:
        pruned.tokens.append(tree.tokens[old])
        parent = tree.parents[old]
        pruned.parents.append(index[parent] if parent >= 0 else -1)
        pruned.depths.append(tree.depths[old])
        pruned.children.append({})
        if parent >= 0:
            pruned.children[index[parent]][tree.tokens[old]] = index[old]
    return pruned
