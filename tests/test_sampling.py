"""Speculative sampling draws from the model's own distribution.

Method: a tiny model with an 8-token vocabulary, so that exact distributions are cheap. Each run
generates 3 tokens x1 x2 x3 with its own seed and its own random draft trees: x1 comes from the
prefill, x2 is sampled at the root of the first tree, x3 at a child (when x2 matched a draft)
or at the next root. The empirical distributions of x2 ("next token") and of (x2, x3) ("two
steps") are compared with the exact ones by a chi-square goodness-of-fit test at level 1e-3:
a correct implementation fails one of these four tests with probability under 0.4% over the
choice of seeds (the seeds are fixed, so the outcome is reproducible).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafters_for_tests import RandomTreeDrafter
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dresd.decoding import SamplingConfig, speculative_generate
from dresd.decoding.sampling import greedy_tokens, next_token_probs, process_logits, top_two

VOCAB = 8
PROMPT = [1, 2, 3]
RUNS = 3000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def small_vocab_model():
    return make_small_vocab_model()


def make_small_vocab_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.12, eos_token_id=None, bos_token_id=None,
                         pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


@torch.inference_mode()
def exact_distributions(model, config: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """p(x2) and p(x2, x3), marginalised over x1, from full forwards of every continuation."""
    def probs_after(sequences: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(sequences)).logits[:, -1]
        return next_token_probs(logits, config)

    p1 = probs_after([PROMPT])[0]  # [x1]
    p2 = probs_after([PROMPT + [a] for a in range(VOCAB)])  # [x1, x2]
    p3 = probs_after([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint = p1[:, None, None] * p2[:, :, None] * p3.reshape(VOCAB, VOCAB, VOCAB)
    return joint.sum(dim=(0, 2)).numpy(), joint.sum(dim=0).numpy()


def sampled_counts(model, config: SamplingConfig) -> tuple[np.ndarray, np.ndarray, int]:
    next_counts = np.zeros(VOCAB)
    pair_counts = np.zeros((VOCAB, VOCAB))
    accepted = 0
    for run in range(RUNS):
        run_config = SamplingConfig(config.temperature, config.top_k, config.top_p, seed=run)
        drafter = RandomTreeDrafter(VOCAB, seed=run, max_drafts=4, max_len=3)
        result = speculative_generate(model, drafter, torch.tensor([PROMPT]), max_new_tokens=3,
                                      sampling=run_config)
        _, x2, x3 = result.token_ids
        next_counts[x2] += 1
        pair_counts[x2, x3] += 1
        accepted += sum(step.num_accepted for step in result.steps)
    return next_counts, pair_counts, accepted


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; cells expected below 5 are pooled so the approximation holds."""
    probs = probs.ravel().astype(np.float64)
    counts, expected = counts.ravel(), probs / probs.sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the model gives probability 0"
    return chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("config", [
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_p=0.8),
], ids=["temperature", "top-p"])
def test_speculative_sampling_matches_model_distribution(small_vocab_model, config):
    next_probs, pair_probs = exact_distributions(small_vocab_model, config)
    next_counts, pair_counts, accepted = sampled_counts(small_vocab_model, config)
    assert accepted > RUNS // 10, "the draft trees should often be accepted, or nothing is tested"
    assert goodness_of_fit(next_counts, next_probs) > ALPHA
    assert goodness_of_fit(pair_counts, pair_probs) > ALPHA
    # The same samples are clearly distinguishable from a slightly different distribution,
    # so the test has the power to notice a wrong one.
    other = SamplingConfig(config.temperature * 1.3, config.top_k, config.top_p)
    _, other_pairs = exact_distributions(small_vocab_model, other)
    assert goodness_of_fit(pair_counts, other_pairs) < ALPHA


@pytest.mark.parametrize("config", [
    SamplingConfig(temperature=0.6),
    SamplingConfig(top_k=5),
    SamplingConfig(top_p=0.7),
    SamplingConfig(temperature=1.3, top_k=20, top_p=0.9),
])
def test_processing_matches_transformers(config):
    """Our temperature/top-k/top-p equal transformers' warpers, in their order."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    expected = logits.clone()
    warpers = [TemperatureLogitsWarper(config.temperature)]
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1:
        warpers.append(TopPLogitsWarper(config.top_p))
    for warper in warpers:
        expected = warper(None, expected)
    assert torch.equal(torch.isinf(process_logits(logits, config)), torch.isinf(expected))
    torch.testing.assert_close(next_token_probs(logits, config), expected.softmax(-1))


@pytest.mark.parametrize("bad", [dict(temperature=0), dict(temperature=-1), dict(top_p=0),
                                 dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_sampling_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


@pytest.mark.parametrize("vocab", [1, 7, 2047, 2048, 2049, 5000, 49152])
def test_greedy_tokens_and_top_two_are_torchs(vocab):
    """The two-pass argmax and top two give torch.argmax's indices (first of equal maxima, a
    NaN the largest) and torch.topk's values, on random rows, rows of many ties, and rows with
    a NaN, whatever the vocabulary's remainder past whole blocks."""
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        rows = 1 + trial
        logits = torch.randn(rows, vocab, generator=generator)
        if trial % 3 == 1:  # few distinct values: ties inside and across blocks
            logits = torch.randint(0, 3, (rows, vocab), generator=generator).float()
        if trial % 3 == 2:
            logits[0, int(torch.randint(0, vocab, (1,), generator=generator))] = torch.nan
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        assert torch.equal(greedy_tokens(logits[-1]), logits[-1].argmax(-1))
        if trial % 3 != 2 and vocab >= 2:
            assert torch.equal(top_two(logits), logits.topk(2, dim=-1).values)
