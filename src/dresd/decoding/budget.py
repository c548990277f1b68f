"""Draft budgets priced by the whole step's forward: speculation never costs throughput.

A step's forward costs cost(R) one-token steps for R rows in all (the machine's curve,
`calibrate.py`): every sequence's root row, its draft nodes, and any prompt chunk. A draft
node v pays when the tokens it is expected to add beat what its row costs the whole batch.

    reach(v)   = P(v is on the accepted path)
               = reach(parent) * a(method, depth(v), rank(v))
    a(...)     = accepted / tried over the nodes drafted so far whose parent was accepted,
                 verified or cut by the budget (rank: 0 for a parent's first child in the
                 drafter's order, 1, 2+ after it), with a prior of PRIOR_ACCEPTED / PRIOR_TRIED
    expected tokens of a step with node set S = (decoding sequences) + sum_{v in S} reach(v)
    S*         = argmax over S = the k highest-reach nodes of every tree together, k = 0, 1, ..
                 of expected tokens / cost(fixed rows + k)

Drafting itself takes time, and under load that time is the whole batch's: while one sequence
drafts, every other waits. So before a sequence drafts, its method's record in this engine
decides whether drafting pays at all (`DraftingLedger`):

    draft iff  gain(method) / seconds(method)  >=  B / (cost(B) * unit)

gain = accepted draft tokens per drafted step, seconds = its drafting time per step plus what
its draft rows added to the forward (cost(R) - cost(R - drafted rows), in seconds; both running
averages), B = sequences in the step, unit = seconds per cost unit (the measured
forward seconds over cost(rows)). The right side is the batch's tokens per second without
drafts; drafting pays when its tokens come faster than that. A method is always consulted for
its first steps, and where the rule says no, at probes that keep its record current. Alone in
its step, a sequence probes at every PROBE_EVERY-th step (0 included): a probe delays no one
else, and how much drafts pay changes along an answer. Beside others, its step s is a probe when
s > 0 and s is a multiple of PROBE_EVERY * 2^m, where m counts the method's probes in a row
that still said no (at most MAX_BACKOFF): there a probe's drafting holds up every stream, and
a drafter that catches up on a context it has not read costs more (suffix reads the prompt
into its trie, ~10 ms for 100 tokens). Under a load where drafts cannot pay, a few probes in a
row say no, and the method's sequences then probe every 64th step.

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

from dresd.decoding.tree import DraftTree


class CostCurve:
    """cost(rows) of a measured curve (`cost_at`), each size worked out once: the batch budget
    asks for every size from a step's fixed rows up to all its candidates', at every step, and
    `cost_at` sorts the curve and scans it on each call (a 100-node tree's budget took ~0.1 ms
    a step with the caches a forward leaves)."""

    def __init__(self, curve: dict[int, float]) -> None:
        self.curve = curve
        self.table: list[float] = []  # table[rows] = cost_at(curve, rows)

    def __call__(self, rows: int) -> float:
        table = self.table
        if rows >= len(table):
            table.extend(cost_at(self.curve, size) for size in range(len(table), rows + 1))
        return table[rows]


def cost_at(curve: dict[int, float], size: int) -> float:
    """cost(size) from a measured curve: linear between points, the last slope beyond them."""
    sizes = sorted(curve)
    if size in curve:
        return curve[size]
    if size < sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if lo < size < hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (size - lo) / (hi - lo)
    lo, hi = sizes[-2:] if len(sizes) > 1 else (sizes[0], sizes[0])
    slope = (curve[hi] - curve[lo]) / (hi - lo) if hi > lo else 0.0
    return curve[hi] + slope * (size - hi)


PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 3.0  # a new (method, depth, rank) starts at 1/3
# Cut nodes count too (`observe`): had only the verified ones counted, a deep cell the budget
# never kept would never have moved off 1/3, whatever its true rate. Prompt lookup on code is
# accepted deep into its copies: on HumanEval type hints it ran at 1.70x AR so, 1.82-1.84x now,
# 1.94-1.99x with no budget (`benchmarks/results/budget_estimates/`).
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
        """reach(v) for every node of `tree` (the root: 1). One pass over each parent's
        children, ranks counted on the way, and one lookup per cell: `_cell` for every node
        lists its siblings to find its rank (a 100-node tree's budget took ~0.1 ms a step with
        the caches a forward leaves)."""
        reach = [1.0] * len(tree)
        depths, counts = tree.depths, self.counts
        looked_up: dict[tuple[int, int], list[float]] = {}
        for parent, children in enumerate(tree.children):  # parents come before children
            for rank, node in enumerate(children.values()):
                cell = (min(depths[node], MAX_DEPTH_BUCKET), min(rank, MAX_RANK_BUCKET))
                found = looked_up.get(cell)
                if found is None:
                    found = looked_up[cell] = counts[(method, *cell)]
                reach[node] = reach[parent] * found[0] / found[1]
        return reach

    def observe(self, method: str, tree: DraftTree, emitted: list[int]) -> None:
        """Count a drafted tree against the tokens its step emitted (the accepted drafts, then
        the target's own token): every child of a node the emitted tokens reach was tried, and
        accepted if its token is the one emitted after its parent. That is what verification
        decided for the nodes it saw, and what it would have for the nodes the budget cut."""
        node = 0
        for token in emitted:
            children = tree.children[node]
            for child in children.values():
                counts = self.counts[self._cell(method, tree, child)]
                counts[0] += tree.tokens[child] == token
                counts[1] += 1
            node = children.get(token, -1)
            if node < 0:
                return


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
    if isinstance(cost, CostCurve):  # its sizes worked out once, read as one slice
        cost(fixed_rows + len(ranked))
        costs = cost.table[fixed_rows : fixed_rows + len(ranked) + 1]
    else:
        costs = [cost(fixed_rows + k) for k in range(len(ranked) + 1)]
    # expected tokens / cost for the k best, k = 0, 1, ...: a plain loop, not numpy's cumsum,
    # concatenate, division and argmax (~80 us for a 100-node tree with the caches a forward
    # leaves, against ~30); the same sums in the same order
    best, best_ratio, gained = 0, decoding / costs[0], 0.0
    for k, (negative, _, _) in enumerate(ranked, start=1):
        gained += -negative
        ratio = (decoding + gained) / costs[k]
        if ratio > best_ratio:  # the first maximum: on ties, the smaller step
            best, best_ratio = k, ratio
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


WARMUP_STEPS = 4  # a method drafts at its first steps in an engine, whatever its record
PROBE_EVERY = 8  # and at probes, every 8th step of a sequence while drafting pays, ...
MAX_BACKOFF = 3  # ... and up to every 64th (8 * 2^3) after probes in a row that did not
AVERAGE_WEIGHT = 0.1  # weight of the newest step in the running averages


class DraftingLedger:
    """Per method: how many draft tokens a drafted step gains and how long drafting takes,
    and the seconds one unit of the cost curve takes on this machine now."""

    def __init__(self) -> None:
        self.gain: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.steps: dict[str, int] = defaultdict(int)
        self.misses: dict[str, int] = defaultdict(int)  # probes in a row that said no
        self.unit_seconds: float | None = None

    @staticmethod
    def _average(table: dict[str, float], key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + AVERAGE_WEIGHT * (value - old)

    def record_draft(self, method: str, accepted: int, seconds: float) -> None:
        self.steps[method] += 1
        self._average(self.gain, method, accepted)
        self._average(self.seconds, method, seconds)

    def record_forward(self, seconds: float, cost_units: float) -> None:
        unit = seconds / cost_units
        self.unit_seconds = unit if self.unit_seconds is None else (
            self.unit_seconds + AVERAGE_WEIGHT * (unit - self.unit_seconds))

    def worth_drafting(self, method: str, sequence_step: int, batch: int,
                       cost: Callable[[int], float]) -> bool:
        """Whether a sequence of `method` drafts at its `sequence_step`-th step in a step of
        `batch` sequences (the rule in the module doc)."""
        if self.steps[method] < WARMUP_STEPS or self.unit_seconds is None:
            return True
        seconds = max(self.seconds[method], 1e-9)
        if self.gain[method] * cost(batch) * self.unit_seconds >= batch * seconds:
            self.misses[method] = 0
            return True
        if batch == 1:  # a probe delays no other stream: every 8th step, the first included
            return sequence_step % PROBE_EVERY == 0
        interval = PROBE_EVERY << min(self.misses[method], MAX_BACKOFF)
        probe = sequence_step > 0 and sequence_step % interval == 0
        self.misses[method] += probe
        return probe
