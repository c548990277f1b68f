"""Turn a user's prompt into the token ids the model sees.

By default the tokenizer's chat template wraps the prompt as one user turn and opens the
assistant's turn, which is how an instruction-tuned model expects to be asked. Without a
template (or with `chat_template=False`) the raw text is tokenized as it is.
"""

from __future__ import annotations

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.errors import UserError


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool = True
) -> list[int]:
    """Token ids of `prompt`, chat-formatted when the tokenizer has a template and it is wanted."""
    if not prompt.strip():
        raise UserError("the prompt is empty")
    if chat_template and tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        # Depending on the tokenizer this is a list of ids or a BatchEncoding.
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]
