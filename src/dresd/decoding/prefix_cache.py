"""Keys and values of token sequences already read, kept across requests and turns.

A radix tree over token ids, one per `cache_salt`: each node holds the keys and values of its
edge's tokens, [layers, kv_heads, tokens, head_dim] each, copied out of the sequence that
computed them. A request whose prompt starts with a cached path gets those rows copied into its
own KV buffer (`SequenceKV.load`) and prefills only the rest (`decoding/batch.py`).

Why a radix tree and not chained block hashes: dresd's forward makes a cached key the same bits
whatever chunk, step or tree computed it (`decoding/forward.py`), so a hit need not stop at a
block boundary; the tree matches to the token, holds a shared prefix once whatever branches
from it, and its leaves are the natural unit of LRU eviction. Why copies and not pages: the C
decoder reads a sequence's cache from one contiguous buffer; a hit's copy costs ~23 KB per
token on the default model (a few ms for 1,000 tokens), against ~1-2 ms of compute per token
read afresh.

What is cached: a prompt's rows once it is prefilled, and at the end of a request the rows of
everything it committed (prompt and emitted tokens: a rejected draft's row never stays in a
sequence's buffer, `SequenceKV.keep`), so a chat's next turn hits on its whole history.

Bounded: `capacity_bytes` in all. Inserting evicts the least recently used leaves first; a
node on the path of a running request (locked from its lookup to its end) is never evicted;
what still does not fit is not cached (the request runs all the same).

Thread-safe: the engine's worker inserts and looks up, a server's handler may `clear` or read
`stats` at any time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dresd.decoding.kv_cache import SequenceKV

DEFAULT_MB = 2048  # ~93k tokens of the default model's bf16 keys and values


@dataclass(eq=False)
class Node:
    """An edge of the tree: its tokens and their keys and values (None for a root)."""

    tokens: tuple[int, ...]
    keys: torch.Tensor | None
    values: torch.Tensor | None
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)  # first token -> child
    locks: int = 0  # running requests whose path passes here (or ends here)
    used: int = 0  # the cache's clock when last matched or inserted

    @property
    def bytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class Hit:
    """A lookup's answer: `length` tokens cached; `node` is locked until `release`d."""

    length: int
    node: Node | None


@dataclass
class PrefixCacheStats:
    """Counters since start: tokens asked for and found, entries evicted, bytes held now."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached
    evictions: int = 0  # nodes evicted to make room
    evicted_tokens: int = 0
    bytes: int = 0
    capacity_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Token-id radix trees (one per salt) of cached keys and values; see the module docstring."""

    def __init__(self, capacity_mb: float = DEFAULT_MB) -> None:
        if capacity_mb < 0:
            raise ValueError(f"the prefix cache's size must be >= 0 MB, got {capacity_mb}")
        self.capacity_bytes = int(capacity_mb * 2**20)
        self.roots: dict[str, Node] = {}
        self.bytes = 0
        self.stats = PrefixCacheStats(capacity_bytes=self.capacity_bytes)
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self._shape: tuple | None = None  # (layers, kv_heads, head_dim, dtype) of the entries

    # -- lookups ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], salt: str, sequence: SequenceKV,
               limit: int) -> Hit:
        """Copy the keys and values of the longest cached prefix of `tokens[:limit]` into the
        empty `sequence`; returns its length and locks its path (`release` when done)."""
        with self._lock:
            self.stats.queries += len(tokens)
            node, length, path = self._walk(salt, tokens[:limit])
            if length == 0 or not self._fits(sequence):
                return Hit(0, None)
            now = next(self._clock)
            start = 0
            for edge in path:
                take = min(len(edge.tokens), length - start)
                sequence.load(start, edge.keys[:, :, :take], edge.values[:, :, :take])
                edge.used = now
                start += take
            self._lock_path(node, +1)
            self.stats.hits += length
            return Hit(length, node)

    def match_length(self, tokens: Sequence[int], salt: str, limit: int) -> int:
        """How many tokens of `tokens[:limit]` a `lookup` would find now (nothing copied,
        locked or counted)."""
        with self._lock:
            return self._walk(salt, tokens[:limit])[1]

    def release(self, hit: Hit | None) -> None:
        """Unlock the path a `lookup` (or `insert`) locked."""
        if hit is not None and hit.node is not None:
            with self._lock:
                self._lock_path(hit.node, -1)
                hit.node = None

    def _walk(self, salt: str, tokens: Sequence[int]) -> tuple[Node | None, int, list[Node]]:
        """The deepest node matching a prefix of `tokens`, the matched length (it may end
        inside that node's edge) and the nodes on the way (root excluded)."""
        node = self.roots.get(salt)
        length, path = 0, []
        while node is not None and length < len(tokens):
            child = node.children.get(tokens[length])
            if child is None:
                break
            same = _common(child.tokens, tokens[length:])
            path.append(child)
            length += same
            node = child
            if same < len(child.tokens):
                break
        return (node if path else None), length, path

    # -- inserts ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], salt: str, sequence: SequenceKV,
               hold: Hit | None = None) -> Hit:
        """Cache `tokens` (their keys and values: rows [0, len(tokens)) of `sequence`), as
        much of them as fits. `hold`: a running request's lock, released here; then the
        inserted path is locked in its place and returned (the request keeps its entries)."""
        with self._lock:
            if hold is not None and hold.node is not None:
                self._lock_path(hold.node, -1)
                hold.node = None
            if not tokens or not self._fits(sequence):
                return Hit(0, None)
            node, at = self._descend(salt, tokens)
            if at < len(tokens):
                node, at = self._extend(node, tokens, at, sequence)
            self.stats.bytes = self.bytes
            if hold is None or node.parent is None:
                return Hit(0, None)
            self._lock_path(node, +1)
            return Hit(at, node)

    def _descend(self, salt: str, tokens: Sequence[int]) -> tuple[Node, int]:
        """The node where `tokens` leave the tree (splitting an edge they leave midway) and
        how many of them the path to it holds; every node on the way marked used now."""
        node = self.roots.setdefault(salt, Node((), None, None, None))
        now, at = next(self._clock), 0
        node.used = now
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                break
            same = _common(child.tokens, tokens[at:])
            if same < len(child.tokens):
                child = self._split(child, same)
            node, at = child, at + same
            node.used = now
        return node, at

    def _extend(self, node: Node, tokens: Sequence[int], at: int,
                sequence: SequenceKV) -> tuple[Node, int]:
        """A new leaf under `node` for tokens[at:] (rows of `sequence`), cut to what fits after
        evicting what may go (never `node`'s path); returns the deepest node and its depth."""
        per_token = self._bytes_per_token(sequence)
        self._lock_path(node, +1)  # the path it hangs from stays while room is made
        self._evict(per_token * (len(tokens) - at))
        self._lock_path(node, -1)
        end = at + min(len(tokens) - at, max(0, self.capacity_bytes - self.bytes) // per_token)
        if end == at:
            return node, at
        keys, values = sequence.rows(at, end)
        leaf = Node(tuple(tokens[at:end]), keys, values, node, used=node.used)
        node.children[tokens[at]] = leaf
        self.bytes += leaf.bytes
        return leaf, end

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` tokens: a new node takes the first `at` (and the
        locks and age of `node`); `node` keeps the rest below it. Returns the new node."""
        head = Node(node.tokens[:at], node.keys[:, :, :at].clone(),
                    node.values[:, :, :at].clone(), node.parent, locks=node.locks,
                    used=node.used)
        node.parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.keys, node.values = node.keys[:, :, at:].clone(), node.values[:, :, at:].clone()
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    # -- eviction -----------------------------------------------------------------------------

    def _evict(self, needed: int, roots: list[Node] | None = None) -> None:
        """Drop least recently used unlocked leaves (of the trees of `roots`, else of all)
        until `needed` more bytes fit (or nothing more can go)."""
        if self.bytes + needed <= self.capacity_bytes:
            return
        leaves = [(node.used, id(node), node) for node in self._nodes(roots)
                  if not node.children and node.locks == 0 and node.parent is not None]
        heapq.heapify(leaves)
        while leaves and self.bytes + needed > self.capacity_bytes:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            self._drop(node)
            if parent.parent is not None and not parent.children and parent.locks == 0:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def _drop(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.tokens[0]]
        self.bytes -= node.bytes
        self.stats.evictions += 1
        self.stats.evicted_tokens += len(node.tokens)
        self.stats.bytes = self.bytes
        if parent.parent is None and not parent.children and parent.locks == 0:  # empty root
            self.roots = {salt: root for salt, root in self.roots.items() if root is not parent}

    def clear(self, salt_prefix: str = "") -> int:
        """Drop every entry no running request holds, of the salts that start with
        `salt_prefix` (a tenant's: all of them by default); returns the bytes freed."""
        with self._lock:
            held = self.bytes
            roots = [root for salt, root in self.roots.items() if salt.startswith(salt_prefix)]
            self._evict(self.capacity_bytes + 1, roots)  # asks for more than can ever fit
            return held - self.bytes

    # -- helpers ------------------------------------------------------------------------------

    def _nodes(self, roots: list[Node] | None = None) -> list[Node]:
        found, stack = [], list(self.roots.values() if roots is None else roots)
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    @staticmethod
    def _lock_path(node: Node, delta: int) -> None:
        while node is not None:
            node.locks += delta
            node = node.parent

    def _fits(self, sequence: SequenceKV) -> bool:
        """Whether `sequence`'s rows are of the kind cached here (the first sequence decides:
        one cache serves one model)."""
        layers, kv_heads, _, head_dim = sequence.shape
        shape = (layers, kv_heads, head_dim, sequence.dtype)
        if self._shape is None:
            self._shape = shape
        if shape != self._shape:
            raise ValueError(f"this prefix cache holds keys of shape {self._shape}, "
                             f"not {shape}: one cache serves one model")
        return self.capacity_bytes > 0

    @staticmethod
    def _bytes_per_token(sequence: SequenceKV) -> int:
        layers, kv_heads, _, head_dim = sequence.shape
        element = torch.empty((), dtype=sequence.dtype).element_size()
        return 2 * layers * kv_heads * head_dim * element


def _common(edge: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens `edge` and `tokens` share."""
    same = 0
    for a, b in zip(edge, tokens, strict=False):
        if a != b:
            break
        same += 1
    return same
