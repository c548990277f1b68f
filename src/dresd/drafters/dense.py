"""DReSD, dense retrieval drafting: drafts are what followed corpus positions whose hidden state
is nearest to the target's current one.

At each step the query is `context.hidden_state`: the target's last-layer state at the position
that predicted the bonus token (the context's last token), which the verify pass (or, on the
first step, the prefill) computed already, so drafting costs no forward. Then:

    key = transform(query)                       z-score, PCA, L2 norm (as the stored keys)
    ids = the k nearest stored keys              inner product = cosine
    keep entry e if value(e)[0] == bonus token   its context predicted the same next token
    draft(e) = value(e)[1 : 1 + draft_len]       what followed it in the corpus

The paper's shape (the default): drafts keep the ANN rank order; identical drafts are kept once
(the token tree would merge them anyway, and a distinct one is worth more), and at most
`num_drafts` are returned, so the tree has up to num_drafts x draft_len nodes (the paper
calls draft_len `len_drafts`).

With a node budget (`max_tree_nodes` = N) the tree is picked as REST picks its own: every kept
entry's draft is counted and the N most frequent prefixes are kept (`drafters/prefixes.py`).
Where a verify forward grows dear with the tree (on a CPU, `benchmarks/results/engine.md`) a
small tree of the prefixes most neighbours agree on pays better than the paper's wide one.

Why these defaults (`benchmarks/results/retrieval/`: replayed on AR's outputs, bf16; GSM8K:
100 test questions, the model's own answers to all 7,473 train questions, 1.59M tokens;
HumanEval: 100 prompts, 1.00M tokens of the standard library; mean accepted length, bonus in):
- rank order vs agreement: at every node budget the most frequent prefixes beat drafts taken
  in rank order (GSM8K 2.04 vs 1.80 at 4 nodes, 2.46 vs 2.11 at 16, 2.70 vs 2.51 at 64;
  HumanEval 1.33 vs 1.22, 1.44 vs 1.32, 1.50 vs 1.44), so a node budget picks by agreement;
- k: more neighbours, more agreement: k = 10 / 50 / 200 gave 2.31 / 2.57 / 2.65 on GSM8K and
  1.35 / 1.46 / 1.52 on HumanEval (the paper's shape; 16 nodes by agreement: 2.46 -> 2.51 and
  1.44 -> 1.49 from 50 to 200), hence k = 200 (the paper: 50). The search costs about the same
  (an IVF scan does not depend on k) and only the neighbours whose next token is the bonus
  token are sliced; the step's drafting time did not move measurably (within this loaded
  machine's ~1 ms noise on a 9 ms exact scan);
- PCA: 32 / 64 / 128 dimensions / none (z-score and L2 only, 576) gave 2.45 / 2.57 / 2.63 /
  2.67 (GSM8K) and 1.39 / 1.46 / 1.48 / 1.51 (HumanEval): more dimensions, a little better;
  the paper's 64 keeps most of it at half the index bytes and scan time of 128 (a ninth of
  none's);
- key positions: every position vs the responses' only: 2.57 vs 2.54 (GSM8K): prompts'
  positions help a little (a question's own words predict its answer's), so all stay;
- template positions: the chat template's shared system turn (a fifth of a GSM8K store's keys)
  kept, deduplicated or dropped: 2.57 / 2.56 / 2.56 (GSM8K), 1.46 in all three (HumanEval):
  its keys never win a search, so they stay (the build needs no template knowledge);
- value length: drafts of 5 / 10 / 20 tokens: 2.48 / 2.57 / 2.58 (GSM8K), 1.45 / 1.46 / 1.46:
  10, as the paper;
- exact search vs IVF vs IVF-PQ at recall@10 0.9: 2.57 / 2.52 / 2.56 (GSM8K), 1.46 / 1.42
  (HumanEval, exact / IVF); IVF is the default above 20k entries for its speed (0.1-0.2 ms per
  step against ~9 ms for an exact scan of 1M keys), IVF-PQ (`--index ivfpq`) for stores whose
  keys outgrow RAM (0.3-0.5 ms per step).

With `learn` (`--learn`), each finished output's keys (from the hidden states the verify passes
computed) go into an in-memory side store (`learned.py`); the k nearest of both stores, merged
by score (the datastore's first on ties), are the neighbours.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from dresd.datastore.dense import DenseDatastore
from dresd.decoding.drafter import Candidate, Draft, DraftContext, Drafter
from dresd.drafters.learned import LearnedDenseStore
from dresd.drafters.prefixes import padded_prefix_tree
from dresd.errors import UserError
from dresd.kernels import drafting
from dresd.models.target import Target


def distinct_drafts(every: list[list[int]], num_drafts: int) -> list[Draft]:
    """The paper's shape: the first `num_drafts` distinct non-empty drafts, in rank order."""
    drafts: list[Draft] = []
    for draft in every:
        if draft and draft not in drafts:
            drafts.append(list(draft))
            if len(drafts) == num_drafts:
                break
    return drafts


def agreeing_prefixes(neighbours: list[list[int]]) -> dict[tuple[int, ...], int]:
    """The neighbours' drafts, each distinct one with its count, cut where no other draft
    follows it any more: one token past the longest prefix it shares with another draft. The
    nearest neighbour's draft and repeated drafts stay whole. A lone tail is a candidate that
    one neighbour in k proposes, rarely worth a node; dropping it keeps `hybrid`'s tree (and
    the time to build and score it) small."""
    counts = Counter(map(tuple, neighbours))
    if len(counts) < 2:
        return dict(counts)
    nearest = tuple(neighbours[0])
    ordered = sorted(counts)  # drafts that share a prefix are neighbours in this order

    def shared(a: tuple, b: tuple) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    lcp = [shared(a, b) for a, b in zip(ordered, ordered[1:], strict=False)]
    kept: Counter = Counter()
    for i, draft in enumerate(ordered):
        whole = counts[draft] > 1 or draft == nearest
        cut = max(lcp[i - 1] if i > 0 else 0, lcp[i] if i < len(lcp) else 0) + 1
        kept[draft if whole else draft[:cut]] += counts[draft]
    return dict(kept)


def distinct_padded(rows: np.ndarray, num_drafts: int) -> list[Draft]:
    """`distinct_drafts` of rows of token ids + 1 followed by zeros (`neighbour_rows`),
    converting only the rows it reads: a few blocks of up to k rows, as far as it needs."""
    drafts: list[Draft] = []
    seen: set[tuple[int, ...]] = set()
    block = 2 * num_drafts  # rows converted at a time: one tolist of all k cost ~15 us cold
    for first in range(0, len(rows), block):
        for row in rows[first : first + block].tolist():
            key = tuple(row)
            if row[0] and key not in seen:  # equal padded rows: equal drafts
                seen.add(key)
                drafts.append([token - 1 for token in row if token])
                if len(drafts) == num_drafts:
                    return drafts
    return drafts


def unpadded(rows: np.ndarray) -> list[list[int]]:
    """Rows of token ids + 1 followed by zeros, as token-id lists."""
    lengths = np.count_nonzero(rows, axis=1).tolist()
    return [row[:n] for row, n in zip((rows - 1).tolist(), lengths, strict=True)]


def padded(drafts: list[list[int]], width: int) -> np.ndarray:
    """`unpadded`'s inverse: int32 [len(drafts), width] rows of token ids + 1, then zeros (the
    rows the C kernel slices from the store, so that every path drafts from one form)."""
    rows = np.zeros((len(drafts), width), dtype=np.int32)
    for row, draft in zip(rows, drafts, strict=True):
        row[: len(draft)] = np.asarray(draft, dtype=np.int32) + 1
    return rows


@dataclass(frozen=True)
class DenseOptions:
    """DenseDrafter's options (`--k`, `--num-drafts`, `--draft-len`, `--max-tree-nodes`,
    `--learn`)."""

    # a dense datastore built for the target: its folder, or one already opened (shared)
    datastore: str | DenseDatastore
    k: int = 200  # neighbours searched (paper: 50; 200 measured better, see above)
    num_drafts: int = 10  # drafts per step at most (paper: 10)
    draft_len: int = 10  # tokens per draft at most (the paper's len_drafts: 10)
    # None: the paper's shape (num_drafts drafts in ANN rank order); N: a tree of the N most
    # frequent prefixes of every kept entry's draft (num_drafts then does not apply)
    max_tree_nodes: int | None = None
    learn: bool = False  # also search keys of earlier outputs (in memory)
    max_cached_requests: int = 1000  # learned outputs kept, oldest evicted first...
    max_cached_tokens: int = 100_000  # ... and learned tokens kept

    def __post_init__(self) -> None:
        if self.k < 1 or self.num_drafts < 1 or self.draft_len < 1:
            raise UserError("DReSD needs k, num_drafts and draft_len >= 1")
        if self.max_tree_nodes is not None and self.max_tree_nodes < 1:
            raise UserError("DReSD needs max_tree_nodes >= 1 (or None: the paper's shape)")


class DenseDrafter(DenseOptions, Drafter):
    """Its options, the datastore it opened and (with `learn`) the outputs it learned."""

    name = "dresd"
    store: DenseDatastore
    learned: LearnedDenseStore | None

    def __post_init__(self) -> None:
        super().__post_init__()
        opened = isinstance(self.datastore, DenseDatastore)
        self.store = self.datastore if opened else DenseDatastore(self.datastore)
        self.learned = None
        store = self.store  # as the C kernel reads its drafts (None: it cannot), once
        self._store_in_c = drafting.dense_store(store.offsets, store.stream, store.doc_starts,
                                                store.value_len)
        # the key, the search and the drafts in one C call, where the kernel reads all three
        # (None: the key in C, FAISS's search, the drafts in C, as three calls)
        lists, weights = getattr(store.index, "lists", None), store.transform.key_weights
        self._query_in_c = (drafting.dense_plan(weights, lists, store.index.nprobe,
                                                self._store_in_c)
                            if lists is not None and weights is not None
                            and self._store_in_c is not None else None)
        if self.learn:
            self.learned = LearnedDenseStore(self.store.transform, self.max_cached_requests,
                                             self.max_cached_tokens)

    def check_target(self, target: Target) -> None:
        """Refuse a datastore built by another model or tokenizer (the runner calls this)."""
        self.store.check_compatible(target)

    def with_options(self, **options) -> DenseDrafter:
        """Another shape over the same opened datastore and the same learned outputs."""
        variant = dataclasses.replace(self, **{"datastore": self.store, **options})
        if variant.learn and self.learned is not None:
            variant.learned = self.learned
        return variant

    def for_tenant(self) -> DenseDrafter:
        """The same opened datastore, a learned store of its own (with `learn`)."""
        return dataclasses.replace(self, datastore=self.store)

    def neighbour_drafts(self, context: DraftContext, draft_len: int) -> list[list[int]]:
        """Every kept neighbour's draft, in rank order, repeats included: the entries (of the
        datastore, and of the learned store with `learn`) whose stored first token is the bonus
        token, and the `draft_len` tokens after it."""
        return unpadded(self.neighbour_rows(context, draft_len))

    def neighbour_rows(self, context: DraftContext, draft_len: int) -> np.ndarray:
        """`neighbour_drafts` as rows of token ids + 1 followed by zeros, int32 [kept,
        draft_len]: sliced from the store by the C kernel where it reads the store, else here."""
        bonus = int(context.token_ids[-1])
        if self.learned is not None and self.learned.index is not None:
            return padded(self._learned_neighbours(context.hidden_state, bonus, draft_len),
                          draft_len)
        store = self.store
        if self._in_one_call(context.hidden_state):
            return drafting.dense_neighbour_rows(self._query_in_c, context.hidden_state,
                                                 self.k, bonus, draft_len)
        if self._store_in_c is not None:  # it skips the index's -1 padding itself
            ids = store.search(context.hidden_state, self.k, padded=True)
            return drafting.dense_drafts(ids, self._store_in_c, bonus, draft_len)
        ids = store.search(context.hidden_state, self.k)
        start, end = store.value_bounds(ids)
        stream = store.stream
        firsts = stream[start].astype(np.int64)
        kept = zip(start[firsts == bonus] + 1, end[firsts == bonus], strict=True)
        return padded([stream[begin : min(stop, begin + draft_len)].tolist()
                       for begin, stop in kept], draft_len)

    def propose(self, context: DraftContext) -> list[Draft]:
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        rows = self.neighbour_rows(context, draft_len)
        if self.max_tree_nodes is not None:
            return padded_prefix_tree(rows, self.max_tree_nodes)
        return distinct_padded(rows, self.num_drafts)

    def candidates(self, context: DraftContext) -> list[Candidate]:
        """Every kept neighbour's draft, with the number of neighbours that propose it; drafts
        cut where no other neighbour follows them (`agreeing_prefixes`)."""
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        if self._in_one_call(context.hidden_state):
            found = drafting.dense_candidates(self._query_in_c, context.hidden_state, self.k,
                                              int(context.token_ids[-1]), draft_len)
            return [Candidate(draft, neighbours=count) for draft, count in found]
        rows = self.neighbour_rows(context, draft_len)
        found = (drafting.agreeing_prefixes(rows) if drafting.kernel() is not None
                 else agreeing_prefixes(unpadded(rows)).items())
        return [Candidate(list(draft), neighbours=count) for draft, count in found]

    def _in_one_call(self, state: torch.Tensor | np.ndarray) -> bool:
        """Whether the query runs as one kernel call: a plan (an IVF store with fp16 codes, the
        kernel compiled), no learned outputs to merge, and a state on the CPU."""
        return (self._query_in_c is not None and isinstance(state, torch.Tensor) and state.is_cpu
                and (self.learned is None or self.learned.index is None)
                and drafting.kernel() is not None)

    def _learned_neighbours(self, state: torch.Tensor, bonus: int, draft_len: int
                            ) -> list[list[int]]:
        """Drafts of the k nearest entries of the datastore and the learned store together
        (merged by score, the datastore's first on ties) that predicted the bonus token."""
        key = self.store.transform.key(state)
        disk_scores, disk_ids = self.store.index.search(key[None, :], self.k)
        valid = disk_ids[0] >= 0
        disk_scores, disk_ids = disk_scores[0][valid], disk_ids[0][valid]
        learned_scores, learned_ids = self.learned.search(key, self.k)
        ranked = sorted([(-float(s), 0, int(e)) for s, e in zip(disk_scores, disk_ids,
                                                                strict=True)]
                        + [(-float(s), 1, int(e)) for s, e in zip(learned_scores, learned_ids,
                                                                  strict=True)])[: self.k]
        values = []
        for _, source, entry in ranked:
            if source == 0:
                start, end = self.store.value_bounds(np.array([entry]))
                value = self.store.stream[start[0] : end[0]]  # value[0]: the predicted token
            else:
                value = self.learned.value(entry, draft_len + 1)
            if len(value) and int(value[0]) == bonus:
                values.append(np.asarray(value[1 : 1 + draft_len]).tolist())
        return values

    def observe(self, prompt: list[int], output: list[int], hidden_states=None) -> None:
        """A generation finished: with `learn`, keys for its tokens join the side store."""
        if self.learned is not None and hidden_states is not None:
            self.learned.add(output, hidden_states.detach().to("cpu").float().numpy())
