"""Adversarial drafters for the losslessness tests: each stresses one corner of the loop."""

from __future__ import annotations

import numpy as np

from dresd.decoding.drafter import Draft, DraftContext, Drafter


class RandomTreeDrafter(Drafter):
    """Random drafts of random lengths, often sharing prefixes: wide, deep, mostly wrong trees."""

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0, max_drafts: int = 6, max_len: int = 8):
        self.rng = np.random.default_rng(seed)
        self.vocab_size, self.max_drafts, self.max_len = vocab_size, max_drafts, max_len

    def propose(self, context: DraftContext) -> list[Draft]:
        drafts: list[Draft] = []
        for _ in range(self.rng.integers(0, self.max_drafts + 1)):
            if drafts and self.rng.random() < 0.5:  # branch off an earlier draft
                base = drafts[self.rng.integers(len(drafts))]
                draft = base[: self.rng.integers(0, len(base) + 1)]
            else:
                draft = []
            extra = self.rng.integers(1, self.max_len + 1)
            draft = draft + self.rng.integers(0, self.vocab_size, extra).tolist()
            drafts.append(draft)
        return drafts


class OracleDrafter(Drafter):
    """Drafts the model's own future output (known from a reference run), so long and full-draft
    acceptances happen; `corrupt` spoils one token of some drafts, a decoy draft competes, and
    `draft_len` may exceed what is left to generate."""

    name = "oracle"

    def __init__(self, prompt_len: int, reference: list[int], draft_len: int = 12,
                 corrupt: float = 0.0, seed: int = 0, vocab_size: int = 2):
        self.prompt_len, self.reference, self.draft_len = prompt_len, reference, draft_len
        self.corrupt, self.vocab_size = corrupt, vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, context: DraftContext) -> list[Draft]:
        done = len(context.token_ids) - self.prompt_len  # reference tokens already emitted
        truth = list(self.reference[done : done + self.draft_len])
        if not truth:
            return []
        drafts = [truth]
        if self.rng.random() < self.corrupt:
            wrong = list(truth)
            position = self.rng.integers(len(wrong))
            wrong[position] = (wrong[position] + 1) % self.vocab_size
            drafts.insert(0, wrong)  # the wrong draft first: order must not matter
        return drafts


class FixedDrafter(Drafter):
    """Always proposes the same drafts (e.g. the empty draft, or a very long one)."""

    name = "fixed"

    def __init__(self, drafts: list[Draft]):
        self.drafts = drafts

    def propose(self, context: DraftContext) -> list[Draft]:
        return [list(d) for d in self.drafts]
