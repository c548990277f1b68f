"""A tiny random model with the default model's tokenizer: a real tokenizer for corpora,
a forward that costs nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from dresd.models.target import Target, default_model_dir

WORDS = ["sea", "prime", "number", "python", "list", "poem", "wave", "code", "river", "sun"]


def tiny_target(name: str = "tiny-random", seed: int = 0) -> Target:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return Target(AutoModelForCausalLM.from_config(config).eval(), tokenizer, name)


def word_corpus(path: Path, documents: int = 12, words: int = 60, seed: int = 0) -> Path:
    """A .jsonl of `documents` prompt/response pairs of random words."""
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"prompt": f"Question {i}",
                                        "response": " ".join(rng.choice(WORDS, words))}) + "\n"
                            for i in range(documents)))
    return path
