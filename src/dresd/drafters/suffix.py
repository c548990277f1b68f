"""SuffixDecoding (Oliaro et al., NeurIPS 2025, arXiv 2411.04975): model-free drafts from suffix
trees over the current request and over the model's previous outputs.

Two structures, one kind:

- a per-request suffix trie over the prompt and the output so far (rebuilt when a new request
  starts, extended by the new tokens at every step);
- a global suffix trie over the outputs of finished requests (`observe`, called by the loop when
  a generation ends), bounded: the oldest requests are evicted first once more than
  `max_cached_requests` requests or `max_cached_tokens` tokens are held.

Both are suffix tries cut at depth D = `max_depth`: node s (a token string, |s| <= D) holds
count(s) = the number of positions i of the stored sequences with seq[i : i + |s|] = s. Every
appended token adds one to the D strings that end at it. The per-request trie stores each of
them (at most D nodes per token of the request); the global trie stores a string's unique tail
as one lazy node that reads the chain from the output itself (measured on GSM8K answers: 1.7
nodes, ~280 bytes per stored token at D = 24, `benchmarks/results/suffix_memory.json`), so the
default bound of 100k tokens holds ~30 MB.

At each step, with c the context (prompt + output, ending with the bonus token), in each trie:

1. For every match length m = 1 .. D - 1 whose pattern p = c[-m:] is in the trie: a speculation
   tree grows from node p, best first. A node s + [t] below p has the score

       prob(s + [t]) = prob(s) * count(s + [t]) / count(s),      prob(p) = 1,

   the empirical probability that the continuation reaches it (count(s) includes occurrences
   that end there, so the children's ratios sum to at most 1). The frontier node of highest
   prob is added until the tree holds `budget(m) = min(max_tree_nodes, floor(max_spec_factor * m
   + max_spec_offset))` tokens; nodes with prob < `min_token_prob` are never added. Longer
   matches earn bigger trees: the speculation budget grows with the match length.
2. The tree's score is the sum of its nodes' probs: the expected number of accepted tokens
   if the counts were the model's probabilities.

The tree of highest score over all m and both tries is drafted (ties: the longer match,
then the per-request trie). Its root-to-leaf paths are the drafts. Trees are no deeper than
D - m (the trie's depth) nor than the tokens left to generate.

Departures from the paper and from vLLM's `suffix` method (ArcticInference's suffix tree):
- Tries are plain Python nodes (ArcticInference: C++, unary paths compressed into one node
  everywhere). Here only the global trie's unique tails are compressed (lazy nodes); the
  per-request trie is uncompressed. Same counts, so the same drafts.
- vLLM drafts one path (`use_tree_spec` off); the paper, and this drafter by default, a tree
  (`tree=False` gives the path: the most frequent child at every step).
- The global trie holds finished outputs only; vLLM also adds the running request's output to
  it as it is generated (here the per-request trie already holds it).
- Frontier ties are broken by insertion order with children in token-id order (deterministic).
"""

from __future__ import annotations

import copy
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dresd.decoding.drafter import Candidate, Draft, DraftContext, Drafter
from dresd.errors import UserError
from dresd.kernels import drafting


class Node:
    """One token string s of a suffix trie: count(s) and the strings s + [t] below it.

    A lazy node (`seq` set) stores no children: the strings below it are the one chain
    seq[pos], seq[pos + 1], ..., each of count 1 (only that occurrence of s continues). The
    global trie stores a new sequence's unique tails this way, so that a stored token costs a
    few nodes instead of D."""

    __slots__ = ("count", "children", "seq", "pos")

    def __init__(self, count: int = 0, seq: list[int] | None = None, pos: int = 0) -> None:
        self.count = count
        self.children: dict[int, Node] | None = {} if seq is None else None
        self.seq = seq
        self.pos = pos


class SuffixTrie:
    """Occurrence counts of every string of length <= `max_depth` in a set of token sequences.

    Node s holds count(s) = #{(sequence, i): sequence[i : i + |s|] = s}. Two ways in: `append`
    extends one growing sequence (the per-request trie; plain nodes), `add` / `remove` insert or
    take out whole sequences (the global trie; unique tails lazy, see `Node`)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise UserError("a suffix trie needs max_depth >= 2 (a match and a draft token)")
        self.max_depth = max_depth
        self.root = Node()  # the empty string: count = stored tokens
        self.num_nodes = 0  # stored nodes (lazy chains not counted): the memory

    def children(self, node: Node, depth: int) -> dict[int, Node]:
        """The nodes below `node` (at `depth`); a lazy node's one child is made on the fly."""
        if node.seq is None:
            return node.children
        if depth >= self.max_depth or node.pos >= len(node.seq):
            return {}
        return {node.seq[node.pos]: Node(1, node.seq, node.pos + 1)}

    def append(self, active: list[Node], token: int) -> list[Node]:
        """Append `token` to a sequence whose suffixes of lengths 1 .. D-1 are `active` (in order
        of length); returns the new `active`. Each string ending at the new token gets +1."""
        new_active = []
        for node in [self.root, *active]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
                self.num_nodes += 1
            child.count += 1
            new_active.append(child)
        self.root.count += 1
        return new_active[: self.max_depth - 1]  # a string of length D is never extended

    def add(self, seq: list[int]) -> None:
        """Add a whole sequence; keep the list unchanged while it is stored (lazy nodes read it)."""
        for start in range(len(seq)):
            self.root.count += 1
            node = self.root
            for depth, position in enumerate(range(start, min(start + self.max_depth, len(seq)))):
                self._materialize(node, depth)  # this occurrence goes below: no longer one chain
                child = node.children.get(seq[position])
                if child is None:  # a new string: the rest of this suffix is a lazy chain
                    node.children[seq[position]] = Node(1, seq, position + 1)
                    self.num_nodes += 1
                    break
                child.count += 1
                node = child

    def remove(self, seq: list[int]) -> None:
        """Take out a sequence given to `add` (the same list): its occurrences, and any lazy
        chain read from it."""
        for start in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for position in range(start, min(start + self.max_depth, len(seq))):
                if node.seq is not None:  # lazy: what follows is this very occurrence's chain
                    break
                child = node.children[seq[position]]
                child.count -= 1
                if child.count == 0:  # its whole subtree counted only this occurrence
                    del node.children[seq[position]]
                    self.num_nodes -= _subtree_size(child)
                    node = None
                    break
                node = child
            if node is not None and node.seq is seq:  # other occurrences end here: a leaf now
                node.seq, node.children = None, {}

    def _materialize(self, node: Node, depth: int) -> None:
        """Store a lazy node's one child, so that another occurrence can branch below it."""
        if node.seq is not None:
            children = self.children(node, depth)
            node.seq, node.children = None, children
            self.num_nodes += len(children)

    def find(self, pattern: Sequence[int]) -> Node | None:
        """The node of `pattern`, or None when it never occurs."""
        node = self.root
        for depth, token in enumerate(pattern):
            node = self.children(node, depth).get(int(token))
            if node is None:
                return None
        return node


def _subtree_size(node: Node) -> int:
    size, stack = 0, [node]
    while stack:
        top = stack.pop()
        size += 1
        stack.extend(top.children.values() if top.children else ())
    return size


@dataclass
class SpeculationTree:
    """A speculation tree: tokens[i] hangs below parents[i] (-1: below the matched pattern)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens under the counts' probabilities: the sum of node probs."""
        return float(sum(self.probs))

    def drafts(self) -> list[Draft]:
        """Root-to-leaf token paths, leaves in the order they were added."""
        return [path for path, _ in self.paths()]

    def paths(self) -> list[tuple[Draft, list[float]]]:
        """Root-to-leaf token paths, each with its nodes' conditional probabilities
        count(s + [t]) / count(s) = prob(s + [t]) / prob(s)."""
        has_child = set(self.parents)
        paths = []
        for leaf in range(len(self.tokens)):
            if leaf in has_child:
                continue
            tokens, conditional, node = [], [], leaf
            while node >= 0:
                parent = self.parents[node]
                tokens.append(self.tokens[node])
                conditional.append(self.probs[node] / (self.probs[parent] if parent >= 0 else 1))
                node = parent
            paths.append((tokens[::-1], conditional[::-1]))
        return paths


def expand(trie: SuffixTrie, match: Node, match_len: int, budget: int, min_prob: float,
           max_len: int, tree: bool = True) -> SpeculationTree:
    """The best-first speculation tree below `match` (a node of `trie` at depth `match_len`; see
    the module docstring): at most `budget` tokens, `max_len` deep, every node's prob >=
    `min_prob`. `tree=False`: one path, the most frequent child at each step (ties: the smaller
    token id)."""
    grown = SpeculationTree()
    order = 0  # insertion counter: equal probs leave the frontier first in, first out
    frontier: list[tuple[float, int, int, Node, int, int]] = []

    def push_children(node: Node, prob: float, index: int, depth: int) -> None:
        nonlocal order
        children = trie.children(node, match_len + depth)
        if depth >= max_len or not children:
            return
        tokens = sorted(children)
        if not tree:  # the single most frequent child
            tokens = [max(tokens, key=lambda t: (children[t].count, -t))]
        for token in tokens:
            child = children[token]
            child_prob = prob * child.count / node.count
            if child_prob >= min_prob:
                heapq.heappush(frontier, (-child_prob, order, token, child, index, depth + 1))
                order += 1

    push_children(match, 1.0, -1, 0)
    while frontier and len(grown.tokens) < budget:
        neg_prob, _, token, node, parent, depth = heapq.heappop(frontier)
        grown.tokens.append(token)
        grown.parents.append(parent)
        grown.probs.append(-neg_prob)
        push_children(node, -neg_prob, len(grown.tokens) - 1, depth)
    return grown


def speculation_budget(match_len: int, factor: float, offset: float, max_nodes: int) -> int:
    """Tokens a match of `match_len` may draft: min(max_nodes, floor(factor * m + offset))."""
    return max(0, min(max_nodes, int(match_len * factor + offset + 1e-6)))


@dataclass(frozen=True)
class SuffixOptions:
    """SuffixDrafter's options (`--suffix-*`, `--max-tree-nodes`, `--learn`)."""

    max_depth: int = 24  # D: the tries' depth; a match of m tokens drafts at most D - m deep
    max_tree_nodes: int = 32  # tokens per speculation tree at most (vLLM's num_speculative_tokens)
    max_spec_factor: float = 1.0  # budget = floor(factor * match length + offset) tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # nodes whose empirical probability is lower are not drafted
    tree: bool = True  # False: one path per step, as vLLM drafts
    learn: bool = True  # keep finished outputs in the global trie (the paper's global tree)
    max_cached_requests: int = 1000  # global trie: oldest outputs evicted beyond this many...
    max_cached_tokens: int = 100_000  # ... or beyond this many tokens (~280 bytes each)

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise UserError("suffix needs max_depth >= 2")
        if self.max_tree_nodes < 1 or self.max_spec_factor < 0 or self.min_token_prob < 0:
            raise UserError("suffix needs max_tree_nodes >= 1, max_spec_factor >= 0 and "
                            "min_token_prob >= 0")
        if self.max_cached_requests < 0 or self.max_cached_tokens < 0:
            raise UserError("suffix needs max_cached_requests and max_cached_tokens >= 0")


class SuffixDrafter(SuffixOptions, Drafter):
    """Its options, the global trie of finished outputs (shared by its forks) and the trie of
    the request it drafts for (its own)."""

    name = "suffix"
    global_trie: SuffixTrie
    cached: deque[list[int]]  # the outputs in the global trie, oldest first
    request_trie: SuffixTrie
    request_tokens: np.ndarray  # what request_trie holds
    request_active: list[Node]  # its nodes of the held tokens' suffixes (`SuffixTrie.append`)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached = deque()
        self._reset_request()

    def fork(self) -> SuffixDrafter:
        """Shares the global trie (what every finished generation taught it); a per-request
        trie of its own."""
        forked = copy.copy(self)
        forked._reset_request()
        return forked

    def _reset_request(self) -> None:
        self.request_trie = SuffixTrie(self.max_depth)
        self.request_tokens = np.zeros(0, dtype=np.int64)
        self.request_active = []

    def _update_request(self, tokens: np.ndarray) -> None:
        """Make the per-request trie hold exactly `tokens`: extend it when `tokens` continues what
        it holds (the same request, one step later), rebuild it otherwise (a new request)."""
        held = len(self.request_tokens)
        if len(tokens) < held or not np.array_equal(tokens[:held], self.request_tokens):
            self._reset_request()
            held = 0
        for token in tokens[held:].tolist():
            self.request_active = self.request_trie.append(self.request_active, token)
        self.request_tokens = np.array(tokens, dtype=np.int64)

    def best_tree(self, trie: SuffixTrie, tokens: Sequence[int], max_len: int
                  ) -> SpeculationTree:
        """The highest-scoring speculation tree of `trie` over all match lengths (longer wins
        ties)."""
        best = SpeculationTree()
        for match_len in range(1, min(trie.max_depth - 1, len(tokens)) + 1):
            match = trie.find(tokens[len(tokens) - match_len :])
            if match is None:
                break  # a longer pattern contains this one, so it cannot occur either
            budget = speculation_budget(match_len, self.max_spec_factor, self.max_spec_offset,
                                        self.max_tree_nodes)
            grown = expand(trie, match, match_len, budget, self.min_token_prob, max_len,
                           self.tree)
            if grown.tokens and grown.score >= best.score:
                grown.match_len = match_len
                best = grown
        return best

    def request_tree(self, token_ids: np.ndarray, max_len: int) -> SpeculationTree:
        """The best tree of the per-request trie over `token_ids`: grown by the C kernel from
        the tokens themselves where it is compiled (`kernels/drafting.py`: the same tree, no
        trie to keep), else from the trie, extended by the tokens it has not seen."""
        if drafting.kernel() is not None:
            grown = drafting.suffix_context_tree(
                token_ids, self.max_depth, self.max_spec_factor, self.max_spec_offset,
                self.max_tree_nodes, self.min_token_prob, max_len, self.tree)
            return SpeculationTree(*grown)
        self._update_request(token_ids)
        return self.best_tree(self.request_trie, token_ids[-(self.max_depth - 1) :].tolist(),
                              max_len)

    def propose(self, context: DraftContext) -> list[Draft]:
        return self.speculation_tree(context).drafts()

    def candidates(self, context: DraftContext) -> list[Candidate]:
        """`propose`'s drafts, each token with its count share count(s + [t]) / count(s)."""
        return [Candidate(draft, shares=shares)
                for draft, shares in self.speculation_tree(context).paths()]

    def speculation_tree(self, context: DraftContext) -> SpeculationTree:
        """The speculation tree `propose` drafts, with its nodes' probs."""
        if context.max_draft_len < 1:
            return SpeculationTree()
        best = self.request_tree(context.token_ids, context.max_draft_len)
        other = self.global_tree(context)
        return other if other is not None and other.score > best.score else best

    def global_tree(self, context: DraftContext) -> SpeculationTree | None:
        """The best tree of the global trie (earlier outputs) after the context, or None where
        it keeps none; `speculation_tree` drafts it where it outscores the request's."""
        if not (self.learn and self.cached):
            return None
        tail = context.token_ids[-(self.max_depth - 1) :].tolist()
        return self.best_tree(self.global_trie, tail, context.max_draft_len)

    def observe(self, prompt: Sequence[int], output: Sequence[int], hidden_states=None) -> None:
        """A generation finished: keep its output in the global trie, evicting oldest first."""
        if not self.learn or self.max_cached_requests == 0 or self.max_cached_tokens == 0:
            return
        output = [int(t) for t in output][-self.max_cached_tokens :]
        if not output:
            return
        self.global_trie.add(output)
        self.cached.append(output)
        while (len(self.cached) > self.max_cached_requests
               or self.global_trie.root.count > self.max_cached_tokens):
            self.global_trie.remove(self.cached.popleft())

    @property
    def memory_nodes(self) -> int:
        """Trie nodes held now (global + per-request)."""
        return self.global_trie.num_nodes + self.request_trie.num_nodes
