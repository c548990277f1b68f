"""Predicted outputs (OpenAI's `prediction`): the text the caller expects back (a file being
edited, a document rewritten in part) as a draft source beside any method's own.

Each step the prediction proposes what follows the output so far in it:

1. while the output is still the prediction's own beginning, the prediction's next tokens;
2. once they part, the continuation of the output's last `min_match`..`max_match` tokens where
   they last occur in the prediction (prompt lookup over the prediction), so an edit in the
   middle of a file picks the prediction up again after it.

`with_prediction` gives a request's drafter that source:
- `hybrid`: one more of its sources (`PredictionSource`), its nodes weighed by hybrid's
  acceptance table like every other source's and cut by its budget, so a prediction that
  keeps missing stops costing rows;
- any other method: `WithPrediction` puts the prediction's draft first and the method's own
  drafts after it; the loop merges them into one tree and the budget prices it.
Verification keeps only what the model itself would emit, so a wrong prediction costs rows,
never a changed token.

`prediction_tokens` counts what OpenAI reports: of the prediction's tokens, how many appear in
the completion, in order (`accepted_prediction_tokens`), and how many do not (`rejected_...`).
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher

import numpy as np

from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.drafters.hybrid import HybridDrafter


def with_prediction(drafter: Drafter, prediction: Sequence[int], prompt_len: int) -> Drafter:
    """`drafter` (a request's own fork) with the request's prediction as one more source."""
    source = PredictionSource(prediction, prompt_len)
    if isinstance(drafter, HybridDrafter):
        return drafter.with_source("prediction", source)
    return WithPrediction(drafter, source)


class PredictionSource(Drafter):
    """The prediction's continuation of the output so far (steps 1 and 2 above), one draft."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], prompt_len: int, draft_len: int = 16,
                 min_match: int = 2, max_match: int = 8) -> None:
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.prompt_len = prompt_len  # the output starts after it in the context
        self.draft_len, self.min_match, self.max_match = draft_len, min_match, max_match

    def propose(self, context: DraftContext) -> list[Draft]:
        draft = self.predicted(context.token_ids[self.prompt_len:])[: context.max_draft_len]
        return [draft] if draft else []

    def fork(self) -> PredictionSource:
        return self  # nothing of one generation's own

    def predicted(self, output: np.ndarray) -> Draft:
        """What the prediction says follows `output` (the tokens emitted so far)."""
        done = len(output)
        if done <= len(self.prediction) and np.array_equal(self.prediction[:done], output):
            return self.prediction[done:done + self.draft_len].tolist()  # 1. still on it
        longest = min(self.max_match, done, len(self.prediction))
        for length in range(longest, self.min_match - 1, -1):  # 2. lookup, longest tail first
            tail = output[done - length:]
            windows = np.lib.stride_tricks.sliding_window_view(self.prediction, length)
            found = np.flatnonzero((windows == tail).all(axis=1))
            if len(found):
                start = int(found[-1]) + length
                return self.prediction[start:start + self.draft_len].tolist()
        return []


class WithPrediction(Drafter):
    """A request's drafter with its prediction as one more source, drafted first."""

    def __init__(self, base: Drafter, source: PredictionSource) -> None:
        self.base, self.source = base, source
        self.name = f"{base.name}+prediction"  # its acceptance is learned apart from the base's
        self.sizes_its_trees = base.sizes_its_trees

    def propose(self, context: DraftContext) -> list[Draft]:
        return [*self.source.propose(context), *self.base.propose(context)]

    def check_target(self, target) -> None:
        self.base.check_target(target)

    def observe(self, prompt, output, hidden_states=None) -> None:
        self.base.observe(prompt, output, hidden_states)


def prediction_tokens(prediction: Sequence[int], completion: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected): the prediction's tokens that appear in the completion in order
    (the longest matching blocks), and the rest, as OpenAI's usage reports them."""
    matcher = SequenceMatcher(None, list(prediction), list(completion), autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
