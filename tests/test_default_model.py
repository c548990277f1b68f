"""End to end on the default model (SmolLM2-135M-Instruct): real prompts, real drafts."""

from __future__ import annotations

import json

import pytest
import torch
from drafters_for_tests import OracleDrafter

from dresd.datasets import data_dir, read_jsonl, type_hint_prompts
from dresd.decoding import speculative_generate, supports_tree_attention
from dresd.prompts import encode_prompt
from dresd.runner import GenerationSettings, MethodRunner

MAX_NEW = 24


def real_prompts() -> list[str]:
    """20 varied prompts: code to rewrite, maths, MT-Bench questions, short chat."""
    gsm8k = read_jsonl(data_dir() / "gsm8k" / "test.jsonl")[:5]
    mt_bench = read_jsonl(data_dir() / "mt_bench" / "question.jsonl")[::16][:5]
    return (type_hint_prompts(5) + [row["question"] for row in gsm8k]
            + [row["turns"][0] for row in mt_bench]
            + ["Hi!", "List three colours.", "Repeat after me: the cat sat on the mat.",
               "What is 2+2?", "Write a Python function that reverses a string."])


@pytest.fixture(scope="module")
def encoded(default_target) -> list[list[int]]:
    torch.set_num_threads(1)
    return [encode_prompt(default_target.tokenizer, p) for p in real_prompts()]


@pytest.fixture(scope="module")
def references(default_references, encoded) -> list[list[int]]:
    """`ar`'s outputs, the 20 prompts in one batch (conftest.References: each output is the
    single-stream one, which test_batch, test_regenerate and test_serve check)."""
    return default_references.many(encoded, MAX_NEW)


def test_default_model_takes_tree_masks(default_target):
    assert supports_tree_attention(default_target.model)


def test_pld_greedy_is_identical_to_generate(default_target, encoded, references):
    runner = MethodRunner(default_target, "pld", GenerationSettings(MAX_NEW), num_drafts=3)
    results = [runner.generate(ids) for ids in encoded]
    assert [r.token_ids for r in results] == references
    assert sum(s.num_accepted for r in results for s in r.steps) > 0  # PLD did draft and hit


def test_oracle_trees_are_identical_to_generate(default_target, encoded, references):
    """Drafts of the model's own future (with a wrong sibling) through the real model."""
    eos = default_target.eos_token_ids
    for ids, ref in zip(encoded, references, strict=True):
        drafter = OracleDrafter(len(ids), ref, draft_len=8, corrupt=0.5, seed=len(ids),
                                vocab_size=default_target.model.config.vocab_size)
        result = speculative_generate(default_target.model, drafter, torch.tensor([ids]),
                                      max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert result.token_ids == ref


def test_stop_strings_end_where_generate_ends(default_target, default_references, encoded):
    stops = ["\n", "."]
    pld = MethodRunner(default_target, "pld", GenerationSettings(40, stop_strings=stops))
    stopped = 0
    for ids, expected in zip(encoded[:8], default_references.many(encoded[:8], 40, stops),
                             strict=True):
        result = pld.generate(ids)
        assert result.token_ids == expected
        stopped += result.stop_reason == "stop_string"
    assert stopped >= 4


def test_cli_generate_json(default_target, capsys):
    from dresd.cli.main import main

    code = main(["generate", "--method", "pld", "--prompt", "Say hello.", "--max-new-tokens",
                 "8", "--json", "--threads", "1"])
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ["text", "token_ids", "num_new_tokens", "tokens_per_s", "mean_accepted_length",
                "acceptance_rate", "num_target_forwards", "per_position_acceptance"]:
        assert key in record
    assert record["num_new_tokens"] == len(record["token_ids"]) <= 8
    assert record["text"] == default_target.tokenizer.decode(record["token_ids"],
                                                             skip_special_tokens=True)
