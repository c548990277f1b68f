"""PLD, prompt lookup decoding: draft what followed an earlier occurrence of the context's end.

For n from `max_ngram` down to `min_ngram`, the last n tokens of the context are searched for
earlier in the context (prompt and output so far). The first n with a match wins; the tokens
after each match, up to `draft_len`, are drafts. The most recent matches come first, and up to
`num_drafts` distinct continuations are returned.

The lookup runs in one C call where the drafting kernel compiles (`kernels/drafting.py`), else
in numpy below; both draft the same, as the tests check against a brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.errors import UserError
from dresd.kernels import drafting


@dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    """Its options are all it is: it keeps no state."""

    name = "pld"
    max_ngram: int = 3  # longest suffix of the context to look up
    min_ngram: int = 1  # shortest suffix worth a draft
    draft_len: int = 10  # tokens per draft
    num_drafts: int = 1  # distinct continuations (most recent match first) per step

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError("PLD needs 1 <= min_ngram <= max_ngram")
        if self.draft_len < 1 or self.num_drafts < 1:
            raise UserError("PLD needs draft_len >= 1 and num_drafts >= 1")

    def propose(self, context: DraftContext) -> list[Draft]:
        tokens = context.token_ids
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        if drafting.kernel() is not None and len(tokens):  # the same drafts, in one C call
            return drafting.prompt_lookup(tokens, self.max_ngram, self.min_ngram, draft_len,
                                          self.num_drafts)
        # The earlier positions e (with a next token) where the context's last token recurs;
        # keep those where the one before also matches, and so on: after j rounds, `ends` are
        # the ends of the earlier (j + 1)-grams equal to the context's last j + 1 tokens. One
        # scan of the context, then small arrays (drafting runs with cold caches: numpy calls
        # over the whole context are what cost).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        matches = [ends]  # matches[n - 1]: ends of the n-gram matches
        for back in range(1, min(self.max_ngram, len(tokens) - 1)):
            ends = ends[ends >= back]
            ends = ends[tokens[ends - back] == tokens[-1 - back]]
            matches.append(ends)
        for n in range(len(matches), self.min_ngram - 1, -1):
            if len(matches[n - 1]) == 0:
                continue
            drafts: list[Draft] = []
            for end in matches[n - 1][::-1].tolist():  # most recent first
                draft = tokens[end + 1 : end + 1 + draft_len].tolist()
                if draft not in drafts:
                    drafts.append(draft)
                    if len(drafts) == self.num_drafts:
                        break
            return drafts
        return []
