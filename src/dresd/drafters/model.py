"""Classic speculative decoding: a small draft model that shares the target's tokenizer.

The draft model decodes `draft_len` tokens greedily after the context; that single chain is the
draft. It keeps its own KV cache between steps: at each step the cache is cut back to the
longest prefix it shares with the context (the target may have rejected some drafted tokens),
the context tokens it has not seen are fed in one forward, and then it decodes one token per
forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from dresd.decoding.cache import rollback_cache
from dresd.decoding.drafter import Draft, DraftContext, Drafter
from dresd.decoding.sampling import greedy_tokens
from dresd.errors import UserError


@dataclass(frozen=True)
class DraftModelOptions:
    """DraftModelDrafter's options (`--draft-model`, `--draft-len`)."""

    model: PreTrainedModel | None = None  # the small model; shares the target's vocabulary
    draft_len: int = 5  # tokens per draft: one small-model forward each

    def __post_init__(self) -> None:
        if self.model is None:
            raise UserError("the draft method needs a draft model (--draft-model)")
        if self.draft_len < 1:
            raise UserError("draft_len must be >= 1")


class DraftModelDrafter(DraftModelOptions, Drafter):
    """Its options and the small model's KV cache of the generation it drafts for."""

    name = "draft"
    cache: DynamicCache | None  # None until its first step
    cached_tokens: list[int]  # the tokens `cache` holds

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cache = None
        self.cached_tokens = []

    def fork(self) -> DraftModelDrafter:
        """The same small model with a KV cache of its own (one per generation)."""
        return dataclasses.replace(self)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> list[Draft]:
        tokens = context.token_ids.tolist()
        draft_len = min(self.draft_len, context.max_draft_len)
        if draft_len < 1:
            return []
        self._sync_cache(tokens)
        # Feed what the cache has not seen (at least the last token), then decode greedily.
        unseen = tokens[len(self.cached_tokens) :]
        draft: Draft = []
        for _ in range(draft_len):
            logits = self._forward(unseen)
            unseen = [int(greedy_tokens(logits))]
            draft.append(unseen[0])
        return [draft]

    def _sync_cache(self, tokens: list[int]) -> None:
        """Cut the cache back to its longest common prefix with `tokens`, leaving >= 1 unseen.
        A new prompt simply shares a shorter prefix (often the chat template's preamble)."""
        if self.cache is None:
            self.cache = rollback_cache(self.model.config)
        common = 0
        limit = min(len(tokens) - 1, len(self.cached_tokens))
        while common < limit and tokens[common] == self.cached_tokens[common]:
            common += 1
        self.cache.crop(common - self.cache.get_seq_length())
        self.cached_tokens = tokens[:common]

    def _forward(self, new_tokens: list[int]) -> torch.Tensor:
        start = len(self.cached_tokens)
        device = next(self.model.parameters()).device  # the draft model's, like the target's
        positions = torch.arange(start, start + len(new_tokens), device=device)[None]
        out = self.model(input_ids=torch.tensor([new_tokens], device=device),
                         position_ids=positions, cache=self.cache, use_cache=True,
                         logits_to_keep=1)
        self.cached_tokens += new_tokens
        return out.logits[0, -1]
