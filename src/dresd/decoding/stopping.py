"""Where a generation ends: exactly where plain decoding would."""

from __future__ import annotations

from collections.abc import Sequence

from transformers.tokenization_utils_base import PreTrainedTokenizerBase


class StoppingRule:
    """Ends generation exactly where plain decoding would: after an EOS token, after the token
    that completes a stop string, or at `max_new_tokens`. Checked after every emitted token."""

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer to decode the output")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.tokenizer = tokenizer
        # Enough trailing tokens to hold the longest stop string (every token is >= 1 char).
        self.window = max((len(s) for s in self.stop_strings), default=0) + 2

    def reason(self, new_tokens: list[int]) -> str | None:
        if new_tokens and new_tokens[-1] in self.eos_token_ids:
            return "eos"
        if self.stop_strings:
            tail = self.tokenizer.decode(new_tokens[-self.window :])
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if len(new_tokens) >= self.max_new_tokens:
            return "max_new_tokens"
        return None
