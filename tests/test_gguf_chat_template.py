"""A GGUF file's own chat template reaches its tokenizer (transformers' GGUF reading leaves it
out), so chat prompts to a GGUF model are the template's, not raw text."""

from __future__ import annotations

from gguf_files import write_tiny_gguf
from transformers import AutoTokenizer

from dresd.models.gguf import load_gguf
from dresd.models.target import ensure_default_model
from dresd.prompts import encode_prompt


def test_a_files_chat_template_is_its_tokenizers(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    reference = AutoTokenizer.from_pretrained(ensure_default_model())
    for _ in range(2):  # the first load saves the tokenizer in the cache; the second reads it
        tokenizer = load_gguf(path)[1]
        assert tokenizer.chat_template == reference.chat_template
        assert encode_prompt(tokenizer, "What is 2 plus 3?", True) == encode_prompt(
            reference, "What is 2 plus 3?", True)
