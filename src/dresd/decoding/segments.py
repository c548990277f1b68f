"""What a target forward takes and gives: a sequence's rows in one forward (`Segment`), its
logits and hidden states (`SegmentOutput`), the additive mask of a segment's rows, and the LM
head over every segment's wanted rows at once (`split_outputs`). Shared by every forward
(`forward.py`'s, `recurrent.py`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from dresd.decoding.sampling import greedy_tokens, top_two


@dataclass
class Segment:
    """A sequence's rows in one forward.

    Row i is token `token_ids[i]` at position `start + depths[i]`; it sees the sequence's
    cache (`start` entries) and the rows `ancestors[i]` marks (itself included). A prompt
    chunk is a chain: depths 0, 1, 2, ... and `ancestors` None (causal).
    """

    sequence: object  # the handle `new_sequence` returned
    token_ids: list[int]
    start: int  # cached entries of this sequence before these rows
    depths: list[int] | None = None  # None: 0, 1, 2, ... (a chain)
    ancestors: torch.Tensor | None = None  # bool [t, t]; None: causal
    logits_rows: str = "all"  # "all", "last" (a prompt chunk's last) or "none"
    top2: bool = False  # also the two best logits of those rows (the exactness check's record)

    def __len__(self) -> int:
        return len(self.token_ids)

    def positions(self) -> list[int]:
        if self.depths is None:
            return list(range(self.start, self.start + len(self.token_ids)))
        return [self.start + depth for depth in self.depths]


@dataclass
class SegmentOutput:
    logits: torch.Tensor | None  # [rows asked for, vocab]
    hidden: torch.Tensor  # [t, d]: last-layer hidden states (after the final norm)
    # Per logits row: its argmax (greedy's token) and, where the segment asked, its two best
    # logits. Taken for every segment of a step in one pass: a pass over a 49k vocabulary
    # costs ~60 us per call, whatever its rows, and a step of 16 sequences made 16 (or 32).
    greedy: list[int] | None = None
    top2: list[tuple[float, float]] | None = None


def additive_mask(start: int, within: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, t, start + t]: 0 where a row may attend, the dtype's lowest value elsewhere.
    Every row sees the `start` cached entries; among the segment's own rows, those `within`
    ([t, t] bool) marks."""
    rows = within.shape[0]
    allowed = torch.ones(rows, start + rows, dtype=torch.bool, device=within.device)
    allowed[:, start:] = within
    mask = torch.zeros(allowed.shape, dtype=dtype, device=within.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def split_outputs(model: torch.nn.Module, segments: list[Segment], bounds: list[int],
                   hidden: torch.Tensor) -> list[SegmentOutput]:
    """Per segment: its hidden rows, and the LM head on the rows whose logits it wants, all
    segments' rows in one matmul."""
    wanted, counts = [], []
    for segment, first, last in zip(segments, bounds[:-1], bounds[1:], strict=True):
        rows = {"all": range(first, last), "last": range(last - 1, last)}.get(
            segment.logits_rows, range(0))
        wanted.extend(rows)
        counts.append(len(rows))
    logits = greedy = top2 = None
    if wanted:
        first = wanted[0]
        contiguous = wanted == list(range(first, first + len(wanted)))  # a slice: no gather
        rows = hidden[first:first + len(wanted)] if contiguous else hidden[wanted]
        # bf16 -> float32: the same values, and PyTorch's argmax and top-k over a vocabulary
        # run several times faster on float32 than on bf16 (~0.2 ms of a decode step).
        logits = model.lm_head(rows)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:  # Gemma's, as its ForCausalLM applies it (Gemma-3's configs have none)
            logits = torch.tanh(logits / cap) * cap
        greedy, top2 = row_choices(logits, segments, counts)
    outputs, taken = [], 0
    for segment, count, first, last in zip(segments, counts, bounds[:-1], bounds[1:],
                                           strict=True):
        rows = slice(taken, taken + count)
        taken += count
        outputs.append(SegmentOutput(
            logits=logits[rows] if count else None, hidden=hidden[first:last],
            greedy=greedy[rows] if count else None,
            top2=top2[rows] if count and segment.top2 else None))
    return outputs


def row_choices(logits: torch.Tensor, segments: list[Segment], counts: list[int]
                 ) -> tuple[list[int], list[tuple[float, float] | None]]:
    """Every logits row's argmax, and the two best logits of the rows of segments that ask for
    them (None elsewhere); `counts[i]`: segment i's logits rows, in order."""
    greedy = greedy_tokens(logits).tolist()
    top2: list[tuple[float, float] | None] = [None] * len(greedy)
    asked = [row for segment, start, count in zip(segments, accumulate([0] + counts), counts,
                                                  strict=False) if segment.top2
             for row in range(start, start + count)]
    if asked:
        values = top_two((logits if len(asked) == len(greedy) else logits[asked]).float()).tolist()
        for row, (best, second) in zip(asked, values, strict=True):
            top2[row] = (best, second)
    return greedy, top2
