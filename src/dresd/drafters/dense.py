"""DReSD, dense retrieval drafting: drafts are what followed corpus positions whose hidden state
is nearest to the target's current one.

At each step the query is `context.hidden_state`: the target's last-layer state at the position
that predicted the bonus token (the context's last token), which the verify pass (or, on the
first step, the prefill) computed already, so drafting costs no forward. Then:

    key = transform(query)                       z-score, PCA, L2 norm (as the stored keys)
    ids = the k nearest stored keys              inner product = cosine
    keep entry e if value(e)[0] == bonus token   its context predicted the same next token
    draft(e) = value(e)[1 : 1 + len_drafts]      what followed it in the corpus

Drafts keep the ANN rank order; identical drafts are kept once (the token tree would merge them
anyway, and a distinct one is worth more), and at most `num_drafts` are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dresd.datastore.dense import DenseDatastore
from dresd.drafters.base import Draft, DraftContext
from dresd.models import Target


@dataclass
class DenseDrafter:
    datastore: str  # folder of a dense datastore built for the target
    k: int = 50  # neighbours searched (paper: 50)
    num_drafts: int = 10  # drafts per step at most (paper: 10)
    len_drafts: int = 10  # tokens per draft at most (paper: 10)
    name: str = "dresd"
    store: DenseDatastore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.k < 1 or self.num_drafts < 1 or self.len_drafts < 1:
            raise ValueError("DReSD needs k, num_drafts and len_drafts >= 1")
        self.store = DenseDatastore(self.datastore)

    def check_target(self, target: Target) -> None:
        """Refuse a datastore built by another model or tokenizer (the runner calls this)."""
        self.store.check_compatible(target)

    def propose(self, context: DraftContext) -> list[Draft]:
        draft_len = min(self.len_drafts, context.max_draft_len)
        if draft_len < 1:
            return []
        state = context.hidden_state.detach().to("cpu").float().numpy()
        ids = self.store.search(state, self.k)
        if len(ids) == 0:
            return []
        start, end = self.store.value_bounds(ids)
        stream = self.store.stream
        bonus = int(context.token_ids[-1])
        firsts = stream[start].astype(np.int64)
        drafts: list[Draft] = []
        for begin, stop in zip(start[firsts == bonus] + 1, end[firsts == bonus], strict=True):
            draft = stream[begin : min(stop, begin + draft_len)].tolist()
            if draft and draft not in drafts:
                drafts.append(draft)
                if len(drafts) == self.num_drafts:
                    break
        return drafts
