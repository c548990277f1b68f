"""The drafter that drafts nothing: plain decoding through the speculative loop.

It is the like-for-like baseline: same loop, same cache handling, same bookkeeping, one token per
target forward.
"""

from __future__ import annotations

from dresd.decoding.drafter import Draft, DraftContext, Drafter


class NoDrafter(Drafter):
    name = "none"

    def propose(self, context: DraftContext) -> list[Draft]:
        return []
