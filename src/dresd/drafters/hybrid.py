"""Hybrid: one draft tree from every drafter's candidates, cut at each step where it pays most.

No single drafter wins everywhere: prompt lookup where the answer copies the prompt, dense
retrieval with an in-domain store, REST in between; and the tree size that pays depends on the
machine's verify-cost curve. At every step this drafter:

1. Collects candidates: PLD's drafts, SuffixDecoding's tree (over this request and earlier
   outputs), REST's most frequent prefixes and every DReSD neighbour's draft (whichever the
   datastore holds), merged into one trie rooted at the bonus token. Each source gives them
   with their features (`Drafter.candidates`: DReSD how many neighbours propose each draft,
   SuffixDecoding each token's count share), so hybrid treats every source alike; a source's
   name is one more feature of the nodes it proposes.
2. Gives each node v an acceptance estimate. p(v) = P(v accepted | its parent accepted) is read
   from a table of Beta posteriors keyed by the node's features: which sources propose it, how
   many dense neighbours agree on it (0, 1, 2-3, 4+), its depth (1, 2, 3, 4+), whether it is
   the first choice among its siblings (the most candidates of any source pass through it),
   and, where SuffixDecoding proposes it, the share of its parent's occurrences that continue
   with it (count(s + [t]) / count(s): under 0.4, under 0.8, more):

       p(cell) = (accepted(cell) + s * prior(cell)) / (tried(cell) + s),  s = prior_strength

   Siblings are exclusive (one token comes next), so their p are scaled to sum to at most 1.
   P(v) = p(v) * P(parent): the probability that verification reaches v.
3. Keeps the tree that maximises expected tokens per unit of verify cost. A node's P is never
   above its parent's, so the n most probable nodes form a tree; with cost(t) the measured
   cost of verifying t tokens, in decode steps (`dresd.calibrate`):

       n* = argmax_n  (1 + sum of the n largest P) / cost(n + 1)

   n = 0 is plain decoding (ratio 1): when no candidate is worth its cost, nothing is drafted.
4. Learns: the next call's context holds the tokens the step emitted (the accepted path and the
   bonus token), so every candidate whose parent lay on that path is an observation, verified
   or not: accepted if its token is the one that came. The table persists across generations
   of one drafter, so a bench or a server calibrates it on its own workload.

5. Consults only the sources that pay for their time (`SourceLedger`): a source whose share of
   the accepted tokens (those lost without it) falls below its share of the step's time is
   left out, one source at a time, and every few steps all are consulted again. Under load the
   shares are of the batch's tokens and time, since one sequence's drafting holds up all of
   them. This needs a one-token step's seconds (the calibration measures them); where they
   are unknown every source is consulted at every step.

Where the drafting kernel is compiled and the sources are the four above (REST and DReSD keeping
no outputs in memory, DReSD's store an IVF index it searches), steps 1-4 are one kernel call,
the sources' lookups included (`_step_in_c`, `drafting.hybrid_step`): the same drafts and
counts as the sources asked one by one (a test holds it), ~50 us less a step with the caches a
forward leaves. Only the suffix drafter's trie of earlier outputs stays Python, and comes in as
candidates.

Learning from finished outputs (`learn`): by default SuffixDecoding's global trie keeps them, as
`--method suffix` does; with `learn=True` (`--learn`) REST and DReSD also keep them in their
in-memory side stores (`learned.py`), so a request that comes back drafts its earlier output
from every source; `learn=False` (`--no-learn`): no source keeps anything.

The priors are deliberately mild guesses (agreement between sources and neighbours helps, depth
hurts); `prior_strength` = 4 observations, so a few steps of this workload override them.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import json
import math
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from dresd.calibrate import cached_step_seconds, cost_table, load_or_measure
from dresd.datastore.format import read_manifest
from dresd.datastore.sparse_store import kinds
from dresd.decoding.drafter import Candidate, Draft, DraftContext, Drafter
from dresd.drafters.dense import DenseDrafter
from dresd.drafters.lookup import PromptLookupDrafter
from dresd.drafters.mtp import MTPDrafter
from dresd.drafters.rest import RestDrafter
from dresd.drafters.suffix import SuffixDrafter
from dresd.errors import UserError
from dresd.kernels import drafting
from dresd.models.mtp import MultiTokenPredictor
from dresd.models.target import Target


class Cell(NamedTuple):
    """The features a node's acceptance is learned by: nodes of one cell share a posterior."""

    sources: tuple[str, ...]  # the sources that propose the node, sorted
    support: int  # retrieved neighbours agreeing on it (DReSD's), bucketed (`support_bucket`)
    depth: int  # its depth in the tree, 4 for 4 and deeper
    first: bool  # whether it is the child most candidates pass through among its siblings
    share: int  # the best count share a source gave it, bucketed; -1: none gave one


def support_bucket(neighbours: int) -> int:
    """0, 1, 2-3, 4+ dense neighbours agreeing on a node -> 0, 1, 2, 3."""
    return 0 if neighbours == 0 else 1 if neighbours == 1 else 2 if neighbours < 4 else 3


def share_bucket(share: float) -> int:
    """SuffixDecoding's count(s + [t]) / count(s) for a node -> 0 (< 0.4), 1, 2 (>= 0.8)."""
    return 0 if share < 0.4 else 1 if share < 0.8 else 2


def prior_mean(cell: Cell) -> float:
    """A mild guess at p(cell) before any observation: 0.25 for one source at depth 1, more
    with every other source and with agreeing neighbours, less with depth, and half as much
    for a node that is not the first choice among its siblings; SuffixDecoding's share moves it
    by 0.1 a bucket."""
    guess = 0.25 + 0.15 * (len(cell.sources) - 1) + 0.1 * max(cell.support - 1, 0)
    guess += 0.1 * (cell.share - 1) if cell.share >= 0 else 0.0
    return min(0.85, guess) * 0.9 ** (cell.depth - 1) * (1.0 if cell.first else 0.5)


MAX_SOURCES = 6  # sources an acceptance table tells apart (a cell's sources are a bitmask)
NUM_CELLS = (1 << MAX_SOURCES) * 4 * 4 * 2 * 4  # sources x support x depth x first x share


def cell_index(cell: Cell, bits: dict[str, int]) -> int:
    """A cell's place in the table's arrays (the kernel's `hybrid_cell`): (sources bitmask,
    support, depth - 1, first, share + 1), mixed radix."""
    mask = sum(1 << bits[name] for name in cell.sources)
    return (((mask * 4 + cell.support) * 4 + cell.depth - 1) * 2 + cell.first) * 4 + cell.share + 1


def cell_at(index: int, names: list[str]) -> Cell:
    """The cell at `index` (`cell_index` undone), `names[i]` the source of bit i."""
    index, share = divmod(index, 4)
    index, first = divmod(index, 2)
    index, depth = divmod(index, 4)
    mask, support = divmod(index, 4)
    sources = tuple(sorted(name for bit, name in enumerate(names) if mask >> bit & 1))
    return Cell(sources, support, depth + 1, bool(first), share - 1)


@functools.cache
def guessed_priors() -> np.ndarray:
    """`prior_mean` of every cell: it depends on how many sources a cell has, not which."""
    priors = np.zeros(NUM_CELLS)
    names = [str(bit) for bit in range(MAX_SOURCES)]
    for index in range(NUM_CELLS >> MAX_SOURCES, NUM_CELLS):  # mask 0 (no source): no cell
        priors[index] = prior_mean(cell_at(index, names))
    priors.flags.writeable = False
    return priors


@dataclass
class AcceptanceTable:
    """p(node accepted | parent accepted) per feature cell, a Beta posterior (see module doc).

    The prior mean of a cell is `fitted`'s rate where a fitted prior has one (`save`d from the
    table of a replay over recorded runs: `benchmarks/studies/fit_hybrid_prior.py`), else
    `prior_mean`'s guess. The counts and priors are arrays indexed by `cell_index`, the sources
    numbered in the order the table first meets them (`bit`), so that the C kernel reads and
    updates them in place.
    """

    prior_strength: float = 4.0
    fitted: dict[Cell, float] = field(default_factory=dict)  # cell -> fitted prior mean
    names: list[str] = field(default_factory=list)  # names[i]: the source of bit i
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(NUM_CELLS))
    tried: np.ndarray = field(default_factory=lambda: np.zeros(NUM_CELLS))
    priors: np.ndarray = field(default_factory=lambda: guessed_priors().copy())

    def bit(self, source: str) -> int:
        """The source's bit in a cell's sources mask (a new source takes the next one)."""
        if source not in self.names:
            if len(self.names) == MAX_SOURCES:
                raise UserError(f"hybrid tells at most {MAX_SOURCES} sources apart")
            self.names.append(source)
            self._place_fitted()
        return self.names.index(source)

    def by_name(self, by_bit: list[int]) -> dict[str, int]:
        """The kernel's per-bit figures (-1: none) per source name. A plain dict: a Counter
        costs ~9 us more with the caches a forward leaves."""
        return {self.names[bit]: n for bit, n in enumerate(by_bit) if n >= 0}

    def index(self, cell: Cell) -> int:
        for name in cell.sources:
            self.bit(name)
        return cell_index(cell, {name: bit for bit, name in enumerate(self.names)})

    def probability(self, cell: Cell) -> float:
        i = self.index(cell)
        return ((self.accepted[i] + self.prior_strength * self.priors[i])
                / (self.tried[i] + self.prior_strength))

    def observe(self, cell: Cell, accepted: bool) -> None:
        i = self.index(cell)
        self.accepted[i] += accepted
        self.tried[i] += 1

    @property
    def counts(self) -> dict[Cell, list[float]]:
        """Every cell tried so far -> [accepted, tried]."""
        return {cell_at(int(i), self.names): [float(self.accepted[i]), float(self.tried[i])]
                for i in np.flatnonzero(self.tried)}

    def save(self, path: str | Path, min_tried: int = 20) -> None:
        """The observed rate of every cell tried at least `min_tried` times, as JSON."""
        rows = [{**cell._asdict(), "sources": list(cell.sources), "accepted": a, "tried": t}
                for cell, (a, t) in sorted(self.counts.items()) if t >= min_tried]
        Path(path).write_text(json.dumps({"cells": rows}, indent=1) + "\n")

    def load_prior(self, path: str | Path) -> None:
        """Take the rates a `save` wrote as this table's prior means."""
        rows = json.loads(Path(path).read_text())["cells"]
        self.fitted = {Cell(tuple(r["sources"]), r["support"], r["depth"], r["first"],
                            r.get("share", -1)): r["accepted"] / r["tried"] for r in rows}
        self._place_fitted()

    def _place_fitted(self) -> None:
        """Fitted priors over the guesses, for the cells whose sources all have a bit."""
        bits = {name: bit for bit, name in enumerate(self.names)}
        for cell, rate in self.fitted.items():
            if all(name in bits for name in cell.sources):
                self.priors[cell_index(cell, bits)] = rate


@dataclass
class CandidateTree:
    """The merged trie of every source's candidates; node 0 is the root (the bonus token)."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    sources: list[tuple[str, ...]] = field(default_factory=lambda: [()])  # sorted names
    support: list[int] = field(default_factory=lambda: [0])  # neighbours through node
    votes: list[int] = field(default_factory=lambda: [0])  # candidates through node, any source
    # the best count share a source gave the node, bucketed (`share_bucket`); -1: none
    shares: list[int] = field(default_factory=lambda: [-1])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def add(self, candidate: Candidate, source: str, max_len: int | None = None) -> None:
        """Add the first `max_len` tokens of one of `source`'s candidates, with its features:
        the neighbours that propose it (each one a vote, and support) and its count shares."""
        tokens, neighbours, shares = candidate
        votes = max(neighbours, 1)  # once, or once for each neighbour proposing it
        node = 0
        for position, token in enumerate(tokens[:max_len]):
            child = self.children[node].get(int(token))
            if child is None:
                child = len(self.tokens)
                self.tokens.append(int(token))
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.sources.append(())
                self.support.append(0)
                self.votes.append(0)
                self.shares.append(-1)
                self.children.append({})
                self.children[node][int(token)] = child
            if source not in self.sources[child]:
                self.sources[child] = tuple(sorted((*self.sources[child], source)))
            self.support[child] += neighbours
            self.votes[child] += votes
            if shares is not None:
                self.shares[child] = max(self.shares[child], share_bucket(shares[position]))
            node = child

    def first_child(self, node: int) -> int:
        """The child most candidates pass through (the earliest on ties); -1 if none."""
        kids = self.children[node].values()
        return max(kids, key=lambda v: (self.votes[v], -v)) if kids else -1

    def cell(self, node: int, first: bool) -> Cell:
        return Cell(self.sources[node], support_bucket(self.support[node]),
                    min(self.depths[node], 4), first, self.shares[node])

    def reach_probabilities(self, table: AcceptanceTable) -> list[float]:
        """P(v) for every node: the probability that verification reaches it (root: 1)."""
        by_cell: dict[Cell, float] = {}  # many nodes share a cell: one lookup each
        reach = [1.0] * len(self.tokens)
        for node, children in enumerate(self.children):  # parents come before children
            if not children:
                continue
            kids = list(children.values())
            top = self.first_child(node)
            p = []
            for kid in kids:
                cell = self.cell(kid, kid == top)
                if cell not in by_cell:
                    by_cell[cell] = table.probability(cell)
                p.append(by_cell[cell])
            scale = min(1.0, 1.0 / sum(p))  # siblings are exclusive
            for kid, pk in zip(kids, p, strict=True):
                reach[kid] = reach[node] * pk * scale
        return reach

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        tokens = []
        while node > 0:
            tokens.append(self.tokens[node])
            node = self.parents[node]
        return tokens[::-1]

    def cut(self, table: AcceptanceTable, costs: np.ndarray, max_nodes: int
            ) -> tuple[list[Draft], int]:
        """Steps 2-3 of the module doc: of the `max_nodes` most probable nodes, the first n that
        maximise expected tokens per verify cost (`best_budget`, `costs[t]` = cost(t)), as root
        paths; and n. The paths in the order of a walk from the root that visits each node's
        kept children most probable first: the first path follows the most probable child at
        every depth, and a node's rank among its siblings in the drafts (what the batch budget
        prices under load, `decoding/budget.py`) is its rank by reach."""
        reach = self.reach_probabilities(table)
        order = np.argsort(-np.asarray(reach[1:]), kind="stable")[:max_nodes] + 1
        n = best_budget([reach[i] for i in order], costs)
        rank = {v: i for i, v in enumerate(order[:n].tolist())}  # by reach, then node
        leaves = [v for v in rank if not any(c in rank for c in self.children[v].values())]

        def ranks_from_root(node: int) -> list[int]:
            ranks = []
            while node > 0:
                ranks.append(rank[node])
                node = self.parents[node]
            return ranks[::-1]

        return [self.path(v) for v in sorted(leaves, key=ranks_from_root)], n

    def learn(self, emitted: list[int], table: AcceptanceTable) -> dict[str, int]:
        """Step 4: every child of a node on the emitted path (the accepted tokens, then the
        bonus token) is a trial of its cell, accepted if its token came. Returns, per source,
        the accepted tokens lost without it: those from the first accepted node it alone
        proposed on (the path breaks there)."""
        accepted = len(emitted) - 1
        lost: dict[str, int] = {}
        node = 0
        for depth, token in enumerate(emitted):
            top = self.first_child(node)
            for child in self.children[node].values():
                table.observe(self.cell(child, child == top), self.tokens[child] == token)
            node = self.children[node].get(token, -1)
            if node < 0:
                break
            if depth < accepted and len(self.sources[node]) == 1:
                lost.setdefault(self.sources[node][0], accepted - depth)
        return lost


# A step's tree: `CandidateTree`, or where the kernel compiles the same trie in its columns,
# learnt from, merged and cut in one call (`drafting.HybridTree.drafted`).
Tree = CandidateTree | drafting.HybridTree


@dataclass
class SourceLedger:
    """Whether each source pays for its drafting time, learned over the steps it was consulted.

    Leaving source S out of a step loses u tokens, the accepted ones from the first accepted
    node that only S proposed on (the path breaks there), and saves c, the seconds S took. With
    E the tokens a step emits and T its seconds (drafting plus verify), throughput E / T beats
    (E - u) / (T - c) exactly when

        u / E >= c / T        (S's share of the tokens >= S's share of the time)

    Under load, B sequences share a step and each one's drafting holds up all of them: E and T
    are then the whole batch's tokens and seconds (its previous step's, drafting included), so
    a source pays for one sequence only by a share of the batch's tokens as large as its share
    of the batch's time, B times harder than alone.

    u and c are averaged over the steps S was consulted, E and T over every step, each an
    exponential moving average (weight `decay` on the past). The source that loses most by this
    rule, the largest c / T - u / E > 0, is left out, with two guards: one source at a time
    (two sources that find the same tokens each look redundant, and leaving both out would
    lose what either finds), and every `explore_every`-th step (every `explore_every * B`-th
    under load, where a probe holds up B sequences) consults them all, so that a source whose
    content starts to pay comes back.
    """

    decay: float = 0.95
    warmup: int = 16  # steps a source is consulted before it may be left out
    explore_every: int = 4
    lost: dict[str, float] = field(default_factory=dict)  # source -> u
    seconds: dict[str, float] = field(default_factory=dict)  # source -> c
    consulted: Counter = field(default_factory=Counter)  # source -> steps it was consulted
    emitted: float | None = None  # E
    step_seconds: float | None = None  # T

    def average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record(self, seconds: dict[str, float], lost: dict[str, int], emitted: int,
               step_seconds: float) -> None:
        """One step: each consulted source's seconds and the tokens lost without it."""
        for name, spent in seconds.items():
            self.lost[name] = self.average(self.lost.get(name), lost.get(name, 0))
            self.seconds[name] = self.average(self.seconds.get(name), spent)
            self.consulted[name] += 1
        self.emitted = self.average(self.emitted, emitted)
        self.step_seconds = self.average(self.step_seconds, step_seconds)

    def to_skip(self, step: int, batch_size: int = 1) -> str | None:
        """The source to leave out of step number `step` (of a sequence decoding beside
        `batch_size` - 1 others), if one does not pay."""
        explore = step % (self.explore_every * max(batch_size, 1)) == 0
        if explore or not self.emitted or not self.step_seconds:
            return None
        # A plain loop: a comprehension and max(key=...) cost ~5 us more a step with the caches
        # a forward leaves. The first of the largest excesses over 0, as max() would pick.
        worst, largest = None, 0.0
        for name, c in self.seconds.items():
            if self.consulted[name] >= self.warmup:
                excess = c / self.step_seconds - self.lost[name] / self.emitted
                if excess > largest:
                    worst, largest = name, excess
        return worst


@dataclass
class LastStep:
    """What the next call needs to score a step: its candidates and what it spent."""

    tree: Tree
    length: int  # context length when it drafted
    # the context's last 16 tokens (at most) as bytes, and their dtype: to tell a new
    # generation apart
    tail: bytes
    tail_dtype: np.dtype
    source_seconds: dict[str, float]  # source -> seconds it took (the sources consulted)
    first: bool  # the first step of a generation
    # the batch it drafted in: (sequences, the previous step's tokens and seconds), as the
    # context gave them (`DraftContext.batch_size`)
    batch: tuple[int, int, float] = (1, 0, 0.0)
    verified: int = 0  # draft tokens kept for verification
    seconds: float = 0.0  # the whole call's seconds


def best_budget(reach: list[float], costs: np.ndarray) -> int:
    """n* = argmax_n (1 + sum of the n largest reach probabilities) / cost(n + 1), with
    costs[t] = cost(t) (`cost_table`); on ties the smaller tree."""
    ranked = np.sort(np.asarray(reach, dtype=np.float64))[::-1]
    expected = 1.0 + np.concatenate(([0.0], np.cumsum(ranked)))  # n = 0, 1, ...
    return int(np.argmax(expected / costs[1 : len(ranked) + 2]))


@dataclass
class HybridOptions:
    """HybridDrafter's options (`--datastore`, `--draft-len`, `--max-tree-nodes`, `--learn`).

    Not frozen, unlike the other drafters' options: `check_target` fills in `cost` and
    `step_seconds` where they are None (this machine's, measured once), and a bench report
    reads the curve back from `drafter.cost`."""

    datastore: str | Path | None = None  # dense and/or sparse parts add DReSD and REST
    draft_len: int = 10  # tokens per candidate at most
    max_tree_nodes: int = 64  # candidates considered at most (the most probable)
    # dense neighbours searched: each one's draft is a candidate to merge and score, so more
    # neighbours cost hybrid more than they cost DReSD alone (20: as many accepted tokens as
    # 50 in replay, 0.1-0.3 ms less drafting a step)
    neighbours: int = 20
    prior_strength: float = 4.0  # observations the prior is worth
    prior: str | None = None  # a fitted prior (JSON of AcceptanceTable.save); None: a guess
    # verify cost by tree tokens, in decode steps; None: measured once by `dresd calibrate`
    cost: dict[int, float] | None = None
    # leave out a source whose drafting time does not pay (`SourceLedger`); 0: consult every
    # source at every step
    skip_sources: bool = True
    # a one-token step's seconds, to weigh each source's drafting time against; None: the
    # calibration's when it gives the cost, else unknown, and every source is always consulted
    step_seconds: float | None = None
    # finished outputs kept: None (default) by suffix only; True by suffix, REST and DReSD;
    # False by none
    learn: bool | None = None
    # the target's own multi-token prediction block as one more source, where it has one
    # (a Qwen3.5 GGUF file that keeps it: drafters/mtp.py); off by default until a trained
    # block is measured: on random weights its drafts are never accepted, and with it hybrid
    # ran 0.81-0.93x `ar` (the ledger too slow to drop it; benchmarks/results/mtp)
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.draft_len < 1 or self.max_tree_nodes < 1 or self.neighbours < 1:
            raise UserError("hybrid needs draft_len, max_tree_nodes and neighbours >= 1")


class HybridDrafter(HybridOptions, Drafter):
    """Its options, its sources (each a drafter of its own), the acceptance table and the
    source ledger it learns, and the step it drafted last."""

    name = "hybrid"
    sizes_its_trees = True  # its own budget (`_budget`) prices each tree by the curve
    sources: dict[str, Drafter]  # name (a feature of the nodes it proposes) -> source
    table: AcceptanceTable
    ledger: SourceLedger
    costs: np.ndarray  # cost(t) for tree sizes t = 0, 1, ... (`cost_table`), grown on demand
    # what the ledger's seconds are read from: a test sets a clock it advances itself, so that
    # the ledger's verdicts do not depend on how loaded the machine is
    clock: Callable[[], float]
    steps: int  # calls to propose
    last: LastStep | None  # the previous step

    def __post_init__(self) -> None:
        super().__post_init__()
        self.table = AcceptanceTable(self.prior_strength)
        if self.prior is not None:
            self.table.load_prior(self.prior)
        suffix_learns = True if self.learn is None else bool(self.learn)
        stores_learn = bool(self.learn)  # REST's and DReSD's side stores: only when asked
        shapes = self._source_shapes()
        self.sources = {"pld": PromptLookupDrafter(**shapes["pld"], num_drafts=3),
                        "suffix": SuffixDrafter(max_tree_nodes=16, learn=suffix_learns)}
        if self.datastore is not None:
            parts = kinds(read_manifest(self.datastore))
            if "sparse" in parts:
                self.sources["rest"] = RestDrafter(self.datastore, **shapes["rest"],
                                                   max_tree_nodes=16, learn=stores_learn)
            if "dense" in parts:
                self.sources["dresd"] = DenseDrafter(self.datastore, **shapes["dresd"],
                                                     learn=stores_learn)
        self.ledger = SourceLedger()
        self.costs = np.zeros(0)
        self.clock = time.perf_counter
        self.steps, self.last = 0, None
        # the sources as one kernel call reads them (`_step_in_c`), and the ones it was made for
        self._step_plan = self._plan_step()
        self._step_sources = tuple(self.sources.values())
        self._step_buffers = drafting.StepBuffers()  # what its calls write, kept
        self._step_calls: dict[str | None, tuple[list[str], array, array]] = {}

    def fork(self) -> HybridDrafter:
        """Shares the acceptance table, the ledger and every source's learned outputs; its
        own last step and its sources' own per-request state."""
        forked = copy.copy(self)
        forked.sources = {name: source.fork() for name, source in self.sources.items()}
        # the same options and stores as the plan's (else no plan: `_planned_sources` says no)
        forked._step_sources = tuple(forked.sources.values()) if self._planned_sources() else ()
        forked._step_buffers = drafting.StepBuffers()  # (`_step_calls` shared: one table)
        forked.last, forked.steps = None, 0
        return forked

    def _source_shapes(self) -> dict[str, dict]:
        """The options each built-in source takes from hybrid's own: its draft length, and
        DReSD's neighbours."""
        return {"pld": {"draft_len": self.draft_len}, "rest": {"draft_len": self.draft_len},
                "dresd": {"draft_len": self.draft_len, "k": self.neighbours}}

    def with_options(self, **options) -> HybridDrafter:
        """This drafter with some of its tree's options changed (a server request's own
        `draft_len` or `max_tree_nodes`): a fork (`fork`: the acceptance table, the ledger and
        what is learned shared), each source whose shape changed reshaped by its own
        `with_options`, which shares its opened store. Other options build a drafter anew.
        (Built anew, a request's drafter opened every datastore again, learned nothing of the
        shared table, and lost the target's MTP block until `check_target`.)"""
        if not set(options) <= {"draft_len", "max_tree_nodes", "neighbours"}:
            return dataclasses.replace(self, **options)
        variant = self.fork()
        for name, value in options.items():
            setattr(variant, name, value)
        HybridOptions.__post_init__(variant)  # the same checks as a drafter built anew
        before, shapes = self._source_shapes(), variant._source_shapes()
        variant.sources = {
            name: source.with_options(**shapes[name])
            if name in shapes and shapes[name] != before[name] else source
            for name, source in variant.sources.items()}
        variant._step_plan = variant._plan_step()  # its buffers sized by the draft length
        variant._step_sources = tuple(variant.sources.values())
        return variant

    def with_source(self, name: str, source: Drafter) -> HybridDrafter:
        """A fork (`fork`: the acceptance table and what is learned shared) with one more
        source, a request's own (its prediction), whose nodes the table weighs by their own
        cells, as any source's. Its steps run source by source (`_step_in_c` is planned for
        the built-in sources only)."""
        forked = self.fork()
        forked.sources = {**forked.sources, name: source}
        return forked

    def check_target(self, target: Target) -> None:
        """Refuse stores of another model; take the target's MTP block as a source where it
        has one; take this machine's verify-cost curve."""
        if self.mtp and "mtp" not in self.sources and \
                isinstance(getattr(target.model, "mtp", None), MultiTokenPredictor):
            self.sources["mtp"] = MTPDrafter()  # asked source by source (no kernel plan)
        for source in self.sources.values():
            source.check_target(target)
        if self.cost is None:
            self.cost = load_or_measure(target)
            if self.step_seconds is None:
                self.step_seconds = cached_step_seconds(target)

    def propose(self, context: DraftContext) -> list[Draft]:
        if self.cost is None:
            raise ValueError("hybrid needs the verify-cost curve: pass cost={tokens: steps} or "
                             "call check_target(target) (the runner does), which measures it")
        started = self.clock()
        # Step 4 (learnt with steps 1-3, in one kernel call): what the last step emitted scores
        # its candidates.
        last = self.last if self._follows_last_step(context.token_ids) else None
        emitted = context.token_ids[last.length :].tolist() if last is not None else []
        self.steps += 1
        skip = (self.ledger.to_skip(self.steps, context.batch_size)
                if self.skip_sources and self.step_seconds else None)
        draft_len = min(self.draft_len, context.max_draft_len)
        # Steps 1-4 in one kernel call where every source has its lookup there, else a call per
        # source and one for the rest.
        stepped = self._step_in_c(context, last, emitted, skip, draft_len)
        if stepped is not None:
            tree, drafts, verified, lost, source_seconds = stepped
        else:
            gathered, source_seconds = [], {}
            for name, source in self.sources.items() if draft_len >= 1 else []:
                if name == skip:
                    continue
                source_started = self.clock()
                gathered.append((name, source.candidates(context)))
                source_seconds[name] = self.clock() - source_started
            tree, drafts, verified, lost = self._learn_merge_and_cut(last, emitted, gathered,
                                                                     draft_len)
        if last is not None:
            self._record(last, lost, emitted)
        length = len(context.token_ids)
        tail = context.token_ids[max(0, length - 16) :]
        self.last = LastStep(tree, length, tail.tobytes(), tail.dtype,
                             source_seconds, first=last is None,
                             batch=(context.batch_size, context.batch_tokens,
                                    context.batch_seconds), verified=verified)
        self.last.seconds = self.clock() - started
        return drafts

    def _learn_merge_and_cut(self, last: LastStep | None, emitted: list[int],
                             gathered: list[tuple[str, list[Candidate]]], draft_len: int
                             ) -> tuple[Tree, list[Draft], int, dict[str, int]]:
        """Step 4 of the module doc for the last step (where `last` is given: it emitted
        `emitted`), then steps 1-3: every source's candidates, cut to `draft_len`, in one trie,
        and the candidates worth verifying as root paths. Returns (the trie, those paths, how
        many tree nodes they hold, per source the accepted tokens `last` lost without it).
        In one C call where the kernel is compiled, else on a `CandidateTree`."""
        costs, max_nodes = self._budget()
        table = self.table
        if drafting.kernel() is None:
            lost = last.tree.learn(emitted, table) if last is not None else {}
            tree = CandidateTree()
            for name, candidates in gathered:
                for candidate in candidates:
                    tree.add(candidate, name, draft_len)
            drafts, kept = tree.cut(table, costs, max_nodes) if len(tree) > 1 else ([], 0)
            return tree, drafts, kept, lost
        tokens, offsets, bits = array("q"), array("q", [0]), array("q")
        neighbours, shares = array("q"), array("d")
        for name, candidates in gathered:
            bit = 1 << table.bit(name)
            for draft, count, token_shares in candidates:
                tokens.extend(draft)
                offsets.append(len(tokens))
                bits.append(bit)
                neighbours.append(count)
                shares.extend([math.nan] * len(draft) if token_shares is None else token_shares)
        tree, drafts, kept, by_bit = drafting.HybridTree.drafted(
            tokens, offsets, bits, neighbours, shares, draft_len, table.accepted, table.tried,
            table.priors, table.prior_strength, costs, max_nodes,
            None if last is None else last.tree, emitted, len(table.names))
        return tree, drafts, kept, table.by_name(by_bit)

    def _step_in_c(self, context: DraftContext, last: LastStep | None, emitted: list[int],
                   skip: str | None, draft_len: int
                   ) -> tuple[Tree, list[Draft], int, dict[str, int], dict[str, float]] | None:
        """`propose`'s steps 1-4 in one kernel call (`drafting.hybrid_step`): the sources'
        lookups, the learning, merge and cut. None where it cannot: the sources are not the
        ones its plan was made for (`_plan_step`), or DReSD has no state on the CPU. Each
        source's seconds are the kernel's clock's."""
        plan = self._step_plan
        if not self._planned_sources() or draft_len < 1 or drafting.kernel() is None:
            return None
        state = context.hidden_state
        table = self.table
        consulted = self._step_calls.get(skip)
        if consulted is None:  # the sources' names, kinds and table bits, once per source left out
            names = [name for name in self.sources if name != skip]
            consulted = self._step_calls[skip] = (
                names, array("i", [drafting.SOURCE_KINDS[name] for name in names]),
                array("q", [1 << table.bit(name) for name in names]))
        names, kinds, bits = consulted
        if "dresd" in names and not (isinstance(state, torch.Tensor) and state.is_cpu):
            return None
        grown = self.sources["suffix"].global_tree(context) if "suffix" in names else None
        suffix_global = None
        if grown is not None:  # the suffix drafter's trie of earlier outputs, in Python
            offsets = array("q", [0])
            tokens, shares = array("q"), array("d")
            for path, path_shares in grown.paths():
                tokens.extend(path)
                shares.extend(path_shares)
                offsets.append(len(tokens))
            suffix_global = (tokens, offsets, shares, grown.score)
        costs, max_nodes = self._budget()
        tree, drafts, kept, by_bit, seconds = drafting.hybrid_step(
            plan, self._step_buffers, kinds, bits,
            np.ascontiguousarray(context.token_ids, dtype=np.int64),
            state if "dresd" in names else None, draft_len, context.max_draft_len,
            suffix_global, table.accepted, table.tried, table.priors, table.prior_strength,
            costs, max_nodes, None if last is None else last.tree, emitted, len(table.names))
        return tree, drafts, kept, table.by_name(by_bit), dict(zip(names, seconds, strict=True))

    def _planned_sources(self) -> bool:
        """Whether `_step_plan` is made for the sources this drafter has now (a test may swap
        them)."""
        if self._step_plan is None or len(self.sources) != len(self._step_sources):
            return False
        for source, planned in zip(self.sources.values(), self._step_sources, strict=True):
            if source is not planned:  # a plain loop: all() over a generator costs ~3 us more
                return False
        return True

    def _plan_step(self) -> drafting.StepSources | None:
        """What `_step_in_c` reads of the sources, once; None where a source has no lookup in
        the kernel (no kernel; REST or DReSD keeping outputs in memory, or DReSD's store not
        an IVF index the kernel searches)."""
        if drafting.kernel() is None or not set(self.sources) <= set(drafting.SOURCE_KINDS):
            return None
        plan = drafting.HybridSources()
        most, keep = 0, None
        for name, source in self.sources.items():
            if name == "pld" and isinstance(source, PromptLookupDrafter):
                plan.pld_max_ngram, plan.pld_min_ngram = source.max_ngram, source.min_ngram
                plan.pld_num_drafts = source.num_drafts
                most += source.num_drafts
            elif name == "suffix" and isinstance(source, SuffixDrafter):
                plan.suffix_max_depth, plan.suffix_max_nodes = (source.max_depth,
                                                                source.max_tree_nodes)
                plan.suffix_single_path = int(not source.tree)
                plan.suffix_factor, plan.suffix_offset = (source.max_spec_factor,
                                                          source.max_spec_offset)
                plan.suffix_min_prob = source.min_token_prob
                most += source.max_tree_nodes
            elif (name == "rest" and isinstance(source, RestDrafter)
                  and source._index_in_c is not None and source.learned is None):
                index = source._index_in_c
                (plan.rest_symbols, plan.rest_symbols_bytes, plan.rest_symbol_width,
                 plan.rest_suffix_array, plan.rest_wide, plan.rest_suffixes,
                 plan.rest_symbol_of, plan.rest_table_len, plan.rest_alphabet) = index
                plan.rest_min_suffix, plan.rest_max_suffix = source.min_suffix, source.max_suffix
                plan.rest_max_matches, plan.rest_max_nodes = (source.max_matches,
                                                              source.max_tree_nodes)
                most += source.max_tree_nodes
            elif (name == "dresd" and isinstance(source, DenseDrafter)
                  and source._query_in_c is not None and source.learned is None):
                keep = source._query_in_c
                plan.dense, plan.dense_k = keep[1], source.k
                most += source.k
            else:
                return None
        return drafting.StepSources(plan, ctypes.addressof(plan), most * self.draft_len, keep)

    def _budget(self) -> tuple[np.ndarray, int]:
        """(cost(t) for every tree size it may keep, `cost_table`; the most nodes it keeps)."""
        if len(self.costs) < self.max_tree_nodes + 2:
            self.costs = cost_table(self.cost, self.max_tree_nodes + 1)
        return self.costs, self.max_tree_nodes

    def observe(self, prompt: list[int], output: list[int], hidden_states=None) -> None:
        """A generation finished: the sources that learn from outputs (see `learn`) take it."""
        for source in self.sources.values():
            source.observe(prompt, output, hidden_states)

    def _follows_last_step(self, token_ids: np.ndarray) -> bool:
        """Whether `token_ids` continue the context the last step drafted after (else a new
        generation starts, and the last step's candidates are not comparable)."""
        last = self.last
        # Bytes compared, not np.array_equal: its several numpy calls cost 4-8 us a step more
        # with the caches a forward leaves (paired runs of benchmarks/micro/drafting_ab.py).
        if last is None or len(token_ids) <= last.length or token_ids.dtype != last.tail_dtype:
            return False
        held = len(last.tail) // last.tail_dtype.itemsize
        return token_ids[last.length - held : last.length].tobytes() == last.tail

    def _record(self, step: LastStep, lost: dict[str, int], emitted: list[int]) -> None:
        """Weigh a step's sources' time against what only they found (`lost`: source ->
        accepted tokens lost without it, of the `emitted` ones)."""
        # A generation's first call also reads its prompt (suffix builds the prompt's tree):
        # a cost per generation, not per step, which leaving a source out would not save.
        if self.step_seconds and not step.first:
            batch_size, tokens, seconds = step.batch
            if batch_size <= 1 or not tokens or not seconds:  # alone: this step's own figures
                verify = (self.costs[step.verified + 1] if len(self.costs) > step.verified + 1
                          else 1.0)
                tokens, seconds = len(emitted), step.seconds + verify * self.step_seconds
            self.ledger.record(step.source_seconds, lost, tokens, seconds)
