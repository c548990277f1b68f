"""Predicted outputs: the prediction is one more draft source for every method, so the output
is still the model's own (greedy: token for token), and a right prediction is accepted whole."""

from __future__ import annotations

import numpy as np
from test_batch import mixed_drafter, run_batched
from test_lossless_greedy import reference_greedy, varied_prompts

from dresd.decoding.batch import Request
from dresd.drafters import NoDrafter
from dresd.drafters.prediction import PredictionSource, prediction_tokens, with_prediction


def spoiled(reference: list[int], rng: np.random.Generator, vocab: int) -> list[int]:
    """The reference with an edit: a few tokens replaced, a span dropped, a span inserted."""
    edited = list(reference)
    for at in rng.integers(0, len(edited), 2):
        edited[at] = int(rng.integers(vocab))
    cut = int(rng.integers(0, len(edited)))
    del edited[cut:cut + 3]
    return edited[:cut] + rng.integers(0, vocab, 2).tolist() + edited[cut:]


def test_every_method_with_a_prediction_is_lossless(tiny):
    rng = np.random.default_rng(3)
    vocab = tiny.config.vocab_size
    prompts = varied_prompts(12, seed=9)
    references = [reference_greedy(tiny, prompt, 24) for prompt in prompts]
    requests = []
    for index, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        prediction = (reference if index % 3 == 0 else spoiled(reference, rng, vocab)
                      if index % 3 == 1 else rng.integers(0, vocab, 30).tolist())
        drafter = with_prediction(mixed_drafter(index, prompt, reference), prediction,
                                  len(prompt))
        requests.append(Request(prompt=prompt, drafter=drafter, max_new_tokens=24))
    results = run_batched(tiny, requests, rng.integers(0, 5, len(requests)).tolist(), 5)
    for result, reference in zip(results, references, strict=True):
        assert result.token_ids == reference


def test_a_right_prediction_is_accepted_whole(tiny):
    prompt = varied_prompts(3, seed=4)[1]
    reference = reference_greedy(tiny, prompt, 32)
    plain = run_batched(tiny, [Request(prompt=prompt, drafter=NoDrafter(),
                                       max_new_tokens=32)], [0], 1)[0]
    predicted = run_batched(tiny, [Request(
        prompt=prompt, drafter=with_prediction(NoDrafter(), reference, len(prompt)),
        max_new_tokens=32)], [0], 1)[0]
    assert predicted.token_ids == plain.token_ids == reference
    assert predicted.num_target_forwards <= 4 < plain.num_target_forwards == 32
    assert prediction_tokens(reference, predicted.token_ids) == (32, 0)


def test_prediction_tokens_count_what_appears_in_order():
    assert prediction_tokens([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == (4, 1)
    assert prediction_tokens([7, 7], [1, 2]) == (0, 2)
    assert prediction_tokens([], [1]) == (0, 0)


def test_a_prediction_shorter_than_the_output_drafts_nothing_past_it():
    drafter = PredictionSource([5, 6], prompt_len=0, min_match=1)
    assert drafter.predicted(np.array([1, 2, 3, 4, 5])) == [6]
    assert drafter.predicted(np.array([9, 9, 9, 9, 9, 9, 9, 9, 9, 6])) == []
    assert PredictionSource([], prompt_len=0).predicted(np.array([1, 2, 3])) == []


def test_hybrid_weighs_the_prediction_as_one_of_its_sources(tiny):
    """In `hybrid` the prediction is one more source: its nodes carry its name in the
    acceptance table (learned apart, cut by the budget), the shared drafter is left as it was,
    and the output is plain decoding's."""
    from dresd.drafters import HybridDrafter

    prompt = varied_prompts(3, seed=4)[1]
    reference = reference_greedy(tiny, prompt, 32)
    shared = HybridDrafter(cost={size: 1.0 + 0.01 * size for size in range(1, 65)})
    drafter = with_prediction(shared, reference, len(prompt))
    assert "prediction" in drafter.sources and "prediction" not in shared.sources
    result = run_batched(tiny, [Request(prompt=prompt, drafter=drafter, max_new_tokens=32)],
                         [0], 1)[0]
    assert result.token_ids == reference
    assert result.num_target_forwards <= 8  # the right prediction, accepted a draft at a time
    tried = {cell: counts for cell, counts in drafter.table.counts.items()
             if "prediction" in cell.sources}
    assert tried and sum(accepted for accepted, _ in tried.values()) >= 16
