"""The one small interface every drafter implements.

At each step the loop hands the drafter a `DraftContext` and gets back a list of drafts: token
sequences that would follow the context's last token (the bonus token the target just emitted).
Drafts come in the drafter's order of preference; the loop merges them into one token tree and
verifies it in one target forward. A drafter may return no drafts: the step is then a plain
one-token decode.

Two more hooks, both no-ops unless a drafter needs them: `check_target` before the first step
(a datastore refuses a model it was not built for; `hybrid` measures the verify-cost curve it
budgets by) and `observe` after a generation ends (drafters that learn from finished outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dresd.models import Target

Draft = list[int]


@dataclass
class DraftContext:
    token_ids: np.ndarray  # int64 [n]: prompt + output so far; the last is the bonus token
    # [d]: the target's last-layer hidden state at the position that predicted the bonus token,
    # on the model's device (a drafter whose index lives in host memory moves it there)
    hidden_state: torch.Tensor
    max_draft_len: int  # drafts are cut to this many tokens (fewer remain to be generated)


class Drafter:
    """What every drafter is: `propose` is its own; the hooks do nothing unless it overrides
    them. Drafters are dataclasses of their options (`make_drafter` builds one by name)."""

    name: str  # the method, as --method spells it
    # True for a drafter that prices its own trees by the verify-cost curve (hybrid): the
    # batched loop then cuts its trees only when other sequences share the forward
    sizes_its_trees: bool = False

    def propose(self, context: DraftContext) -> list[Draft]:
        """Drafts continuing `context.token_ids`, best first."""
        raise NotImplementedError

    def check_target(self, target: Target) -> None:
        """Called once with the target before generating: refuse one this drafter cannot
        serve, or prepare what depends on it."""

    def fork(self) -> Drafter:
        """A drafter for one more generation running beside this one's (the batched loop
        interleaves their steps): it shares what is learned across generations (datastores,
        learned outputs, acceptance statistics) and keeps its own per-generation state.
        Drafters with no per-generation state are their own fork."""
        return self

    def observe(self, prompt: Sequence[int], output: Sequence[int],
                hidden_states: torch.Tensor | None = None) -> None:
        """Called with every finished generation (`hidden_states`: the target's last-layer
        states of `output`, where the loop kept them), for drafters that learn from outputs."""
