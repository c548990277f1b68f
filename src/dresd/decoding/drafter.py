"""The one small interface every drafter implements.

At each step the loop hands the drafter a `DraftContext` and gets back a list of drafts: token
sequences that would follow the context's last token (the bonus token the target just emitted).
Drafts come in the drafter's order of preference; the loop merges them into one token tree and
verifies it in one target forward. A drafter may return no drafts: the step is then a plain
one-token decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

Draft = list[int]


@dataclass
class DraftContext:
    token_ids: np.ndarray  # int64 [n]: prompt + output so far; the last is the bonus token
    # [d]: the target's last-layer hidden state at the position that predicted the bonus token,
    # on the model's device (a drafter whose index lives in host memory moves it there)
    hidden_state: torch.Tensor
    max_draft_len: int  # drafts are cut to this many tokens (fewer remain to be generated)


class Drafter(Protocol):
    name: str

    def propose(self, context: DraftContext) -> list[Draft]:
        """Drafts continuing `context.token_ids`, best first."""
        ...
