"""Greedy speculative output must be token for token `model.generate`'s greedy output."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, tiny_model
from drafters_for_tests import FixedDrafter, OracleDrafter, RandomTreeDrafter
from transformers import LlamaForCausalLM

from dresd.decoding import speculative_generate, supports_tree_attention
from dresd.drafters import DraftModelDrafter, HybridDrafter, NoDrafter, PromptLookupDrafter


def varied_prompts(count: int = 24, seed: int = 0) -> list[list[int]]:
    """Random prompts of many lengths, a third of them repetitive so that PLD finds matches."""
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        length = int(rng.integers(1, 60))
        if i % 3 == 0:
            motif = rng.integers(0, TINY_VOCAB, int(rng.integers(2, 8))).tolist()
            prompts.append((motif * 20)[:length])
        else:
            prompts.append(rng.integers(0, TINY_VOCAB, length).tolist())
    return prompts


# model -> {(prompt, max_new_tokens, eos): output}: a model's greedy output is computed once a
# session, however many drafters (and modules: test_suffix) are checked against it.
_references: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None):
    """`model.generate`'s greedy output, computed once per model, prompt, length and EOS."""
    known = _references.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens, eos)
    if key not in known:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
        known[key] = out[0, len(prompt) :].tolist()
    return list(known[key])


def spec(model, drafter, prompt, max_new_tokens, eos=None):
    return speculative_generate(model, drafter, torch.tensor([prompt]),
                                max_new_tokens=max_new_tokens,
                                eos_token_ids=[] if eos is None else [eos])


@pytest.mark.parametrize("make_drafter", [
    lambda prompt, ref: NoDrafter(),
    lambda prompt, ref: PromptLookupDrafter(num_drafts=3),
    lambda prompt, ref: RandomTreeDrafter(TINY_VOCAB, seed=len(prompt)),
    lambda prompt, ref: OracleDrafter(len(prompt), ref, draft_len=12, corrupt=0.3,
                                      seed=len(prompt), vocab_size=TINY_VOCAB),
    lambda prompt, ref: FixedDrafter([]),  # an empty draft
    lambda prompt, ref: FixedDrafter([list(range(100))]),  # longer than all that remains
    lambda prompt, ref: HybridDrafter(cost={1: 1.0, 64: 1.0}),  # PLD candidates, all kept
], ids=["none", "pld", "random-trees", "oracle", "empty-draft", "very-long-draft", "hybrid"])
def test_greedy_matches_generate(tiny, make_drafter):
    for prompt in varied_prompts():
        ref = reference_greedy(tiny, prompt, 40)
        result = spec(tiny, make_drafter(prompt, ref), prompt, 40)
        assert result.token_ids == ref, f"prompt {prompt}"
        assert result.stop_reason == "max_new_tokens"
        assert len(result.steps) + 1 == result.num_target_forwards


def test_oracle_drafts_are_fully_accepted(tiny):
    """The model's own future is accepted in full: one forward per draft_len + 1 tokens."""
    prompt = varied_prompts()[1]
    ref = reference_greedy(tiny, prompt, 61)
    result = spec(tiny, OracleDrafter(len(prompt), ref, draft_len=9), prompt, 61)
    assert result.token_ids == ref
    # 1 token from the prefill, then every step accepts all 9 drafted tokens + 1 bonus.
    assert [s.num_accepted for s in result.steps] == [9] * 6
    assert result.num_target_forwards == 7


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 13])
def test_max_new_tokens_boundary(tiny, max_new_tokens):
    for prompt in varied_prompts(6, seed=1):
        ref = reference_greedy(tiny, prompt, max_new_tokens)
        long_ref = reference_greedy(tiny, prompt, max_new_tokens + 20)
        drafter = OracleDrafter(len(prompt), long_ref, draft_len=20)
        result = spec(tiny, drafter, prompt, max_new_tokens)
        assert result.token_ids == ref
        # Drafts never reach past the last token that may still be generated.
        assert all(step.draft_depth <= max_new_tokens - 1 for step in result.steps)


def test_eos_inside_a_draft_ends_generation_there(tiny):
    checked = 0
    for prompt in varied_prompts(12, seed=2):
        free_run = reference_greedy(tiny, prompt, 30)
        eos = free_run[len(free_run) // 2]  # a token that the model emits mid-way
        ref = reference_greedy(tiny, prompt, 30, eos=eos)
        assert ref[-1] == eos
        # The oracle drafts the free run, which continues past the EOS.
        drafter = OracleDrafter(len(prompt), free_run, draft_len=15)
        result = spec(tiny, drafter, prompt, 30, eos=eos)
        assert result.token_ids == ref
        assert result.stop_reason == "eos"
        checked += 1
    assert checked == 12


def test_tree_attention_is_detected(tiny):
    assert supports_tree_attention(tiny)


class MaskIgnoringLlama(LlamaForCausalLM):
    """A model that silently drops custom attention masks (as some attention kernels do)."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_model_ignoring_the_mask_falls_back_to_one_linear_draft():
    model = MaskIgnoringLlama(tiny_model("llama").config).to(torch.float64).eval()
    assert not supports_tree_attention(model)
    for prompt in varied_prompts(8, seed=3):
        ref = reference_greedy(model, prompt, 30)
        drafter = RandomTreeDrafter(TINY_VOCAB, seed=len(prompt))
        result = spec(model, drafter, prompt, 30)
        assert result.token_ids == ref
        assert all(step.num_drafted == step.draft_depth for step in result.steps)  # linear


def test_small_draft_model_is_lossless_and_reuses_its_cache(tiny):
    draft_model = tiny_model("llama", seed=1)  # another random model over the same vocabulary
    drafter = DraftModelDrafter(draft_model, draft_len=4)
    for prompt in varied_prompts(10, seed=4):  # one drafter across prompts, as in a bench
        ref = reference_greedy(tiny, prompt, 30)
        assert spec(tiny, drafter, prompt, 30).token_ids == ref


def test_target_as_its_own_draft_model_is_always_accepted(tiny):
    drafter = DraftModelDrafter(tiny, draft_len=4)
    prompt = varied_prompts()[2]
    result = spec(tiny, drafter, prompt, 31)
    assert result.token_ids == reference_greedy(tiny, prompt, 31)
    assert [s.num_accepted for s in result.steps] == [4] * 6
