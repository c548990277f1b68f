"""Drafts from the target's own multi-token prediction block (`--method mtp`; a `hybrid`
source where asked, `hybrid[mtp=1]`): Qwen3.5 files carry one (`models/mtp.py` says what it
computes), trained beside the model to guess the token after next.

At each step the loop reports the hidden states of the positions it kept (`DraftContext.
hidden_states`: the accepted path's, the last being the state that predicted the bonus token).
Each becomes one row of the block's own KV cache, paired with the token that followed it;
the last row's guess is the first drafted token, and the block chained on its own output
state gives the next ones (`depth` in all: one chain, the block's argmax at each). Those
chained rows are scratch: the next step writes over them, since its accepted states replace
them.

Positions the loop did not report (a prompt's earlier chunks; steps where `hybrid` did not
consult this source) have no row: the block's attention sees fewer positions, which may cost
acceptance, never exactness (every draft is verified by the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.errors import UserError
from dresd.models.mtp import MultiTokenPredictor

if TYPE_CHECKING:
    from dresd.models.target import Target


@dataclass(frozen=True)
class MTPOptions:
    """MTPDrafter's options."""

    depth: int = 2  # tokens drafted a step: the block's guess, then its own chained guesses

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise UserError("mtp's depth must be >= 1")


class MTPDrafter(MTPOptions, Drafter):
    """Its options, the target's block, and the block's cache for the generation it drafts
    for."""

    name = "mtp"
    block: MultiTokenPredictor | None  # the target's; set by `check_target`

    def __post_init__(self) -> None:
        super().__post_init__()
        self.block = None
        self._reset()

    def _reset(self) -> None:
        self.cache = None if self.block is None else self.block.new_cache()
        self.rows = 0  # rows of `cache` that hold reported positions
        self.next_position = 0  # the first position with no row yet

    def check_target(self, target: Target) -> None:
        block = getattr(target.model, "mtp", None)
        if not isinstance(block, MultiTokenPredictor):
            raise UserError(
                "method mtp drafts with the model's own multi-token prediction block, and this "
                "model has none: it is read from a Qwen3.5 GGUF file that keeps its MTP layers "
                "(llama.cpp's convert_hf_to_gguf.py without --no-mtp)")
        self.block = block
        self._reset()

    def fork(self) -> MTPDrafter:
        """The same block with a cache of its own (one per generation)."""
        return self.with_options()

    def with_options(self, **options) -> MTPDrafter:
        """Another depth, the same block (`check_target` found it), a cache of its own."""
        variant = dataclasses.replace(self, **options)
        variant.block = self.block
        variant._reset()
        return variant

    def propose(self, context: DraftContext) -> list[Draft]:
        depth = min(self.depth, context.max_draft_len)
        if self.block is None or depth < 1:
            return []
        tokens = context.token_ids
        n = len(tokens)  # the bonus token sits at position n - 1
        states = context.hidden_states
        if states is None:
            states = context.hidden_state[None]
        first = n - 1 - len(states)  # the position of states[0]
        if self.next_position > n - 1:  # another sequence than the one cached: start over
            self._reset()
        skip = max(self.next_position - first, 0)
        if skip >= len(states):  # nothing new (asked twice at one step): redo the last row
            skip = len(states) - 1
            self.rows -= 1
        # 1. One row per newly reported position p: its state, and token p + 1 after it.
        positions = list(range(first + skip, n - 1))
        pair_tokens = [int(token) for token in tokens[first + skip + 1:n]]
        out, logits = self.block(self.cache, self.rows, pair_tokens, states[skip:], positions)
        self.rows += len(positions)
        self.next_position = n - 1
        # 2. The last row guesses token n; the block chained on its own state guesses on.
        draft = [int(logits[-1].argmax())]
        state = out[-1:]
        for step in range(1, depth):
            state, logits = self.block(self.cache, self.rows + step - 1, draft[-1:], state,
                                       [n - 2 + step])
            draft.append(int(logits[-1].argmax()))
        self.cache.length = self.rows  # the chained rows were scratch
        return [draft]
