"""DReSD, dense retrieval drafting: drafts are what followed corpus positions whose hidden state
is nearest to the target's current one.

At each step the query is `context.hidden_state`: the target's last-layer state at the position
that predicted the bonus token (the context's last token), which the verify pass (or, on the
first step, the prefill) computed already, so drafting costs no forward. Then:

    key = transform(query)                       z-score, PCA, L2 norm (as the stored keys)
    ids = the k nearest stored keys              inner product = cosine
    keep entry e if value(e)[0] == bonus token   its context predicted the same next token
    draft(e) = value(e)[1 : 1 + len_drafts]      what followed it in the corpus

The paper's shape (the default): drafts keep the ANN rank order; identical drafts are kept once
(the token tree would merge them anyway, and a distinct one is worth more), and at most
`num_drafts` are returned, so the tree has up to num_drafts x len_drafts nodes.

With a node budget (`max_tree_nodes` = N) the tree is picked as REST picks its own: every kept
entry's draft is counted and the N most frequent prefixes are kept (`drafters/prefixes.py`).
Where a verify forward grows dear with the tree (on a CPU, `benchmarks/results/engine.md`) a
small tree of the prefixes most neighbours agree on pays better than the paper's wide one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dresd.datastore.dense import DenseDatastore
from dresd.drafters.base import Draft, DraftContext
from dresd.drafters.prefixes import prefix_tree_drafts
from dresd.models import Target


@dataclass
class DenseDrafter:
    datastore: str  # folder of a dense datastore built for the target
    k: int = 50  # neighbours searched (paper: 50)
    num_drafts: int = 10  # drafts per step at most (paper: 10)
    len_drafts: int = 10  # tokens per draft at most (paper: 10)
    # None: the paper's shape (num_drafts drafts in ANN rank order); N: a tree of the N most
    # frequent prefixes of every kept entry's draft (num_drafts then does not apply)
    max_tree_nodes: int | None = None
    name: str = "dresd"
    store: DenseDatastore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.k < 1 or self.num_drafts < 1 or self.len_drafts < 1:
            raise ValueError("DReSD needs k, num_drafts and len_drafts >= 1")
        if self.max_tree_nodes is not None and self.max_tree_nodes < 1:
            raise ValueError("DReSD needs max_tree_nodes >= 1 (or None: the paper's shape)")
        self.store = DenseDatastore(self.datastore)

    def check_target(self, target: Target) -> None:
        """Refuse a datastore built by another model or tokenizer (the runner calls this)."""
        self.store.check_compatible(target)

    def neighbour_drafts(self, context: DraftContext, draft_len: int) -> list[np.ndarray]:
        """Every kept neighbour's draft, in ANN rank order, repeats included: the entries
        whose stored first token is the bonus token, and the `draft_len` tokens after it."""
        state = context.hidden_state.detach().to("cpu").float().numpy()
        ids = self.store.search(state, self.k)
        if len(ids) == 0:
            return []
        start, end = self.store.value_bounds(ids)
        stream = self.store.stream
        bonus = int(context.token_ids[-1])
        firsts = stream[start].astype(np.int64)
        kept = zip(start[firsts == bonus] + 1, end[firsts == bonus], strict=True)
        return [stream[begin : min(stop, begin + draft_len)] for begin, stop in kept]

    def propose(self, context: DraftContext) -> list[Draft]:
        draft_len = min(self.len_drafts, context.max_draft_len)
        if draft_len < 1:
            return []
        every = self.neighbour_drafts(context, draft_len)
        if self.max_tree_nodes is not None:
            return prefix_tree_drafts(every, self.max_tree_nodes)
        drafts: list[Draft] = []
        for draft in every:
            draft = draft.tolist()
            if draft and draft not in drafts:
                drafts.append(draft)
                if len(drafts) == self.num_drafts:
                    break
        return drafts
