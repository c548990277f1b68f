"""Unit tests of the small pieces: token tree, PLD, KV-cache compaction, figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from dresd.decoding.cache import keep_cache_entries
from dresd.decoding.generate import target_forward
from dresd.decoding.tree import DraftTree
from dresd.drafters import DraftContext, PromptLookupDrafter, make_drafter
from dresd.kernels import drafting
from dresd.metrics import GenerationResult, StepRecord, summarize


def test_tree_merges_shared_prefixes():
    tree = DraftTree.from_drafts(7, [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]])
    assert tree.tokens == [7, 1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.depths == [0, 1, 2, 3, 3, 1]
    assert tree.num_drafted == 5 and tree.depth == 3 and not tree.is_linear()
    assert tree.path_to(4) == [0, 1, 2, 4]
    assert DraftTree.from_drafts(7, [[1, 2], [1, 2, 3]]).is_linear()


def test_tree_mask_and_positions():
    tree = DraftTree.from_drafts(7, [[1, 2], [3]])
    mask = tree.attention_mask(prefix_len=2, dtype=torch.float32)[0, 0]
    allowed = (mask == 0).int().tolist()
    # columns: 2 cached entries, then nodes 0 (root), 1, 2, 3
    assert allowed == [[1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 1, 0],
                       [1, 1, 1, 0, 0, 1]]
    assert tree.position_ids(2).tolist() == [[2, 3, 4, 3]]


def context(tokens: list[int], max_draft_len: int = 50) -> DraftContext:
    return DraftContext(np.array(tokens, dtype=np.int64), torch.zeros(1), max_draft_len)


def test_pld_prefers_the_longest_ngram_then_the_most_recent_match():
    drafter = PromptLookupDrafter(max_ngram=3, draft_len=3, num_drafts=2)
    # "1 2 3" occurs once (followed by 9 9); "2 3" also occurs later (followed by 5 5).
    tokens = [1, 2, 3, 9, 9, 0, 2, 3, 5, 5, 0, 1, 2, 3]
    assert drafter.propose(context(tokens)) == [[9, 9, 0]]
    # Only the 2-gram "2 3" matches: the most recent continuation first.
    tokens = [1, 2, 3, 9, 9, 0, 2, 3, 5, 5, 0, 7, 2, 3]
    assert drafter.propose(context(tokens)) == [[5, 5, 0], [9, 9, 0]]
    assert drafter.propose(context([4, 5, 6])) == []
    assert drafter.propose(context(tokens, max_draft_len=1)) == [[5], [9]]


def brute_force_pld(tokens: list[int], max_ngram: int, min_ngram: int, draft_len: int,
                    num_drafts: int) -> list[list[int]]:
    """PLD written plainly: every earlier window, longest n first, most recent first."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        drafts: list[list[int]] = []
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                draft = tokens[start + n : start + n + draft_len]
                if draft not in drafts and len(drafts) < num_drafts:
                    drafts.append(draft)
        if drafts:
            return drafts
    return []


@pytest.mark.parametrize("compiled", [True, False], ids=["C", "numpy"])
@pytest.mark.parametrize("seed", range(4))
def test_pld_equals_brute_force_on_random_contexts(seed, compiled, monkeypatch):
    if compiled and drafting.kernel() is None:
        pytest.skip("no C compiler: numpy drafts")
    if not compiled:
        monkeypatch.setattr(drafting, "kernel", lambda: None)
    rng = np.random.default_rng(seed)
    found = 0
    for trial in range(200):
        options = dict(max_ngram=int(rng.integers(1, 5)), draft_len=int(rng.integers(1, 6)),
                       num_drafts=int(rng.integers(1, 4)))
        options["min_ngram"] = int(rng.integers(1, options["max_ngram"] + 1))
        # A small vocabulary, so that n-grams recur at every length.
        tokens = rng.integers(0, 2 + trial % 5, size=int(rng.integers(1, 40))).tolist()
        drafts = PromptLookupDrafter(**options).propose(context(tokens))
        assert drafts == brute_force_pld(tokens, **options)
        found += bool(drafts)
    assert found > 100


def test_make_drafter_rejects_unknown_methods():
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        make_drafter("magic")
    assert make_drafter("pld", num_drafts=4, k=None).num_drafts == 4


@torch.inference_mode()
def test_compacted_cache_equals_the_cache_of_the_accepted_tokens():
    from conftest import tiny_model

    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=model.config)
    target_forward(model, prompt[:, :-1], cache)
    tree = DraftTree.from_drafts(8, [[1, 2, 3], [9, 10], [9, 11, 12]])
    mask = tree.attention_mask(3, torch.float64)
    target_forward(model, tree.input_ids(), cache, tree.position_ids(3), mask)
    keep_cache_entries(cache, 3, tree.path_to(7))  # root -> 9 -> 11 -> 12

    expected = DynamicCache(config=model.config)
    target_forward(model, torch.tensor([[5, 6, 7, 8, 9, 11, 12]]), expected)
    assert cache.get_seq_length() == 7
    for got, want in zip(cache.layers, expected.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)


def test_summary_formulas():
    steps = [StepRecord(4, 3, 3, 0.1, 0.4), StepRecord(2, 0, 1, 0.1, 0.4)]
    result = GenerationResult(token_ids=list(range(6)), steps=steps, total_seconds=2.0,
                              num_target_forwards=3)
    figures = summarize([result, GenerationResult([1, 2], total_seconds=2.0,
                                                  num_target_forwards=2)])
    assert figures["num_new_tokens"] == 8 and figures["num_target_forwards"] == 5
    assert figures["mean_accepted_length"] == 8 / 5
    assert figures["acceptance_rate"] == 3 / 6
    assert figures["per_position_acceptance"] == [1 / 2, 1 / 1, 1 / 1]
    assert figures["drafted_tokens_per_step"] == 3.0
    assert figures["tokens_per_s"] == 8 / 4.0
    assert figures["draft_time_share"] == pytest.approx(0.2 / 4.0)


@pytest.mark.parametrize("seed", range(20))
def test_distinct_padded_is_the_papers_shape_of_the_unpadded_drafts(seed):
    """DReSD's paper shape read block by block from padded rows (`distinct_padded`) gives the
    reference `distinct_drafts` of the same drafts: repeats, empty rows, too few distinct ones."""
    from dresd.drafters.dense import distinct_drafts, distinct_padded, padded, unpadded

    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 6))
    pool = [rng.integers(0, 4, size=int(rng.integers(0, width + 1))).tolist()
            for _ in range(int(rng.integers(1, 8)))]  # few distinct drafts, empty ones too
    drafts = [pool[int(i)] for i in rng.integers(0, len(pool), size=int(rng.integers(0, 120)))]
    rows = padded(drafts, width)
    for num_drafts in (1, 2, 3, 10, 50):
        assert distinct_padded(rows, num_drafts) == distinct_drafts(unpadded(rows), num_drafts)
